"""Where a sweep's time goes: engine and reference compute against the sweep's own overhead.

    .venv/bin/python benchmarks/bench_sweep.py                      # the demo sweep (vLLM CPU), fresh
    .venv/bin/python benchmarks/bench_sweep.py --spec SPEC.toml     # any sweep spec
    .venv/bin/python benchmarks/bench_sweep.py --from reports/sweep-demo   # split a finished sweep
    .venv/bin/python benchmarks/bench_sweep.py --smoke              # the spec's reference axes, tiny: one engine start

Compute is what an engine or the reference does: engine start and stop, generation, the engine's
prefill re-scoring, the determinism checks, reference load and scoring. Overhead is everything
else the sweep adds around them: checking inputs and preparing each run directory, the metrics
pass, each point's figures and report, the sweep's intervals and its own pages. The issue's bar:
overhead under 10% of the total.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import smoke  # benchmarks/smoke.py: the --smoke flag

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ("generation_s", "prefill_s")
REFERENCE = ("reference_load_s", "scoring_s")
OVERHEAD = ("setup_s", "metrics_s", "figures_s", "report_s")
# the spec's settings at a smoke size; its sweep keeps the axes of [reference] settings (every point
# re-scores the baseline's tokens: one engine start) and one baseline; vLLM in the engine worker
SMOKE = {"max_prompts": 2, "sampling.n": 1, "sampling.max_tokens": 8}
SMOKE_SWEEP = {"repeats": 1, "determinism_sequences": 2, "n_boot": 100}


def smoke_spec(path: str):
    """The spec at ``path`` at a smoke size: one engine start, a handful of tokens."""
    from mismatch_probe.config.spec_reading import apply_overrides, load_spec_file

    spec = load_spec_file(path)
    overrides = dict(SMOKE)
    if spec.engine.name == "vllm":
        overrides["engine.distributed_executor_backend"] = "uni"  # with VLLM_ENABLE_V1_MULTIPROCESSING=0
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    spec = apply_overrides(spec, overrides, named_by="set")
    axes = [a for a in spec.sweep.axes if all(k.startswith("reference.") for k in a.keys)]
    if not axes:
        raise SystemExit(f"{path}: --smoke keeps the sweep's [reference] axes (one engine start); it has none")
    return spec.model_copy(update={"sweep": spec.sweep.model_copy(update={"axes": axes, **SMOKE_SWEEP})})


def split(sweep_dir: Path, wall: float | None = None) -> dict:
    rec = json.loads((sweep_dir / "sweep.json").read_text())
    t = rec["timings"]
    runs = [json.loads(p.read_text())["timings"] for p in sorted((sweep_dir / "points").glob("*/run.json"))]

    def total(keys):
        return sum(r.get(k, 0.0) for r in runs for k in keys)

    # a resumed sweep: its invocations together (each point's run.json covers the runs it made)
    inv = [i["timings"] for i in rec.get("invocations") or [{"timings": t}]]

    def across(key):
        return sum(i.get(key, 0.0) for i in inv)

    engine = across("engine_start_s") + across("engine_stop_s") + across("determinism_s") + total(ENGINE)
    reference = total(REFERENCE)
    whole = wall if wall is not None else across("total_s")
    parts = {k: total((k,)) for k in OVERHEAD}
    parts["summary_s"] = across("summary_s")
    return {
        "runs": len(runs),
        "engine_starts": rec["engine_starts"],
        "total_s": round(whole, 1),
        "engine_s": round(engine, 1),
        "reference_s": round(reference, 1),
        "overhead_s": round(whole - engine - reference, 1),
        "overhead_share": round((whole - engine - reference) / whole, 4),
        "overhead_parts_s": {k: round(v, 1) for k, v in parts.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "probes" / "sweep-demo.toml"))
    ap.add_argument("--from", dest="finished", help="a finished sweep directory: split its recorded timings")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.finished:
        print(json.dumps(split(Path(args.finished)), indent=2))
        return
    import mismatch_probe

    spec = smoke_spec(args.spec) if args.smoke else args.spec
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = mismatch_probe.sweep(spec, out=Path(tmp) / "sweep")
        wall = time.perf_counter() - t0
        failed = {p.name: p.reason for p in result.record.points if p.status == "failed"}
        if failed:  # a refused point is the sweep's answer; a failed one, no timing of it
            raise SystemExit(f"points failed: {json.dumps(failed, indent=2)}")
        print(json.dumps(split(Path(tmp) / "sweep", wall), indent=2))


if __name__ == "__main__":  # vLLM's engine workers re-import the main module
    sys.exit(main())

"""What sampling in rounds costs: an adaptive run (--precision) against one batch of the same samples.

    .venv/bin/python benchmarks/bench_adaptive.py                        # the demo spec (vLLM CPU), n 16, ±5%
    .venv/bin/python benchmarks/bench_adaptive.py --precision 0.1 --n 4 --spec probes/demo-hf.toml
    .venv/bin/python benchmarks/bench_adaptive.py --smoke                # the HF engine, a handful of tokens

Two runs through the library's ``compare``, each with its own engine start:

1. the adaptive run samples in rounds until K3's interval is within ``--precision`` (or its budget is
   spent), each round scored by the reference beside the running engine: N samples in all;
2. the batch run samples the same N samples at once: the same prompts in the same order (a prompts
   file that repeats them as the rounds do), n and settings the same, no --precision.

Compared: what the samples cost each run: generation, the engine's prefill, the reference's scoring,
and for the rounds K3's interval after each (``precision_s``). The engine's start and stop and the
reference's load happen once in each run and are left out. The issue's bar: rounds <= 1.10x the batch.

The default size (the demo's 32 prompts x 16 = 512 samples a first round, ±5%) keeps the engine's
batches full: a shard is one batch, and on a model this small a decode step costs about the same at
any batch size, so a round of a few samples costs nearly a whole batch. At the demo's own n = 4 (128
samples, half a shard) rounds measure that fixed cost of a batch, not the cost of sampling in rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import smoke  # benchmarks/smoke.py: the --smoke flag

ROOT = Path(__file__).resolve().parents[1]
COST = ("generation_s", "prefill_s", "scoring_s", "precision_s")
# at the smoke size: 4 prompts x 2, 8 tokens, a target the first round cannot meet (a second round runs)
SMOKE = {"max_prompts": 4, "sampling.n": 2, "sampling.max_tokens": 8, "shard_size": 4}
SMOKE_PRECISION = 0.02
SMOKE_MAX_SAMPLES = 24


def repeated_prompts(prompts: Path, n_prompts: int, count: int, out: Path) -> Path:
    """A prompts file whose first ``count`` lines are the first ``n_prompts`` of ``prompts`` over and
    over, as the rounds answer them (pipeline/runs.py: shard_samples), each with an id of its own."""
    lines = [json.loads(x) for x in prompts.read_text().splitlines() if x.strip()][:n_prompts]
    rows = []
    for k in range(count):
        row = dict(lines[k % len(lines)])
        row["id"] = f"{row.get('id', k % len(lines))}-{k // len(lines)}"
        rows.append(json.dumps(row))
    out.write_text("\n".join(rows) + "\n")
    return out


def cost(timings: dict) -> float:
    return sum(timings.get(k, 0.0) for k in COST)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "probes" / "demo.toml"), help="a run spec (default: the demo)")
    ap.add_argument("--precision", type=float, default=0.05, help="the adaptive run's target (default 0.05)")
    ap.add_argument("--n", type=int, default=16, help="samples per prompt (default 16: a first round of full batches)")
    ap.add_argument("--max-samples", type=int, default=None, help="the adaptive run's budget of samples")
    ap.add_argument("--out", default=None, help="where both runs go (default: a temporary directory)")
    smoke.add_flag(ap)
    args = ap.parse_args()

    from mismatch_probe.config.spec_reading import apply_overrides, load_spec_file
    from mismatch_probe.pipeline import compare

    spec_path = str(ROOT / "probes" / "demo-hf.toml") if args.smoke and args.spec.endswith("demo.toml") else args.spec
    base = load_spec_file(spec_path)
    overrides: dict = dict(SMOKE) if args.smoke else {"sampling.n": args.n}
    if base.engine.name == "vllm":  # one process: the engine in mismatch-probe's worker, not vLLM's own
        overrides["engine.distributed_executor_backend"] = "uni"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    precision = SMOKE_PRECISION if args.smoke else args.precision
    max_samples = SMOKE_MAX_SAMPLES if args.smoke else args.max_samples
    base = apply_overrides(base, overrides, named_by="set")
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-adaptive-"))
    work.mkdir(parents=True, exist_ok=True)

    adaptive = apply_overrides(
        base,
        {"sampling.precision": precision, "sampling.max_samples": max_samples, "out": str(work / "rounds")},
        named_by="set",
    )
    t0 = time.perf_counter()
    rounds = compare(adaptive, overwrite=True).run
    rounds_wall = time.perf_counter() - t0
    assert rounds.precision is not None and rounds.inputs is not None
    n_samples, n_prompts = rounds.inputs.n_samples, rounds.inputs.n_prompts
    assert n_samples is not None and n_prompts is not None
    n = base.sampling.n
    prompts = repeated_prompts(Path(str(base.prompts)), n_prompts, n_samples // n, work / "prompts.jsonl")
    batch_spec = apply_overrides(
        base, {"prompts": str(prompts), "max_prompts": n_samples // n, "out": str(work / "batch")}, named_by="set"
    )
    t0 = time.perf_counter()
    batch = compare(batch_spec, overwrite=True).run
    batch_wall = time.perf_counter() - t0
    assert batch.inputs is not None and batch.inputs.n_samples == n_samples  # the same samples, at once

    state = rounds.precision
    result = {
        "engine": base.engine.name,
        "target": precision,
        "met": state["met"],
        "stop": state["stop"],
        "rounds": [r["samples"] for r in state["rounds"]],
        "samples": n_samples,
        "rounds_cost_s": round(cost(rounds.timings), 3),
        "batch_cost_s": round(cost(batch.timings), 3),
        "rounds_parts_s": {k: rounds.timings.get(k, 0.0) for k in COST},
        "batch_parts_s": {k: batch.timings.get(k, 0.0) for k in COST},
        "rounds_wall_s": round(rounds_wall, 1),
        "batch_wall_s": round(batch_wall, 1),
    }
    result["rounds_over_batch"] = round(result["rounds_cost_s"] / result["batch_cost_s"], 3)
    print(json.dumps(result, indent=2))
    bar = 1.10
    verdict = "within" if result["rounds_over_batch"] <= bar else "OVER"
    print(
        f"rounds {result['rounds']} ({n_samples} samples) cost {result['rounds_over_batch']}x one batch of the same "
        f"samples: {verdict} the {bar}x bar" + (" (smoke size: the bar holds at full size only)" if args.smoke else "")
    )
    assert len(state["rounds"]) >= 2 or state["met"], (
        "the adaptive run stopped after one round without meeting its target"
    )


if __name__ == "__main__":  # vLLM's engine workers re-import the main module
    main()

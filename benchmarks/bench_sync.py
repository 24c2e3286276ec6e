"""A weight sync through each engine's update path against a fresh engine start with the same weights.

    python benchmarks/bench_sync.py [--engines vllm,sglang] [--model fixtures/models/tiny-qwen2] [--repeats 3]

The issue's bar: a sync of the model through each path takes at most the time of a fresh engine
start with the same weights. For each engine, one run: the engine starts from the model (timed:
the fresh start), takes the perturbed checkpoint and the model back through each transfer
``--repeats`` times (each sync of the model timed: the trainer's side reading and casting the
checkpoint, the transfer, the engine's load and the cache reset), and the ratio sync / start is
printed per transfer. SGLang runs from ``.venv-sglang`` (tests/sglang-cpu/install.sh).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import smoke  # benchmarks/smoke.py: the --smoke flag

ROOT = Path(__file__).resolve().parent.parent
TRANSFERS = ("tensor", "disk")
# one engine (vLLM, in the engine worker: "uni"), one sync each way per transfer; the fixture is the default model
SMOKE = {"engines": "vllm", "repeats": 1, "vllm_executor": "uni"}


def bench(
    engine: str, model: Path, repeats: int, work: Path, vllm_executor: str | None = None
) -> list[tuple[str, float, float]]:
    from mismatch_probe.config.spec import EngineSpec, SyncSpec
    from mismatch_probe.engines import get_entry
    from mismatch_probe.engines.process import EngineProcess
    from mismatch_probe.engines.weight_sync import perturbed_checkpoint

    start = perturbed_checkpoint(model, work / f"{engine}-perturbed")
    executor = {"distributed_executor_backend": vllm_executor} if engine == "vllm" and vllm_executor else {}
    if executor.get("distributed_executor_backend") == "uni":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # what vLLM's CPU build needs for "uni"
    spec = EngineSpec(name=engine, dtype="bfloat16", enforce_eager=True if engine == "vllm" else None, **executor)
    if engine == "sglang":
        spec = spec.model_copy(update={"python": str(ROOT / ".venv-sglang/bin/python")})
    t0 = time.perf_counter()
    process = EngineProcess(
        get_entry(engine), model, spec, log_path=work / f"{engine}.log", sync=SyncSpec(start_from="perturbed")
    )
    started = time.perf_counter() - t0
    rows = []
    try:
        for transfer in TRANSFERS:
            times = []
            for r in range(repeats):
                process.sync_weights(start, work / f"{engine}-{transfer}-{r}-a", transfer=transfer)
                t = time.perf_counter()
                process.sync_weights(model, work / f"{engine}-{transfer}-{r}-b", transfer=transfer)
                times.append(time.perf_counter() - t)
            rows.append((transfer, statistics.median(times), started))
    finally:
        process.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="vllm,sglang")
    parser.add_argument("--model", type=Path, default=ROOT / "fixtures/models/tiny-qwen2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--vllm-executor", help="vLLM's distributed_executor_backend (default: vLLM's own, mp; uni: in the worker)"
    )
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'engine':8} {'transfer':8} {'sync s':>8} {'start s':>8} {'sync/start':>10}")
        for engine in args.engines.split(","):
            rows = bench(engine, args.model.resolve(), args.repeats, Path(tmp), args.vllm_executor)
            for transfer, sync_s, start_s in rows:
                print(f"{engine:8} {transfer:8} {sync_s:8.3f} {start_s:8.2f} {sync_s / start_s:10.4f}")
                sys.stdout.flush()


if __name__ == "__main__":
    main()

"""What the engine worker process costs: the same seeded HF engine in-process vs behind the worker,
and the parent<->worker transport (Arrow IPC over a pipe) on its own at RL-batch scale.

    .venv/bin/python benchmarks/bench_worker.py [--requests 256 --max-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import smoke  # benchmarks/smoke.py: the --smoke flag

from mismatch_probe.config.spec import EngineSpec, SamplingSpec
from mismatch_probe.engines import Completion, GenerationRequest, get_entry, wire
from mismatch_probe.engines.hf import HFEngine
from mismatch_probe.engines.process import EngineProcess

ROOT = Path(__file__).resolve().parent.parent
DENSE = ROOT / "fixtures/models/tiny-qwen2"
SMOKE = {"requests": 8, "max_tokens": 8, "transport": "64x64", "transport_repeats": 1}


def transport(n_seq: int, n_tok: int, repeats: int = 3) -> float:
    """Seconds to send n_seq completions of n_tok tokens through a pipe and decode them (median)."""
    rng = np.random.default_rng(0)
    completions = [
        Completion(
            rng.integers(0, 150_000, n_tok).astype(np.int32), rng.normal(-1, 1, n_tok).astype(np.float32), "length"
        )
        for _ in range(n_seq)
    ]
    times = []
    for _ in range(repeats):
        r, w = os.pipe()
        reader, writer = os.fdopen(r, "rb"), os.fdopen(w, "wb")
        t0 = time.perf_counter()
        sender = threading.Thread(
            target=lambda: (
                wire.send(writer, {"op": "generated"}, wire.completions_to_table(completions)),
                writer.close(),
            )
        )
        sender.start()
        back = wire.table_to_completions(wire.receive(reader).table)
        sender.join()
        times.append(time.perf_counter() - t0)
        reader.close()
        assert np.array_equal(back[-1].logprobs, completions[-1].logprobs)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--transport",
        default="1024x1024,4096x1024",
        help="the transport's sizes alone: sequences x tokens, comma-separated",
    )
    ap.add_argument("--transport-repeats", type=int, default=3, help="the transport's runs per size (the median)")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    spec = EngineSpec(dtype="float32", batch_size=64)
    sampling = SamplingSpec(temperature=1.0, max_tokens=args.max_tokens)
    rng = np.random.default_rng(1)
    requests = [
        GenerationRequest(rng.integers(3, 900, int(rng.integers(8, 64))).astype(np.int32), args.max_tokens)
        for _ in range(args.requests)
    ]

    t0 = time.perf_counter()
    local = HFEngine(DENSE, spec)
    t_local_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    a = local.generate(requests, sampling, stop_token_ids=[2], seed=0)
    t_local = time.perf_counter() - t0
    local.close()

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        worker = EngineProcess(get_entry("hf"), DENSE, spec, log_path=Path(tmp) / "engine.log")
        t_worker_start = time.perf_counter() - t0
        t0 = time.perf_counter()
        b = worker.generate(requests, sampling, stop_token_ids=[2], seed=0)
        t_worker = time.perf_counter() - t0
        t0 = time.perf_counter()
        worker.close()
        t_worker_stop = time.perf_counter() - t0
    assert all(
        np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.logprobs, y.logprobs) for x, y in zip(a, b)
    )
    n_tokens = sum(len(c.token_ids) for c in a)
    print(f"hf engine, {args.requests} requests, {n_tokens} generated tokens (identical on both paths)")
    print(f"  in-process: start {t_local_start:.2f}s, generate {t_local:.2f}s")
    print(
        f"  worker:     start {t_worker_start:.2f}s, generate {t_worker:.2f}s ({t_worker / t_local:.2f}x), "
        f"stop {t_worker_stop:.2f}s"
    )
    for size in args.transport.split(","):
        n_seq, n_tok = (int(x) for x in size.split("x"))
        t = transport(n_seq, n_tok, repeats=args.transport_repeats)
        print(
            f"  transport of {n_seq} x {n_tok} tokens (ids + log-probs): {t:.3f}s "
            f"({n_seq * n_tok / t / 1e6:.1f}M tokens/s)"
        )


if __name__ == "__main__":
    main()

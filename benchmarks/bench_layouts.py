"""Reference scoring throughput per training layout: one process vs Ulysses SP=2 vs TP=2 (and
optionally SP=2 x TP=2), the rank processes started once and reused, as in a run.

    python benchmarks/bench_layouts.py [--sequences 256] [--dtype bfloat16] [--repeats 3] [--layouts 1x1,2x1,1x2] [--four]

Same sequences as bench_reference.py (fixture prompts + random 16-400 token responses). On a CPU
the ranks share the cores (each gets cores / world torch threads), so this measures what the
layouts cost in collectives and in smaller per-rank matmuls, not a speed-up; on GPUs each rank
has its own device. Prints the time to start each layout, tokens/s, and ratios to one process,
all from one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import smoke  # benchmarks/smoke.py: the --smoke flag
from bench_reference import MODEL, make_rollouts

from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference import open_reference_scorer

SMOKE = {"sequences": 4, "repeats": 1, "layouts": "1x1,2x1"}  # one process and one of 2 ranks (SP=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="1x1,2x1,1x2", help="SPxTP, comma-separated (1x1, one process, always runs)")
    ap.add_argument("--four", action="store_true", help="also SP=2 x TP=2 (4 ranks)")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    rollouts = make_rollouts(args.sequences)
    n_tokens = sum(len(r.token_ids) for r in rollouts)
    sem = LogprobSemantics("raw")
    layouts = [(1, 1)] + [tuple(int(x) for x in k.split("x")) for k in args.layouts.split(",") if k and k != "1x1"]
    layouts += [(2, 2)] if args.four and (2, 2) not in layouts else []
    scorers, start = {}, {}
    for sp, tp in layouts:
        t0 = time.perf_counter()
        scorers[(sp, tp)] = open_reference_scorer(
            MODEL,
            ReferenceSpec(
                dtype=args.dtype,
                sequence_parallel_size=sp,
                tensor_parallel_size=tp,
                micro_batch_size=64,
                max_tokens_per_micro_batch=4096,
            ),
        )
        start[(sp, tp)] = time.perf_counter() - t0
    try:
        for s in scorers.values():  # warm-up
            s.score(rollouts, sem)
        times = {k: [] for k in scorers}
        for _ in range(args.repeats):
            for k, s in scorers.items():  # interleaved, so drift hits every layout alike
                t0 = time.perf_counter()
                s.score(rollouts, sem)
                times[k].append(time.perf_counter() - t0)
    finally:
        for s in scorers.values():
            s.close()
    print(
        f"{args.sequences} sequences, {n_tokens} tokens, dtype {args.dtype}, {torch.get_num_threads()} cores' "
        f"threads shared by the ranks, median of {args.repeats}"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med[(1, 1)]
    for (sp, tp), t in med.items():
        print(
            f"  sp {sp} x tp {tp}: start {start[(sp, tp)]:5.1f} s  score {t:7.3f} s  {n_tokens / t:9.0f} tok/s  "
            f"{base / t:5.2f}x one process"
        )


if __name__ == "__main__":
    main()

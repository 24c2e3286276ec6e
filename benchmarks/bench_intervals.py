"""Time and memory of the sequence-level bootstrap (analysis.intervals) on a large run.

    python benchmarks/bench_intervals.py [--sequences 100000] [--n-boot 1000]

Synthetic sequences.parquet columns (responses of 50-2000 tokens, so 100k sequences are ~100M
tokens), then, in one process (target, issue 24: 1,000 resamples over 100k sequences under 2 s):

- every metric of BOOTSTRAP_METRICS with its 95% interval, as the library computes it (multinomial
  counts in chunks, one matrix product per metric and chunk);
- the same intervals of two runs paired;
- the textbook loop (draw indices, recompute each metric from the resampled arrays), on a tenth of
  the replicates and scaled up, for the ratio.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import smoke  # benchmarks/smoke.py: the --smoke flag

from mismatch_probe.analysis.intervals import BOOTSTRAP_METRICS, bootstrap_intervals, paired_intervals

SMOKE = {"sequences": 1_000, "n_boot": 100}


def synthetic(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n_tokens = rng.integers(50, 2000, n).astype(np.float64)
    log_ratio = rng.normal(0, 0.05, n) * np.sqrt(n_tokens)
    return {
        "n_tokens": n_tokens,
        "k3_sum": rng.gamma(n_tokens, 1e-3),
        "max_mismatch": rng.uniform(0, 0.6, n),
        "mean_mismatch": rng.uniform(0, 0.01, n),
        "log_ratio": log_ratio,
        "geo_ratio": np.exp(log_ratio / n_tokens),
        "log_ppl_infer": rng.uniform(0.5, 2, n),
        "log_ppl_train": rng.uniform(0.5, 2, n),
        "min_token_log_ratio": -rng.exponential(0.2, n),
        "mult_error_sum": n_tokens * (1.0 + rng.uniform(0, 0.01, n)),
    }


def naive(cols: dict[str, np.ndarray], n_boot: int, seed: int = 0) -> dict[str, tuple[float, float]]:
    """Index resampling, one replicate at a time, each metric from the resampled arrays."""
    rng = np.random.default_rng(seed)
    n = len(cols["n_tokens"])
    draws: dict[str, list[float]] = {k: [] for k in BOOTSTRAP_METRICS}
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        c = {k: v[idx] for k, v in cols.items()}
        tok = c["n_tokens"].sum()
        draws["k3_kl"].append(c["k3_sum"].sum() / tok)
        draws["prob_diff_max"].append(c["max_mismatch"].max())
        draws["mult_prob_error"].append(c["mult_error_sum"].sum() / tok)
        draws["k1_kl"].append(-c["log_ratio"].sum() / tok)
        draws["prob_diff_mean"].append((c["mean_mismatch"] * c["n_tokens"]).sum() / tok)
        draws["seq_max_mismatch_mean"].append(c["max_mismatch"].mean())
        draws["seq_max_mismatch_gt_0_5_share"].append((c["max_mismatch"] > 0.5).mean())
        draws["seq_mean_mismatch_mean"].append(c["mean_mismatch"].mean())
        draws["seq_log_ratio_mean"].append(c["log_ratio"].mean())
        draws["seq_geo_ratio_mean"].append(c["geo_ratio"].mean())
        draws["log_ppl_infer"].append(c["log_ppl_infer"].mean())
        draws["log_ppl_train"].append(c["log_ppl_train"].mean())
        draws["chi2_seq"].append(np.exp(2 * np.clip(c["log_ratio"], -20, 20)).mean() - 1)
    return {k: tuple(np.quantile(v, [0.025, 0.975])) for k, v in draws.items()}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=100_000)
    ap.add_argument("--n-boot", type=int, default=1000)
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    a = synthetic(args.sequences)
    b = {**a, "k3_sum": a["k3_sum"] * 1.02}
    n_tok = int(a["n_tokens"].sum())
    print(f"{args.sequences:,} sequences, {n_tok:,} tokens, {args.n_boot} replicates, {len(BOOTSTRAP_METRICS)} metrics")

    one, t_one = timed(lambda: bootstrap_intervals(a, n_boot=args.n_boot))
    _, t_paired = timed(lambda: paired_intervals(a, b, n_boot=args.n_boot))
    tenth = max(1, args.n_boot // 10)
    slow, t_naive = timed(lambda: naive(a, tenth))
    t_naive *= args.n_boot / tenth
    print(
        f"bootstrap intervals: {t_one:.2f} s ({args.n_boot:,} resamples over {args.sequences:,} sequences; "
        f"target for 1,000 over 100k: < 2 s); paired (difference and ratio): {t_paired:.2f} s"
    )
    print(f"textbook index-resampling loop: {t_naive:.2f} s (scaled from {tenth}); {t_naive / t_one:.1f}x the library")
    k3, k3_naive = one["k3_kl"], slow["k3_kl"]
    print(f"k3_kl {k3.estimate:.6g} [{k3.low:.6g}, {k3.high:.6g}]; loop [{k3_naive[0]:.6g}, {k3_naive[1]:.6g}]")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()

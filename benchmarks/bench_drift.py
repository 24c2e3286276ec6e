"""Calibration of the drift detector (analysis/drift.py) over many simulated runs, and its speed.

    python benchmarks/bench_drift.py [--runs 2000] [--steps 200] [--baseline 20] [--change 120]

Each run is ``--steps`` training steps; each step's K3 and its 95% sequence-bootstrap interval come from
64 simulated sequences (heavy-tailed per-token K3, sequences that differ in their own mismatch, a
between-step variation of 0.15 in log): tests/unit/test_drift.py: simulate_runs, whose intervals are
bootstrap_intervals' own. Scenarios: no drift, K3 x1.5 / x2 / x3 from step ``--change`` on, and K3
climbing to x3 linearly in log over 40 and over 100 steps from there. Each runs with the intervals and
without them (no sampling-noise information). Printed per scenario:

- false alarm: an alarm before the change (with no drift: at all); the target is at most alpha = 5%;
- detected: an alarm at or after the change; delay: alarm step - change step (median / p90);
- change error: estimated change step - true one (median of |error| / p90), and how often the change
  interval covers the true step (for a ramp the estimate is where the climb became clear, later);

K3's test runs at its share of the run's 5% (``--metrics`` 8, the metrics a dense model's timeline
tests: analysis/drift.py: metric_alpha), as a timeline runs it.

Then the run's false-alarm rate over *every* metric: ``--token-runs`` stationary runs of
``--token-steps`` steps (by default the NeMo-RL-format runs of the issue that asked for it: 40 steps of
64 sequences), simulated token by token (tests/unit/test_drift.py: simulate_token_steps) and reduced
by the timeline's own code (``step_rows``, then ``drift_tests``): the share of runs in which any metric
alarms, with its 95% (Wilson) interval, against the rule before it (each metric at 5%), and which
metrics alarmed.

Last, the time of one detect_drift call on 200 and 1,000 steps once the threshold is cached, and of
simulating a threshold (a new window size, monitored length up to 1,000).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit")]

import smoke  # benchmarks/smoke.py: the --smoke flag
from test_drift import simulate_runs, simulate_token_steps

from mismatch_probe.analysis import drift
from mismatch_probe.analysis.drift import detect_drift, drift_threshold, metric_alpha
from mismatch_probe.analysis.timeline import DRIFT_METRICS, rows_table, step_rows
from mismatch_probe.timeline.runner import _group, drift_tests

SMOKE = {"runs": 20, "token_runs": 4, "token_steps": 25}
RUN_ALPHA = 0.05


def scenarios(change: int) -> dict[str, object]:
    def step(factor: float):
        return lambda s: np.where(s >= change, factor, 1.0)

    def ramp(length: int):
        return lambda s: np.exp(np.log(3.0) * np.clip((s - change + 1) / length, 0, 1))

    return {
        "no drift": None,
        "step x1.5": step(1.5),
        "step x2": step(2.0),
        "step x3": step(3.0),
        "ramp to x3 in 40": ramp(40),
        "ramp to x3 in 100": ramp(100),
    }


def summarize(results, change: int, drifting: bool) -> list[str]:
    alarm = np.array([r.alarm_step if r.detected else -1 for r in results])
    early = (alarm >= 0) & (alarm < change) if drifting else alarm >= 0
    row = [f"{early.mean():.1%}"]
    if not drifting:
        return row + ["-"] * 5
    found = [r for r in results if r.detected and r.alarm_step >= change]
    if not found:
        return row + ["0%"] + ["-"] * 4
    delay = np.array([r.alarm_step - change for r in found])
    error = np.abs([r.change_step - change for r in found])
    covered = np.mean([r.interval[0] <= change <= r.interval[1] for r in found])
    return row + [
        f"{len(found) / len(results):.1%}",
        f"{np.median(delay):.0f} / {np.percentile(delay, 90):.0f}",
        f"{np.median(error):.0f} / {np.percentile(error, 90):.0f}",
        f"{covered:.0%}",
        f"{np.median([r.ratio for r in found]):.2f}",
    ]


def token_run_alarms(args: tuple[int, int, int]) -> tuple[list[str], list[str]]:
    """One stationary token-level run: the metrics that alarm under the run-level rule (each at its share
    of 5%) and under the rule before it (each at 5%)."""
    seed, n_steps, baseline = args
    rows = [
        r for step, t in enumerate(simulate_token_steps(n_steps, seed=seed)) for r in step_rows(step, t, n_boot=200)
    ]
    table = rows_table(rows)
    now = [m for m, r in drift_tests(table, baseline_steps=baseline, alpha=RUN_ALPHA).items() if r["detected"]]
    g = _group(table, "all")
    before = [
        m
        for m, scale in DRIFT_METRICS.items()
        if np.isfinite(g[m]).any()
        and detect_drift(
            g["step"],
            g[m],
            g.get(f"{m}_low"),
            g.get(f"{m}_high"),
            baseline_steps=baseline,
            alpha=RUN_ALPHA,
            scale=scale,
        ).detected
    ]
    return now, before


def wilson(hits: int, n: int) -> tuple[float, float]:
    """The 95% Wilson interval of a share."""
    z = 1.959963984540054
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def per_call(n_steps: int, repeats: int = 200) -> float:
    rng = np.random.default_rng(0)
    value = np.exp(rng.normal(-7, 0.25, (repeats, n_steps)))
    steps = np.arange(n_steps)
    detect_drift(steps, value[0], value[0] * 0.7, value[0] / 0.7)  # the threshold, simulated once
    start = time.perf_counter()
    for v in value:
        detect_drift(steps, v, v * 0.7, v / 0.7)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--baseline", type=int, default=20)
    ap.add_argument("--change", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--metrics", type=int, default=8, help="metrics K3's test shares the run's 5%% with")
    ap.add_argument("--token-runs", type=int, default=400)
    ap.add_argument("--token-steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    monitored = args.steps - args.baseline
    alpha = metric_alpha(RUN_ALPHA, args.metrics)
    h = drift_threshold(args.baseline, monitored, alpha=alpha)
    print(
        f"{args.runs:,} simulated runs per scenario, {args.steps} steps ({args.baseline}-step baseline, "
        f"{monitored} monitored, h = {h:.2f}), change at step {args.change}, K3 at alpha {alpha:.3%} "
        f"(5% per run over {args.metrics} metrics), k = {drift.DEFAULT_K}"
    )
    header = ["scenario", "intervals", "false alarm", "detected", "delay med/p90", "|change err| med/p90"]
    header += ["covered", "after/base"]
    rows = [header]
    t0 = time.perf_counter()
    for i, (name, shift) in enumerate(scenarios(args.change).items()):
        steps, value, low, high = simulate_runs(args.runs, args.steps, seed=args.seed * 100 + i, shift=shift)
        for label, with_intervals in (("yes", True), ("no", False)):
            results = [
                detect_drift(
                    steps,
                    value[r],
                    low[r] if with_intervals else None,
                    high[r] if with_intervals else None,
                    baseline_steps=args.baseline,
                    alpha=alpha,
                )
                for r in range(args.runs)
            ]
            rows.append([name, label, *summarize(results, args.change, shift is not None)])
    widths = [max(len(row[j]) for row in rows) for j in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    print(f"(simulation and detection: {time.perf_counter() - t0:.0f} s)")

    t0 = time.perf_counter()
    jobs = [(args.seed * 1_000_000 + r, args.token_steps, args.baseline) for r in range(args.token_runs)]
    with ProcessPoolExecutor(args.workers) as pool:
        outcomes = list(pool.map(token_run_alarms, jobs, chunksize=4))
    print(
        f"\n{args.token_runs:,} stationary token-level runs of {args.token_steps} steps x 64 sequences "
        f"(the timeline's step_rows and drift_tests; {time.perf_counter() - t0:.0f} s):"
    )
    for label, index in (("per run, each metric at its share (now)", 0), ("each metric at 5% (before)", 1)):
        hits = sum(bool(o[index]) for o in outcomes)
        lo, hi = wilson(hits, len(outcomes))
        which = {m: sum(m in o[index] for o in outcomes) for m in DRIFT_METRICS}
        named = ", ".join(f"{m} {n}" for m, n in which.items() if n) or "none"
        print(
            f"  {label}: false alarm in {hits / len(outcomes):.1%} of runs (95% CI {lo:.1%}-{hi:.1%}); by metric: {named}"
        )

    for n in (200, 1000):
        print(f"detect_drift, {n} steps, threshold cached: {per_call(n) * 1e3:.2f} ms a call")
    drift._CURVES.clear()
    start = time.perf_counter()
    drift_threshold(33, 1000)
    one = time.perf_counter() - start
    start = time.perf_counter()
    drift_threshold(34, 1000, direction="both")
    both = time.perf_counter() - start
    print(
        f"a new threshold (2,000 simulated runs, 1,000 monitored steps): one-sided {one * 1e3:.0f} ms, two-sided {both * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()

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

then the time of one detect_drift call on 200 and 1,000 steps once the threshold is cached, and of
simulating a threshold (a new window size, monitored length up to 1,000).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit")]

import smoke  # benchmarks/smoke.py: the --smoke flag
from test_drift import simulate_runs

from mismatch_probe.analysis import drift
from mismatch_probe.analysis.drift import detect_drift, drift_threshold

SMOKE = {"runs": 20}


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
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    monitored = args.steps - args.baseline
    h = drift_threshold(args.baseline, monitored)
    print(
        f"{args.runs:,} simulated runs per scenario, {args.steps} steps ({args.baseline}-step baseline, "
        f"{monitored} monitored, h = {h:.2f}), change at step {args.change}, alpha 5%, k = {drift.DEFAULT_K}"
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
                )
                for r in range(args.runs)
            ]
            rows.append([name, label, *summarize(results, args.change, shift is not None)])
    widths = [max(len(row[j]) for row in rows) for j in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    print(f"(simulation and detection: {time.perf_counter() - t0:.0f} s)")

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

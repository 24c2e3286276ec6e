"""What a sweep concludes from its runs: effects with intervals, the noise floor, determinism, cost,
and which change to make. Pure functions over metrics, sequences-table columns and timings; the
sweep's orchestration (``sweeps.py``) feeds them and writes what they return into sweep.json.

* **Effect** of a point: its metrics against the baseline's, as a difference and an x-fold ratio,
  each with a bootstrap interval (:mod:`analysis.intervals`). Paired when the point re-scored the
  baseline's own tokens (a reference-only change: the sampling noise cancels), unpaired with a
  two-level bootstrap over the baseline's repeats otherwise. "Within noise": the difference's
  interval covers 0.
* **Noise floor**: the spread of each metric over the baseline's repeats (other seeds).
* **Cost**: a point's throughput against the baseline's, engine (generation) and reference (scoring).
* **Recommendation**: the cheapest point that passes the gate, or the baseline if it passes.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from mismatch_probe.analysis.intervals import Columns, PairedInterval, available, paired_intervals, unpaired_intervals

# the metrics the sweep's forest plots and attribution lead with
HEADLINE_METRICS = ("k3_kl", "prob_diff_max", "mult_prob_error")
# a slowdown this small beyond the slowest baseline repeat is not told apart from timing noise
COST_RESOLUTION = 0.02


def _interval(i) -> list[float]:
    return [i.estimate, i.low, i.high]


def effects(
    baseline: Columns,
    point: Columns,
    *,
    paired: bool,
    repeats: Sequence[Columns] = (),
    keys: list[str] | None = None,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Each metric's change from the baseline to ``point``: ``difference`` and ``ratio`` as
    [estimate, low, high], ``paired``, and ``within_noise`` (the difference interval covers 0).

    ``paired``: row i of both tables is the same sequence (the point re-scored the baseline's
    tokens). Otherwise ``repeats`` (the baseline's other seeds, ``baseline`` among them or not) give
    the unpaired interval its between-run spread."""
    keys = available(point, available(baseline)) if keys is None else keys
    found: Mapping[str, PairedInterval | None]
    if paired:
        found = paired_intervals(baseline, point, keys, n_boot=n_boot, level=level, seed=seed)
    else:
        pool = [baseline, *repeats]
        found = unpaired_intervals(pool, point, keys, n_boot=n_boot, level=level, seed=seed)
    out: dict[str, dict[str, Any]] = {}
    for key, found_key in found.items():
        if found_key is None:
            continue
        diff, ratio = found_key
        covers = diff.covers(0.0) if not (math.isnan(diff.low) or math.isnan(diff.high)) else True
        out[key] = {
            "difference": _interval(diff),
            "ratio": _interval(ratio),
            "paired": paired,
            "within_noise": bool(covers),
        }
    return out


def noise_floor(repeat_metrics: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """How much each metric moves between the baseline's repeats (the same settings, other seeds):
    the values, their mean, the relative standard deviation, and the x-fold between the largest and
    the smallest. With one repeat there is no spread to measure (``n_repeats`` says so)."""
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        values = [m.get(key) for m in repeat_metrics]
        finite = np.array([v for v in values if isinstance(v, int | float) and math.isfinite(v)], np.float64)
        entry: dict[str, Any] = {"values": values, "n_repeats": len(finite)}
        if len(finite):
            mean = float(finite.mean())
            entry["mean"] = mean
            entry["min"], entry["max"] = float(finite.min()), float(finite.max())
            if len(finite) > 1:
                std = float(finite.std(ddof=1))
                entry["std"] = std
                entry["relative_std"] = std / abs(mean) if mean else None
                entry["max_over_min"] = entry["max"] / entry["min"] if entry["min"] > 0 else None
        out[key] = entry
    return out


def throughput(n_tokens: int | None, seconds: float | None) -> float | None:
    """Tokens a second, or None when either is unknown or no time was measured."""
    if not n_tokens or not seconds or seconds <= 0:
        return None
    return n_tokens / seconds


def cost(
    point: Mapping[str, float | None],
    baselines: Sequence[Mapping[str, float | None]],
    changed: Collection[str] = ("engine", "reference"),
) -> dict[str, Any]:
    """A point's price: its engine and reference throughput (tokens/s) relative to the baseline's
    (the median of its repeats), and ``cost``, the larger of the two slowdowns (None when a side
    could not be timed).

    A throughput is timed once per run, so it is as noisy as the repeats show: a point no slower
    than the slowest repeat (less :data:`COST_RESOLUTION`) costs 0 on that side. A side the point
    did not change (not in ``changed``: a reference-only change leaves the engine as it was) costs
    0 too; its throughput is still shown, and differs from the baseline's by timing noise alone."""
    out: dict[str, Any] = {}
    slowdowns: list[float | None] = []
    for name in ("engine", "reference"):
        side = f"{name}_tokens_per_s"
        mine = point.get(side)
        theirs = [float(v) for b in baselines if (v := b.get(side))]
        base = float(np.median(theirs)) if theirs else None
        out[side] = mine
        relative = mine / base if mine and base else None
        out[f"{name}_relative"] = relative
        if name not in changed:
            slowdowns.append(0.0)
        elif relative is None or mine is None:
            slowdowns.append(None)
        elif mine >= min(theirs) * (1.0 - COST_RESOLUTION):
            slowdowns.append(0.0)
        else:
            slowdowns.append(max(0.0, 1.0 - relative))
    known = [s for s in slowdowns if s is not None]
    out["cost"] = max(known) if len(known) == len(slowdowns) else None
    return out


def point_value(point: Mapping[str, Any], section: str, key: str) -> Any:
    """A sweep point's value in one of its sections (``metrics``, ``delta_vs_baseline``: a
    :class:`~mismatch_probe.sweep_record.SweepPointRecord` as a mapping); None when either is absent
    (a refused point has neither)."""
    values = point.get(section)
    return values.get(key) if isinstance(values, Mapping) else None


def recommend(points: Sequence[Mapping[str, Any]], metric: str = "k3_kl") -> dict[str, Any]:
    """Which change to make, from points with ``name``, ``status``, ``gate`` (``"PASS"``, ``"WARN"``,
    ``"FAIL"``, ...), ``cost`` (fraction of throughput lost; None unknown), ``settings`` and
    ``metrics``; the first point is the baseline.

    The baseline passing means nothing needs changing. Otherwise: the passing point with the lowest
    cost (unknown cost last), ties broken by the lower ``metric``. ``passes`` is False when no
    point passes."""
    if not points:
        raise ValueError("no points to recommend from")
    baseline = points[0]
    passing = [p for p in points if p.get("status") == "ok" and p.get("gate") in ("PASS", "WARN")]
    failing = [p["name"] for p in points if p.get("status") == "ok" and p not in passing]
    if baseline in passing:
        return {
            "point": baseline["name"],
            "passes": True,
            "settings": {},
            "why": "the baseline already passes the gate: nothing needs to change",
            "cost": 0.0,
            "passing": [p["name"] for p in passing],
            "failing": failing,
        }
    if not passing:
        return {
            "point": None,
            "passes": False,
            "why": "no point passes the gate",
            "passing": [],
            "failing": failing,
        }

    def order(p: Mapping[str, Any]) -> tuple[float, float]:
        c = p.get("cost")
        value = point_value(p, "metrics", metric)
        return (
            math.inf if c is None else float(c),
            math.inf if not isinstance(value, int | float) else float(value),
        )

    best = min(passing[1:] if passing[0] is baseline else passing, key=order)
    c = best.get("cost")
    price = (
        "at no measurable throughput cost"
        if c == 0
        else (f"at {c:.0%} throughput cost" if c is not None else "at an unmeasured cost")
    )
    return {
        "point": best["name"],
        "passes": True,
        "settings": dict(best.get("settings") or {}),
        "why": f"the cheapest change that passes the gate, {price}",
        "cost": c,
        "passing": [p["name"] for p in passing],
        "failing": failing,
    }


def attribution(points: Sequence[Mapping[str, Any]], metric: str = "k3_kl") -> list[dict[str, Any]]:
    """Points by the size of their effect on ``metric`` (|log x-fold|, largest first), each with its
    ratio interval and whether it is within noise; points without the metric are left out."""
    rows = []
    for p in points:
        effect = point_value(p, "delta_vs_baseline", metric)
        if effect is None:
            continue
        ratio = effect["ratio"][0]
        size = abs(math.log(ratio)) if isinstance(ratio, float) and ratio > 0 and math.isfinite(ratio) else math.inf
        rows.append({"name": p["name"], "ratio": effect["ratio"], "within_noise": effect["within_noise"], "size": size})
    return sorted(rows, key=lambda r: (r["within_noise"], -r["size"]))


def compare_logprobs(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> dict[str, Any]:
    """Two scorings of the same tokens: the share of log-probs that are bitwise equal, and the
    largest |difference| (0.0 when every one is equal)."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise ValueError("the two scorings cover different tokens")
    x = np.concatenate([np.asarray(v, np.float32) for v in a]) if a else np.zeros(0, np.float32)
    y = np.concatenate([np.asarray(v, np.float32) for v in b]) if b else np.zeros(0, np.float32)
    if len(x) == 0:
        return {"n_tokens": 0, "bitwise_equal_share": None, "max_abs_delta": None}
    equal = x.view(np.uint32) == y.view(np.uint32)
    with np.errstate(invalid="ignore"):
        delta = np.abs(x.astype(np.float64) - y.astype(np.float64))
    return {
        "n_tokens": len(x),
        "bitwise_equal_share": float(equal.mean()),
        "max_abs_delta": float(np.nanmax(delta)) if np.isfinite(delta).any() else None,
    }

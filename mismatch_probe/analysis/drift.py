"""Drift of a per-step mismatch metric over an RL run: does it leave its early-steps baseline, and when?

The question a collapse post-mortem asks: "K3 departs from its baseline at step N", or "no drift found".
One metric, measured once per training step (K3, max |delta p|, multiplicative error, a clip share), with
a sequence-bootstrap interval per step (:func:`mismatch_probe.analysis.intervals.bootstrap_intervals`
over that step's sequences). Pure NumPy, no I/O.

The model, in plain words
-------------------------
Work on ``y_t = log(value)`` for positive metrics (``scale="log"``: a 2x rise of K3 is the same size at
any level) or on the value itself (``scale="linear"``). Each step's value moves for two reasons even when
nothing drifts:

* sampling noise: the step scored one batch of sequences. Its variance ``s_t^2`` comes from the step's
  bootstrap interval (half its width over the normal quantile of ``level``), so a step with few or very
  uneven sequences counts for less;
* between-step variation ``tau^2``: the policy changes every step, so steps differ by more than their
  sampling noise. It is estimated from the baseline window, never assumed.

The baseline is the first ``baseline_steps`` observed steps. A value there further than 5 robust sd
from the window's median (an early spike) is set aside; on the rest, ``tau^2`` is the two-step
DerSimonian-Kacker moment estimate (DerSimonian-Laird's, then the same moment equation reweighted by
``1 / (s_t^2 + tau^2)``), floored at 0, and the level ``mu`` is the mean weighted by ``1 / (s_t^2 +
tau^2)``, with its variance ``Var(mu)``: the random-effects meta-analysis of the window's steps.
Every later step is then standardized,

    z_t = (y_t - mu) / sqrt(s_t^2 + tau^2 + Var(mu)),

which is roughly N(0, 1) while nothing changes, clipped to [-3, 3] (one outlying step, a heavy-tailed
K3 batch, is not drift; several high steps are), and fed to a CUSUM (Page's test): ``S_t = max(0,
S_{t-1} + z_t - k)`` with ``k = 0.75``. The CUSUM accumulates evidence while steps sit above the
baseline and forgets it when they come back, so it finds both a jump and a slow climb; ``k`` is what a
step must exceed to add evidence (0.75 sd: tuned to 1.5 sd shifts, quick for larger ones, and, with a
baseline of only ~20 steps, it keeps a run whose baseline came out a little low from creeping up to
the threshold by chance, which a smaller ``k`` pays for with a much higher threshold). It alarms at the
first step with ``S_t >= h``. ``direction="down"`` runs it on ``-z``; ``"both"`` runs both and alarms
on either. An infinite value after the window (K3 when the trainer gave a sampled token p = 0) is an
alarm at that step in its direction.

Where it starts: the change step is the maximum-likelihood location of one step change in the mean of
``z`` (unclipped: a 10-sd jump is located better as 10 than as 3) among the monitored steps up to the
alarm (the level before it is the baseline's, the level after it is fitted), and its interval is the
set of locations whose profile likelihood ratio is within the chi-square(1) quantile of
``change_level`` of the best (reported as the first and last such step). On a jump it is exact or one
step off in nearly every run; on a gradual climb it dates where the climb became clear, some steps
after its first one (a step model fitted to a ramp), and its interval is a step model's too, so it
rarely covers the ramp's very first step. The "after" level is the median value from the change to
the alarm: what a live monitor saw.

Calibration: why ``h`` is simulated
-----------------------------------
``h`` is set so that a run with no drift at all alarms with probability at most ``alpha`` over its
whole monitored window, not per step. A textbook threshold would assume ``mu`` and ``tau`` are known;
here they are estimated from some 20 steps, and that error is shared by every later step (a ``mu``
estimated 0.3 sd low, or a ``tau`` 20% low, pushes every ``z`` up), which multiplies the false alarms
of a long run several times: with a 20-step window, 180 monitored steps need ``h`` ~ 7.3, against ~4.3
if the baseline were known exactly. So :func:`drift_threshold` simulates it: 2,000 null runs at once
(vectorized over runs), each with the *same* baseline fit (:func:`fit_baseline`, the very function)
on its own simulated window and the same clipped CUSUM over the monitored steps; ``h`` is an upper
quantile of the simulated runs' largest CUSUM. The simulated runs have no sampling noise, only
between-step variation (``s_t = 0``): then ``tau`` carries all the variance and is estimated from the
window alone, the least favourable case; when part of the variance is a known ``s_t`` the rate is
lower. The fit and the CUSUM are location- and scale-equivariant, so the null has no other parameter:
``h`` depends only on (window size, monitored length, one- or two-sided, ``alpha``, ``k``) and is
cached per key. The simulation is seeded (same inputs, same threshold), and to stay at most ``alpha``
despite its own error it takes the order statistic of a 95% upper confidence bound rather than the
plain quantile: the rate it delivers under its own model is ~0.7-0.8 ``alpha`` (3.3-3.8% at 5%).
``benchmarks/bench_drift.py`` measures the rate and the detection delays on runs whose per-step values
and intervals come from simulated sequences through the real bootstrap.

A live run
----------
Re-run :func:`detect_drift` on the steps so far, with ``horizon`` set to the number of steps it will
monitor (planned steps minus the baseline): ``h`` is then the same at every call, the first alarm is
the one a finished run reports, and ``alpha`` covers the whole run. Without ``horizon`` the threshold is
for the steps in hand, which is right for a finished run but, re-run every step, would test a growing
run against a rising bar (more false alarms than ``alpha`` over the run). The threshold's simulation
extends in blocks as the horizon grows and is cached, so a call costs about a millisecond.

Many metrics, one run
---------------------
A timeline tests several metrics of the same tokens (K3, max and mean |delta p|, ...), and a reader acts
on *any* alarm, so the rate that matters is the chance that a run with no drift alarms on any metric.
:func:`metric_alpha` splits ``alpha`` evenly over the metrics tested (Bonferroni): each metric's test
runs at ``alpha / m``, and the union of ``m`` events of probability ``alpha / m`` has probability at
most ``alpha`` whatever their dependence. The metrics are strongly correlated (computed on the same
sequences), so the run's rate comes out below ``alpha`` rather than at it; a joint calibration would
need the metrics' joint distribution under no drift, which no run gives. The price is a higher
threshold per metric (h ~ 13.1 instead of 7.3 over 180 monitored steps at 8 metrics): the alarm comes
a few steps later, and ``benchmarks/bench_drift.py`` measures both rates (the run's false alarms over
every metric on simulated token-level runs, and K3's detection of a 2x shift).

What it does not model: steps whose noise is correlated over time (a slow wander of the policy reads as
drift, and it is: the metric did leave its baseline), a baseline window that is itself drifting (the
first steps of a run settling: pass the steps from the end of warm-up on), or per-step values far
from normal on the chosen scale. Without intervals, heavy-tailed steps (the log of a K3 dominated
by one sequence) raise the false-alarm rate above ``alpha``; the clip at 3 sd bounds the damage and
the bootstrap intervals, which widen on exactly those steps, remove most of it.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any

import numpy as np

# The smallest baseline window with finite values that the fit accepts: below it tau is a guess.
MIN_BASELINE = 5
# The CUSUM's reference value in standard deviations (optimal for a shift of 2k). 0.5, the textbook
# choice for 1-sd shifts, lets a run whose 20-step baseline came out a little low creep up to the
# threshold by chance, which forces a threshold ~1.8x as high (12.9 against 7.3 over 180 steps); 0.75
# finds 2-3 sd shifts sooner and ramps as soon, at the cost of shifts under 1 sd.
DEFAULT_K = 0.75
# A baseline value this many robust sd from the window's median is an outlier, left out of the fit
# (a normal step almost never is, even with the spread of only 20 values; an early x10 spike of K3 on
# a run whose steps vary by 0.3 in log is 8 sd out). Closer cuts drop real values and bias tau low,
# which a 3.5-sd cut does often enough to raise the threshold by a sixth.
SCREEN = 5.0
# Null runs simulated per threshold (at least 100 beyond-threshold runs at alpha; more at smaller alpha).
SIMULATIONS = 2000
SIMULATION_SEED = 0x5EED_D21F
BLOCK = 64  # monitored steps simulated at a time; each block has its own seed, so h(m) never depends on
# how far the cache had already been extended
Z_CAP = 1e6  # an infinite value's z: beyond any threshold, finite so sums stay finite
# A monitored step's z counts at most this much: one outlying batch (a heavy-tailed K3 step) is not
# drift, a sustained shift still is. The simulation clips the same way. Infinite values bypass it.
Z_CLIP = 3.0
# the shift whose detection a result states (DriftResult.power): a 2x rise of the metric, lasting 20 steps
POWER_FACTOR = 2.0
POWER_STEPS = 20
POWER_SIMULATIONS = 4000  # the power's own simulation error: under 0.4 points at 95%
SIGMA_FLOOR = 1e-6  # relative floor of a step's total sd: a perfectly constant baseline cannot divide by 0

DIRECTIONS = ("up", "down", "both")
SCALES = ("log", "linear")


def _json_number(value: float | None) -> float | str | None:
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"  # as run.json stores them
    return float(value)


@dataclass(frozen=True)
class DriftResult:
    """What :func:`detect_drift` found for one metric. Steps are values of the ``steps`` given."""

    metric: str
    detected: bool
    change_step: int | None  # where the metric leaves its baseline (maximum likelihood)
    interval: tuple[int, int] | None  # first and last step of the change step's confidence set
    alarm_step: int | None  # the first step at which the test fires: what a live monitor saw
    baseline_steps: tuple[int, int] | None  # first and last step of the baseline window
    baseline: float | None  # median of the window's finite values, metric units
    after: float | None  # median value from the change step to the alarm, metric units
    ratio: float | None  # after / baseline (scale "log" only)
    alpha: float  # the nominal false-alarm rate over the monitored steps (``horizon`` of them)
    reason: str | None = None  # why nothing could be tested
    scale: str = "log"
    direction: str = "up"
    threshold: float | None = None  # the CUSUM threshold h (standard deviations)
    statistic: float | None = None  # the largest CUSUM over the monitored steps (>= threshold: detected)
    tau: float | None = None  # between-step sd estimated from the window (log units for scale "log")
    n_baseline: int = 0  # finite values the baseline was fitted on
    n_monitored: int = 0  # observed steps after the window
    horizon: int = 0  # monitored steps the false-alarm rate covers
    notes: tuple[str, ...] = field(default=())  # what was done to the data (floors, infinities)
    # the sd a monitored step's value is standardized by (median over the monitored steps; scale units)
    step_sd: float | None = None
    # the chance that a POWER_FACTOR-fold rise lasting POWER_STEPS steps alarms within them, at this run's
    # threshold and step sd (scale "log" only): what the test could have caught on this run
    power: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ints, floats, None, lists; infinities as "inf"/"-inf" strings, as run.json."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, float):
                value = _json_number(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out

    def summary(self) -> str:
        """One line for a page: "k3_kl departs from its baseline at step 612 (605-618) ..."."""
        name = self.metric or "the metric"
        if self.reason:
            return f"{name}: not tested ({self.reason})"
        if not self.detected:
            return f"{name}: no drift from its baseline (false-alarm rate {self.alpha:.0%} over {self.horizon} steps)"
        lo, hi = self.interval or (self.change_step, self.change_step)
        fold = f", x{self.ratio:.3g}" if self.ratio is not None and math.isfinite(self.ratio) else ""
        return (
            f"{name} departs from its baseline at step {self.change_step} ({lo}-{hi}), alarm at step "
            f"{self.alarm_step}: {self.baseline:.4g} -> {self.after:.4g}{fold}"
        )


# ---------------------------------------------------------------------------------------------- the fit


def fit_baseline(
    y: np.ndarray, v: np.ndarray | float = 0.0, floor_var: np.ndarray | float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The baseline's level ``mu``, between-step variance ``tau2`` and ``Var(mu)`` of each row of ``y``
    (rows: runs, columns: the window's steps, all finite), given each value's sampling variance ``v``.

    First a value further than :data:`SCREEN` robust standard deviations from the window's median (the
    MAD's, or the mean absolute deviation's if larger; widened by the value's own sampling noise) is set
    aside: one early spike must not set the baseline. Then the two-step DerSimonian-Kacker moment estimate on the rest: DerSimonian-Laird's
    ``tau2`` with weights ``1 / v``, then the moment equation again with weights ``1 / (v + tau2)``
    (closer to the Paule-Mandel solution when the ``v`` differ), floored at 0; ``mu`` is the mean
    weighted by ``1 / (v + tau2)`` and ``Var(mu)`` its variance. With ``v = 0`` that is the mean and
    the sample variance of the kept values. Closed form and vectorized over rows: the threshold
    simulation runs this very function on its simulated windows. ``floor_var`` is added to every
    variance, so a constant window divides by no 0."""
    y = np.asarray(y, np.float64)
    vf = np.broadcast_to(np.asarray(v, np.float64), y.shape) + (
        np.asarray(floor_var, np.float64)[..., None] if np.ndim(floor_var) else float(floor_var)
    )
    median = np.median(y, axis=-1, keepdims=True)
    deviation = np.abs(y - median)
    # the MAD's sd, or the mean absolute deviation's where more than half the window is one value (a
    # share that is 0 on most steps: the MAD is 0 and would screen out every other value)
    spread = np.maximum(
        1.4826 * np.median(deviation, axis=-1, keepdims=True), 1.2533 * deviation.mean(-1, keepdims=True)
    )
    keep = deviation <= SCREEN * np.sqrt(spread * spread + vf)
    n = keep.sum(axis=-1)
    tau2 = np.zeros(y.shape[:-1])
    for _ in range(2):  # DerSimonian-Laird, then the same moment equation reweighted (DerSimonian-Kacker)
        a, _ = _weights(vf + tau2[..., None], keep)
        sa = a.sum(axis=-1)
        mu = (a * y).sum(axis=-1) / sa
        q = (a * (y - mu[..., None]) ** 2).sum(axis=-1)
        sa2 = (a * a).sum(axis=-1)
        expected = (a * vf).sum(axis=-1) - (a * a * vf).sum(axis=-1) / sa  # E[q] when tau2 = 0
        with np.errstate(invalid="ignore", divide="ignore"):  # one kept value: no spread to measure
            tau2 = np.where(n > 1, np.maximum((q - expected) / (sa - sa2 / sa), 0.0), 0.0)
    a, smallest = _weights(vf + tau2[..., None], keep)
    sa = a.sum(axis=-1)
    return (a * y).sum(axis=-1) / sa, tau2, smallest / sa


def _weights(var: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kept values' inverse variances divided by the largest of them (the moment equations do not
    change under a common factor, and the sums stay finite) and that divisor's inverse, the smallest
    kept variance: the weights are ``a / smallest``. A zero variance takes all the weight."""
    smallest = np.min(np.where(keep, var, np.inf), axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(smallest > 0, smallest / var, var == 0)
    return keep * a, smallest[..., 0]


# ------------------------------------------------------------------------------------ the CUSUM pieces


def cusum(z: np.ndarray, k: float = DEFAULT_K) -> np.ndarray:
    """Page's one-sided CUSUM of ``z``: ``S_t = max(0, S_{t-1} + z_t - k)``, ``S_0 = 0``."""
    c = np.concatenate([[0.0], np.cumsum(np.asarray(z, np.float64) - k)])
    # the recursion in closed form: the walk's height above its lowest point so far
    return (c - np.minimum.accumulate(c))[1:]


def change_location(z: np.ndarray, level: float = 0.95, signed: bool = True) -> tuple[int, int, int]:
    """Maximum-likelihood start of one step change in the mean of ``z`` (unit variance, mean 0 before
    it, a fitted mean after it), and the first and last start of its profile-likelihood confidence set
    at ``level``: indices into ``z``. ``signed``: only an upward change counts (a fall is no evidence).

    Fitted to the steps up to the alarm. On a gradual climb rather than a jump this finds where the
    climb had become clear (about one sd up), after the climb's first step; benchmarks/bench_drift.py
    measures how far after."""
    z = np.asarray(z, np.float64)
    tail = np.cumsum(z[::-1])[::-1]  # sum of z from each candidate start to the end
    if signed:
        tail = np.maximum(tail, 0.0)
    lr = tail * tail / np.arange(len(z), 0, -1)  # twice the log-likelihood gain of a change there
    best = int(np.argmax(lr))
    cut = NormalDist().inv_cdf(0.5 + level / 2) ** 2  # chi-square(1) quantile at level
    inside = np.flatnonzero(lr >= lr[best] - cut)
    return best, int(inside[0]), int(inside[-1])


# -------------------------------------------------------------------------------------- the threshold


class _Curve:
    """Simulated null runs for one (window size, sides, alpha, k): their CUSUM state after the steps
    simulated so far, and the threshold h(m) for every monitored length m up to there."""

    def __init__(self, n_baseline: int, two_sided: bool, alpha: float, k: float) -> None:
        self.n_sims = max(SIMULATIONS, math.ceil(100 / alpha))
        # the order statistic whose exceedance rate is <= alpha with 95% confidence over the simulation
        # error: the threshold errs on the side of fewer false alarms
        n, a = self.n_sims, alpha
        exceed = max(0, math.floor(n * a - 1.645 * math.sqrt(n * a * (1 - a))))
        self.kth = n - 1 - exceed
        self.two_sided, self.k = two_sided, k
        rng = np.random.default_rng([SIMULATION_SEED, n_baseline])
        window = rng.standard_normal((self.n_sims, n_baseline))
        mu, tau2, var_mu = fit_baseline(window, 0.0, SIGMA_FLOOR**2)  # the fit detect_drift runs, on each window
        self.shift = mu.astype(np.float32)
        self.scale = (1.0 / np.sqrt(tau2 + var_mu + SIGMA_FLOOR**2)).astype(np.float32)
        self.up = np.zeros(self.n_sims, np.float32)
        self.down = np.zeros(self.n_sims, np.float32)
        self.top = np.zeros(self.n_sims, np.float32)
        self.h: list[float] = []
        self.n_baseline = n_baseline

    def extend(self, length: int) -> None:
        while len(self.h) < length:
            block = len(self.h) // BLOCK
            rng = np.random.default_rng([SIMULATION_SEED, self.n_baseline, 1 + block])
            z = rng.standard_normal((BLOCK, self.n_sims), dtype=np.float32)
            z -= self.shift
            z *= self.scale
            if Z_CLIP:
                np.clip(z, -Z_CLIP, Z_CLIP, out=z)
            up = z - np.float32(self.k)  # the increments of each side's CUSUM
            down = -z - np.float32(self.k) if self.two_sided else None
            # top[j]: each run's largest CUSUM up to step j of the block. The recursion runs step by step
            # over all runs at once (a few vector operations a step beat NumPy's accumulate along the
            # steps here) and its state carries over to the next block
            top = np.empty_like(z)
            for j in range(BLOCK):
                np.add(self.up, up[j], out=self.up)
                np.maximum(self.up, 0, out=self.up)
                np.maximum(self.top, self.up, out=self.top)
                if down is not None:
                    np.add(self.down, down[j], out=self.down)
                    np.maximum(self.down, 0, out=self.down)
                    np.maximum(self.top, self.down, out=self.top)
                top[j] = self.top
            self.h.extend(np.partition(top, self.kth, axis=1)[:, self.kth].astype(np.float64).tolist())


_CURVES: dict[tuple[int, bool, float, float, float], _Curve] = {}
_LOCK = threading.Lock()


def metric_alpha(alpha: float, n_metrics: int) -> float:
    """Each metric's false-alarm rate when ``n_metrics`` metrics of one run are tested and the run's
    rate, the chance that any of them alarms without a drift, must stay at most ``alpha``: ``alpha /
    n_metrics`` (Bonferroni: a union bound, valid whatever the metrics' dependence)."""
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    if n_metrics < 1:
        raise ValueError(f"n_metrics must be at least 1, got {n_metrics}")
    return alpha / n_metrics


def drift_threshold(
    n_baseline: int, n_monitored: int, *, alpha: float = 0.05, direction: str = "up", k: float = DEFAULT_K
) -> float:
    """The CUSUM threshold h (in standard deviations) at which a run with no drift, a baseline fitted on
    ``n_baseline`` steps and ``n_monitored`` steps after it alarms with probability at most ``alpha``
    (the fit's error included). Simulated once per (``n_baseline``, sides, ``alpha``, ``k``) and cached;
    longer ``n_monitored`` extend the same simulated runs."""
    if n_baseline < MIN_BASELINE:
        raise ValueError(f"a baseline needs at least {MIN_BASELINE} steps, got {n_baseline}")
    if n_monitored < 1:
        raise ValueError(f"n_monitored must be at least 1, got {n_monitored}")
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    key = (n_baseline, direction == "both", float(alpha), float(k), Z_CLIP)
    with _LOCK:
        curve = _CURVES.get(key)
        if curve is None:
            curve = _CURVES[key] = _Curve(n_baseline, direction == "both", alpha, k)
        curve.extend(n_monitored)
        return curve.h[n_monitored - 1]


def shift_power(
    shift_sd: float, threshold: float, *, k: float = DEFAULT_K, steps: int = POWER_STEPS, direction: str = "up"
) -> float:
    """The chance that the clipped CUSUM of :func:`detect_drift` passes ``threshold`` within ``steps``
    steps of a sustained shift of ``shift_sd`` standard deviations (in the test's direction), starting
    from a CUSUM at 0 (no evidence before the shift: the conservative case). Seeded simulation of
    :data:`POWER_SIMULATIONS` runs, so the same inputs give the same power."""
    rng = np.random.default_rng([SIMULATION_SEED, 2, steps])
    z = rng.standard_normal((POWER_SIMULATIONS, steps)) + abs(shift_sd)
    if Z_CLIP:
        np.clip(z, -Z_CLIP, Z_CLIP, out=z)
    c = np.concatenate([np.zeros((POWER_SIMULATIONS, 1)), np.cumsum(z - k, axis=1)], axis=1)
    top = (c - np.minimum.accumulate(c, axis=1)).max(axis=1)
    return float((top >= threshold).mean())


# ------------------------------------------------------------------------------------------ detection


def _transform(x: np.ndarray, scale: str, floor: float) -> np.ndarray:
    if scale == "linear":
        return x
    with np.errstate(invalid="ignore"):
        return np.log(np.where(np.isnan(x), np.nan, np.maximum(x, floor)))


def detect_drift(
    steps: np.ndarray,
    values: np.ndarray,
    low: np.ndarray | None = None,
    high: np.ndarray | None = None,
    *,
    metric: str = "",
    baseline_steps: int = 20,
    alpha: float = 0.05,
    scale: str = "log",
    direction: str = "up",
    level: float = 0.95,
    k: float = DEFAULT_K,
    horizon: int | None = None,
    change_level: float = 0.95,
) -> DriftResult:
    """Whether and where a per-step metric leaves its early-steps baseline (the module docstring says how).

    ``steps``: increasing step numbers (gaps allowed); ``values``: the metric per step, NaN for a step
    without one (skipped); ``low``/``high``: each step's bootstrap interval at ``level`` (None: no
    sampling-noise information, all of the variation is then between-step). ``scale``: "log" for a
    positive metric (a value <= 0 is floored at half the smallest positive one, with a note), "linear"
    otherwise. ``direction``: "up" (higher is worse), "down" or "both". The baseline is the first
    ``baseline_steps`` observed steps; infinite values there are left out of the fit (noted), and after
    it they are an alarm in their direction. ``alpha`` is the false-alarm rate over ``horizon``
    monitored steps (default: those observed after the window; a live run passes its planned number,
    and a run longer than ``horizon`` is tested over its own length). ``k`` is the CUSUM's reference
    value in sd; ``change_level`` the confidence of the change step's interval."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if baseline_steps < MIN_BASELINE:
        raise ValueError(f"baseline_steps must be at least {MIN_BASELINE}, got {baseline_steps}")
    if not 0.0 < level < 1.0 or not 0.0 < change_level < 1.0:
        raise ValueError(f"level and change_level must be in (0, 1), got {level} and {change_level}")
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must be in (0, 0.5), got {alpha}")
    steps = np.asarray(steps)
    x = np.asarray(values, np.float64)
    if steps.ndim != 1 or x.shape != steps.shape:
        raise ValueError(f"steps and values must be 1-d of one length, got {steps.shape} and {x.shape}")
    if len(steps) > 1 and not (np.diff(steps) > 0).all():
        raise ValueError("steps must be strictly increasing")
    if (low is None) != (high is None):
        raise ValueError("give both low and high, or neither")
    lo = np.full_like(x, np.nan) if low is None else np.asarray(low, np.float64)
    hi = np.full_like(x, np.nan) if high is None else np.asarray(high, np.float64)
    if lo.shape != x.shape or hi.shape != x.shape:
        raise ValueError("low and high must have one value per step")
    nothing = DriftResult(metric, False, None, None, None, None, None, None, None, alpha, None, scale, direction)

    observed = np.flatnonzero(~np.isnan(x))
    if len(observed) <= baseline_steps:
        return replace(
            nothing,
            reason=f"{len(observed)} observed steps: a {baseline_steps}-step baseline and at least one after it needed",
        )
    steps, x, lo, hi = steps[observed], x[observed], lo[observed], hi[observed]
    notes: list[str] = []

    # the log of a value <= 0 (a K3 that rounds to 0) is floored at half the smallest positive value seen
    floor = 1.0
    if scale == "log":
        positive = np.concatenate([x, lo, hi])
        positive = positive[np.isfinite(positive) & (positive > 0)]
        floor = 0.5 * float(positive.min()) if len(positive) else 1.0
        if (x <= 0).any():
            notes.append(f"{int((x <= 0).sum())} values <= 0 floored at {floor:.3g} before the log")
    y = _transform(x, scale, floor)
    width = _transform(hi, scale, floor) - _transform(lo, scale, floor)
    with np.errstate(invalid="ignore"):
        s2 = (width / (2 * NormalDist().inv_cdf(0.5 + level / 2))) ** 2
    known = np.isfinite(s2)
    if known.any() and not known.all():
        # a step without a usable interval gets the run's typical sampling variance, not 0 (which would
        # make it count as exact)
        s2 = np.where(known, s2, float(np.median(s2[known])))
        if low is not None:
            notes.append(f"{int((~known).sum())} steps without a finite interval: typical sampling noise assumed")
    elif not known.any():
        s2 = np.zeros_like(y)

    window, rest = slice(0, baseline_steps), slice(baseline_steps, None)
    finite = np.isfinite(y[window])
    n_base = int(finite.sum())
    window_steps = (int(steps[0]), int(steps[baseline_steps - 1]))
    if (~finite).any():
        notes.append(f"{int((~finite).sum())} infinite values in the baseline window left out of its fit")
    if n_base < MIN_BASELINE:
        return replace(
            nothing,
            reason=f"{n_base} finite values in the baseline window, at least {MIN_BASELINE} needed",
            notes=tuple(notes),
        )
    yb, vb = y[window][finite], s2[window][finite]
    baseline = float(np.median(x[window][finite]))
    center = float(np.median(yb))
    floor_var = SIGMA_FLOOR**2 * (1.0 if scale == "log" else max(abs(center), SIGMA_FLOOR) ** 2)
    mu, tau2, var_mu = (float(a) for a in fit_baseline(yb, vb, floor_var))

    ym, vm, sm = y[rest], s2[rest], steps[rest]
    with np.errstate(invalid="ignore"):
        z = (ym - mu) / np.sqrt(vm + tau2 + var_mu + floor_var)
    z = np.clip(np.where(np.isnan(z), 0.0, z), -Z_CAP, Z_CAP)  # +-inf values: an alarm in their direction
    # the CUSUM reads each step clipped at Z_CLIP (an infinite value still fires it); where the change
    # starts is the plain likelihood's question: a jump of 10 sd is located better as 10 than as 3
    clipped = np.where(np.abs(z) == Z_CAP, z, np.clip(z, -Z_CLIP, Z_CLIP)) if Z_CLIP else z
    n_mon = len(z)
    horizon = max(n_mon, horizon or 0)
    h = drift_threshold(n_base, horizon, alpha=alpha, direction=direction, k=k)

    step_sd = float(np.median(np.sqrt(vm + tau2 + var_mu + floor_var)))
    power = (
        shift_power(math.log(POWER_FACTOR) / step_sd, h, k=k, direction=direction)
        if scale == "log" and step_sd > 0
        else None
    )
    sides = {"up": [1.0], "down": [-1.0], "both": [1.0, -1.0]}[direction]
    paths = [cusum(sign * clipped, k) for sign in sides]
    statistic = max(float(p.max()) for p in paths)
    fired = [(int(np.argmax(p >= h)), sign) for p, sign in zip(paths, sides, strict=True) if (p >= h).any()]
    tested = replace(
        nothing,
        baseline_steps=window_steps,
        baseline=baseline,
        threshold=h,
        statistic=statistic,
        tau=math.sqrt(tau2),
        n_baseline=n_base,
        n_monitored=n_mon,
        horizon=horizon,
        notes=tuple(notes),
        step_sd=step_sd,
        power=power,
    )
    if not fired:
        return tested
    alarm, sign = min(fired)
    best, first, last = change_location(sign * z[: alarm + 1], change_level)
    after = float(np.median(x[rest][best : alarm + 1]))
    return replace(
        tested,
        detected=True,
        change_step=int(sm[best]),
        interval=(int(sm[first]), int(sm[last])),
        alarm_step=int(sm[alarm]),
        after=after,
        ratio=after / baseline if scale == "log" and baseline > 0 else None,
    )

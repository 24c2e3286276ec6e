"""How many samples a run needs: K3's sequence-bootstrap interval after each round of sampling, and
the size of the next round. Pure functions; the rounds themselves are ``pipeline/adaptive.py``'s.

The interval is the run's own (``analysis/intervals.py: run_intervals``: 95%, 2,000 replicates,
seed 0, the sequence as the unit), so the last round's interval is the one run.json's ``intervals``
gives K3 once the run is analyzed. Its relative half-width ``(high - low) / (2 K3)`` shrinks as
``1 / sqrt(n)`` in the number of sequences (the central limit theorem for a ratio estimator), so
``n (r / target)^2`` sequences are expected to bring a relative half-width ``r`` to ``target``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from mismatch_probe.analysis.intervals import RUN_LEVEL, RUN_N_BOOT, RUN_SEED, Interval, bootstrap_intervals
from mismatch_probe.analysis.terms import segment_starts, sequence_terms, token_terms
from mismatch_probe.numbers import pct

# the most a round may add, as a multiple of the samples drawn before it: an early interval is itself
# noisy, and a round sized on an optimistic one could spend the whole budget on what two smaller
# rounds would have shown was not needed
MAX_GROWTH = 3
# how many more samples a round draws than the estimate asks for: the half-width a round measures is
# itself an estimate, so a round sized on it exactly misses the target about half the time, and every
# further round costs a whole batch of decode steps (an engine's step costs nearly the same at any
# batch size); 20% more brings the expected half-width to 0.91x the target, at most 20% more samples
ROUND_MARGIN = 1.2
# the budget of samples when none is given, in first rounds (the prompts x n samples)
DEFAULT_MAX_ROUNDS_OF_SAMPLES = 10


def sequence_k3(logp_train: np.ndarray, logp_infer: np.ndarray, sample_id: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's K3 sum and model-token count, from a token shard's model tokens (a sequence's
    tokens contiguous): the sufficient statistics of ``k3_kl``, as the metrics pass computes them."""
    lt = np.asarray(logp_train, np.float64)
    li = np.asarray(logp_infer, np.float64)
    if len(lt) == 0:
        return np.zeros(0), np.zeros(0, np.int64)
    seq = sequence_terms(token_terms(lt, li), lt, li, segment_starts(np.asarray(sample_id)))
    return np.asarray(seq.k3_sum, np.float64), np.asarray(seq.n_tokens, np.int64)


def k3_interval(k3_sum: np.ndarray, n_tokens: np.ndarray) -> Interval | None:
    """K3 (``sum k3_sum / sum n_tokens``) and its 95% sequence-bootstrap interval, exactly as
    run.json's ``intervals`` computes it; None without sequences."""
    columns = {"k3_sum": np.asarray(k3_sum, np.float64), "n_tokens": np.asarray(n_tokens, np.float64)}
    found = bootstrap_intervals(columns, ["k3_kl"], n_boot=RUN_N_BOOT, level=RUN_LEVEL, seed=RUN_SEED)
    return found["k3_kl"]


def relative_half_width(interval: Interval) -> float:
    """``(high - low) / (2 estimate)``: 0 for an interval of width 0 (an estimate of 0 that every
    replicate repeats), inf where the estimate is 0 but the interval is not, NaN where the estimate
    is not finite (a token the reference gives probability 0: no number of samples makes it finite)."""
    estimate, low, high = interval
    if not math.isfinite(estimate) or not (math.isfinite(low) and math.isfinite(high)):
        return math.nan
    width = high - low
    if width <= 0:
        return 0.0
    return math.inf if estimate == 0 else width / (2 * abs(estimate))


def samples_needed(n: int, relative: float, target: float) -> int | None:
    """How many samples are expected to bring a relative half-width ``relative`` measured on ``n``
    to ``target`` (``ceil(n (relative / target)^2)``, at least ``n``); None when it cannot be told."""
    if not math.isfinite(relative) or n <= 0:
        return None
    # 1e-9: (0.2 / 0.1)^2 is 4.000000000000001 in floating point, and 64 x that is not 257 samples
    return max(n, math.ceil(n * (relative / target) ** 2 - 1e-9))


class Budget(NamedTuple):
    """What all rounds together may spend; None: no limit of that kind."""

    samples: int
    tokens: int | None = None
    seconds: float | None = None


class Spent(NamedTuple):
    samples: int
    tokens: int  # model tokens of the samples
    seconds: float  # sampling and scoring the rounds


class NextRound(NamedTuple):
    """The decision after a round: the samples of the next round (0: stop), why it stops, and the
    samples the target is expected to need in all (None when it cannot be told)."""

    samples: int
    stop: str | None
    needed: int | None
    met: bool


def next_round(relative: float, target: float, spent: Spent, budget: Budget, n_per_prompt: int = 1) -> NextRound:
    """The size of the next round, or why there is none: the target is met; K3 is not finite; or a
    budget is spent. A round adds what the target is expected to need times :data:`ROUND_MARGIN`
    (rounded up to whole groups of ``n_per_prompt``, so every prompt's group is sampled together), at most :data:`MAX_GROWTH`
    times the samples so far, and no more than each budget has left (the tokens and seconds a
    sample costs are this run's means so far)."""
    if relative <= target:
        return NextRound(0, None, spent.samples, True)
    needed = samples_needed(spent.samples, relative, target)
    if needed is None:
        why = (
            "K3 is infinite (a token the reference gives probability 0): no number of samples makes it finite"
            if math.isnan(relative)
            else "K3 is 0 but its interval is not"
        )
        return NextRound(0, why, None, False)
    more = math.ceil(needed * ROUND_MARGIN - 1e-9) - spent.samples
    wanted = _whole_groups(min(more, MAX_GROWTH * spent.samples), n_per_prompt, up=True)
    # each budget: what it allows (samples), and how the stop names it
    limits = [(budget.samples - spent.samples, f"max_samples = {budget.samples}")]
    if budget.tokens is not None and spent.tokens > 0:
        per_sample = spent.tokens / spent.samples
        limits.append((math.floor((budget.tokens - spent.tokens) / per_sample), f"token_budget = {budget.tokens}"))
    if budget.seconds is not None and spent.seconds > 0:
        per_sample = spent.seconds / spent.samples
        limits.append((math.floor((budget.seconds - spent.seconds) / per_sample), f"time_budget = {budget.seconds:g}"))
    samples = wanted
    for left, name in limits:
        samples = min(samples, _whole_groups(max(left, 0), n_per_prompt, up=False))
        if samples == 0:
            return NextRound(0, f"the budget {name} is spent", needed, False)
    return NextRound(samples, None, needed, False)


def _whole_groups(samples: int, n_per_prompt: int, *, up: bool) -> int:
    groups = -(-samples // n_per_prompt) if up else samples // n_per_prompt
    return groups * n_per_prompt


def percent(share: float) -> str:
    """A relative half-width as people write it: ``10%``, ``2.5%``, ``inf`` / ``n/a`` where it is not finite."""
    if math.isnan(share):
        return "n/a"
    return "inf" if math.isinf(share) else pct(share)


def outcome_line(state: dict[str, Any]) -> str:
    """run.json's ``precision`` in one line: ``precision met: ...``, ``precision not met: ... (why);
    N more samples estimated``, or where an unfinished run stands."""
    rounds = state["rounds"]
    last = rounds[-1]
    where = (
        f"K3 {last['k3_kl']:.3g} ±{percent(last['relative_half_width'])} on {last['samples_total']} samples "
        f"in {len(rounds)} round{'s' if len(rounds) > 1 else ''} (target ±{percent(state['target'])})"
    )
    if state.get("met") is None:
        return f"precision so far: {where}; the run stopped before it decided"
    if state["met"]:
        return f"precision met: {where}"
    more = state.get("more_samples_needed")
    estimate = f"; {more} more samples estimated" if more is not None else ""
    return f"precision not met: {where}: {state.get('stop')}{estimate}"

"""Sequence-level bootstrap intervals of a run's metrics, from sequences.parquet's rows.

Tokens of one sequence are not independent (a token that moved shifts every later token's context),
so the unit resampled is the sequence: a replicate draws the run's n sequences with replacement and
recomputes each metric from the sequences' sufficient statistics (a token-mean metric is a ratio of
per-sequence sums, e.g. k3_kl = sum(k3_sum) / sum(n_tokens)). A replicate is a vector of
counts (how often each sequence was drawn); a chunk of them times the matrix of per-sequence values
gives every metric of every replicate in one matrix product, and memory is ``chunk x n_sequences``
whatever ``n_boot``.

Paired intervals are for two runs that score the same token sequences (re-scored rollouts): both
sides are resampled with the same counts, so the noise of which sequences were sampled cancels in
their difference, and what is left is the effect of the setting. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from mismatch_probe.analysis.metrics import SEQ_LOG_RATIO_CLAMP

# one group of sequences.parquet (analysis.sequences.group_columns): n_tokens, k3_sum, log_ratio, ...
Columns = Mapping[str, np.ndarray]


class Interval(NamedTuple):
    estimate: float  # the metric on the run's own sequences (every count 1)
    low: float
    high: float

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high


class BootstrapMetric(NamedTuple):
    """A metric as a mean of per-sequence values: sum of ``value`` over the drawn sequences, over
    their tokens (``per = "token"``) or their count (``per = "sequence"``), plus ``offset``; or
    (``per = "max"``) the largest ``value`` among the drawn sequences. ``needs`` names the columns
    it reads, so a table written before a column existed skips the metric instead of failing."""

    value: Callable[[Columns], np.ndarray]
    per: str
    offset: float = 0.0
    needs: tuple[str, ...] = ()


def _seq_weight_sq(c: Columns) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(2.0 * np.clip(c["log_ratio"], -SEQ_LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CLAMP))


# The metrics of run.json a sequence-level bootstrap can recompute from sequences.parquet's columns.
# Each is exactly the metric the metrics pass reports when every sequence is drawn once.
BOOTSTRAP_METRICS: dict[str, BootstrapMetric] = {
    "k3_kl": BootstrapMetric(lambda c: c["k3_sum"], "token"),
    # the max over tokens is the max over sequences of each one's max; a percentile bootstrap of a
    # maximum is biased low (a replicate can only repeat the run's largest value), so its interval
    # says "how much does the worst token depend on which sequences were sampled", nothing more
    "prob_diff_max": BootstrapMetric(lambda c: c["max_mismatch"], "max"),
    "mult_prob_error": BootstrapMetric(lambda c: c["mult_error_sum"], "token", needs=("mult_error_sum",)),
    "k1_kl": BootstrapMetric(lambda c: -c["log_ratio"], "token"),  # k1 = -delta; log_ratio = sum of delta
    "prob_diff_mean": BootstrapMetric(lambda c: c["mean_mismatch"] * c["n_tokens"], "token"),
    "seq_max_mismatch_mean": BootstrapMetric(lambda c: c["max_mismatch"], "sequence"),
    "seq_max_mismatch_gt_0_5_share": BootstrapMetric(
        lambda c: (c["max_mismatch"] > 0.5).astype(np.float64), "sequence"
    ),
    "seq_mean_mismatch_mean": BootstrapMetric(lambda c: c["mean_mismatch"], "sequence"),
    "seq_log_ratio_mean": BootstrapMetric(lambda c: c["log_ratio"], "sequence"),
    "seq_geo_ratio_mean": BootstrapMetric(lambda c: c["geo_ratio"], "sequence"),
    "log_ppl_infer": BootstrapMetric(lambda c: c["log_ppl_infer"], "sequence"),
    "log_ppl_train": BootstrapMetric(lambda c: c["log_ppl_train"], "sequence"),
    "chi2_seq": BootstrapMetric(_seq_weight_sq, "sequence", -1.0),
}


def available(columns: Columns, keys: list[str] | None = None) -> list[str]:
    """The metrics of ``keys`` (default: all) that ``columns`` has what it takes to recompute."""
    keys = list(BOOTSTRAP_METRICS) if keys is None else keys
    return [k for k in keys if all(name in columns for name in BOOTSTRAP_METRICS[k].needs)]


class Prepared(NamedTuple):
    """The per-sequence matrix of some metrics, built once and evaluated under every replicate."""

    keys: list[str]
    sums: np.ndarray  # [sequences, metrics summed + n_tokens], non-finite values zeroed
    nonfinite: list[tuple[int, np.ndarray, np.ndarray]]  # (column, rows, their values) per column with any
    per_token: np.ndarray  # bool per summed metric: over tokens (else over sequences)
    offset: np.ndarray
    summed: list[int]  # where each summed metric goes in the output
    maxima: list[tuple[int, np.ndarray, np.ndarray]]  # (output column, sequences by value descending, values)


def prepare(columns: Columns, keys: list[str]) -> Prepared:
    """What :func:`evaluate` needs of ``columns``, computed once for all replicates."""
    summed = [j for j, k in enumerate(keys) if BOOTSTRAP_METRICS[k].per != "max"]
    values = np.column_stack(
        [np.asarray(BOOTSTRAP_METRICS[keys[j]].value(columns), np.float64) for j in summed]
        + [np.asarray(columns["n_tokens"], np.float64)]
    )
    finite = np.isfinite(values)
    nonfinite = [
        (j, np.flatnonzero(~finite[:, j]), values[~finite[:, j], j]) for j in np.flatnonzero(~finite.all(axis=0))
    ]
    maxima = []
    for j, k in enumerate(keys):
        if BOOTSTRAP_METRICS[k].per == "max":
            value = np.asarray(BOOTSTRAP_METRICS[k].value(columns), np.float64)
            # NaN is a missing value here (a sequence with no scored tokens), as np.nanmax treats it
            order = np.flatnonzero(~np.isnan(value))
            order = order[np.argsort(-value[order], kind="stable")]
            maxima.append((j, order, value[order]))
    return Prepared(
        keys,
        np.where(finite, values, 0.0),
        nonfinite,
        np.array([BOOTSTRAP_METRICS[keys[j]].per == "token" for j in summed], dtype=bool),
        np.array([BOOTSTRAP_METRICS[keys[j]].offset for j in summed]),
        summed,
        maxima,
    )


def evaluate(weights: np.ndarray, columns: Columns | Prepared, keys: list[str] | None = None) -> np.ndarray:
    """Each metric of ``keys`` (columns) under each row of sequence counts ``weights`` (rows): one
    matrix product for all of them. A value drawn 0 times contributes nothing even when it is
    infinite or NaN (not 0 * inf = NaN); a replicate that draws +inf is +inf, one that draws NaN or
    both infinities is NaN. ``columns`` may be :func:`prepare`'s, to build the matrix once."""
    p = columns if isinstance(columns, Prepared) else prepare(columns, list(keys or []))
    out = np.empty((weights.shape[0], len(p.keys)))
    if p.summed:
        sums = weights @ p.sums
        for j, rows, bad in p.nonfinite:
            drawn = weights[:, rows] > 0
            pos, neg, nan = (
                drawn[:, bad == np.inf].any(1),
                drawn[:, bad == -np.inf].any(1),
                drawn[:, np.isnan(bad)].any(1),
            )
            sums[:, j] = np.where(nan | (pos & neg), np.nan, np.where(pos, np.inf, np.where(neg, -np.inf, sums[:, j])))
        with np.errstate(invalid="ignore", divide="ignore"):
            denominator = np.where(p.per_token, sums[:, -1:], weights.sum(axis=1, keepdims=True))
            out[:, p.summed] = sums[:, :-1] / denominator + p.offset
    for j, order, value in p.maxima:
        out[:, j] = _drawn_max(weights, order, value)
    return out


def _drawn_max(weights: np.ndarray, order: np.ndarray, value: np.ndarray, head: int = 64) -> np.ndarray:
    """The largest ``value`` among the sequences each row of ``weights`` draws (NaN if none), with
    ``order`` the sequences by value, largest first. A replicate misses a given sequence with
    probability (1 - 1/n)^n ~ 0.37, so the first drawn one is almost always among the first few:
    only rows that draw none of the first ``head`` look further."""
    out = np.full(weights.shape[0], np.nan)
    if not len(order):
        return out
    top = weights[:, order[:head]] > 0
    found = top.any(axis=1)
    out[found] = value[np.argmax(top[found], axis=1)]
    rest = np.flatnonzero(~found)
    if len(rest) and len(order) > head:
        deep = weights[np.ix_(rest, order[head:])] > 0
        hit = deep.any(axis=1)
        out[rest[hit]] = value[head + np.argmax(deep[hit], axis=1)]
    out[np.isneginf(out)] = np.nan  # nothing above -inf drawn: missing, as when nothing is
    return out


def _estimate(columns: Columns, keys: list[str]) -> np.ndarray:
    """The metrics on the run's own sequences (every one drawn once)."""
    return evaluate(np.ones((1, len(columns["n_tokens"]))), columns, keys)[0]


# Values per chunk of replicates: a chunk's draws, counts and their float copy are a few times this
# many 8-byte words, so it stays ~100 MiB whatever the number of sequences.
CHUNK_VALUES = 1 << 22


def _replicates(n: int, n_boot: int, seed: int, chunk: int | None):
    """Count vectors of n draws with replacement (each row sums to n), ``chunk`` rows at a time
    (default: as many as fit CHUNK_VALUES). The draws are one stream, so the chunking does not
    change them."""
    rng = np.random.default_rng(seed)
    chunk = chunk or max(1, CHUNK_VALUES // max(n, 1))
    for start in range(0, n_boot, chunk):
        size = min(chunk, n_boot - start)
        draws = rng.integers(0, n, (size, n))
        draws += (np.arange(size) * n)[:, None]
        yield np.bincount(draws.ravel(), minlength=size * n).reshape(size, n).astype(np.float64)


def _percentiles(values: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0
    # "nearest", not interpolation: between an infinite and a finite replicate, inf * 0 would be NaN
    lo, hi = np.quantile(values, [tail, 1.0 - tail], method="nearest")
    return float(lo), float(hi)


def _check(n: int, n_boot: int, level: float) -> None:
    if n_boot < 1:
        raise ValueError(f"n_boot must be at least 1, got {n_boot}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")


def bootstrap_intervals(
    columns: Columns,
    keys: list[str] | None = None,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    chunk: int | None = None,
) -> dict[str, Interval | None]:
    """Percentile bootstrap interval of each metric in ``keys`` (default: all of
    :data:`BOOTSTRAP_METRICS`), resampling sequences; None for a metric of a run with no sequences.
    The same ``seed`` gives the same intervals."""
    keys = available(columns) if keys is None else keys
    n = len(columns["n_tokens"])
    _check(n, n_boot, level)
    if n == 0:
        return dict.fromkeys(keys)
    prepared = prepare(columns, keys)
    estimate = evaluate(np.ones((1, n)), prepared)[0]
    draws = np.concatenate([evaluate(w, prepared) for w in _replicates(n, n_boot, seed, chunk)])
    return {k: Interval(float(estimate[j]), *_percentiles(draws[:, j], level)) for j, k in enumerate(keys)}


class PairedInterval(NamedTuple):
    difference: Interval  # metric(b) - metric(a)
    ratio: Interval  # metric(b) / metric(a): the x-fold change


def paired_intervals(
    a: Columns,
    b: Columns,
    keys: list[str] | None = None,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    chunk: int | None = None,
) -> dict[str, PairedInterval | None]:
    """Intervals of the difference and the ratio of each metric between two runs that scored the
    same sequences (row i of ``a`` and of ``b`` is the same sample and turn): both are resampled with
    the same counts. "Within noise" is a difference interval that covers 0."""
    keys = available(b, available(a)) if keys is None else keys
    n = len(a["n_tokens"])
    _check(n, n_boot, level)
    if len(b["n_tokens"]) != n or any(
        name in a and name in b and not np.array_equal(a[name], b[name]) for name in ("sample_id", "turn", "n_tokens")
    ):
        raise ValueError("paired intervals need the same sequences, in the same order, on both sides")
    if n == 0:
        return dict.fromkeys(keys)
    ones = np.ones((1, n))
    pa, pb = prepare(a, keys), prepare(b, keys)
    ea, eb = evaluate(ones, pa)[0], evaluate(ones, pb)[0]
    diffs, ratios = [], []
    for weights in _replicates(n, n_boot, seed, chunk):
        ma, mb = evaluate(weights, pa), evaluate(weights, pb)
        with np.errstate(invalid="ignore", divide="ignore"):
            diffs.append(mb - ma)
            ratios.append(mb / ma)
    diff, ratio = np.concatenate(diffs), np.concatenate(ratios)
    with np.errstate(invalid="ignore", divide="ignore"):
        point_ratio = eb / ea
    return {
        k: PairedInterval(
            Interval(float(eb[j] - ea[j]), *_percentiles(diff[:, j], level)),
            Interval(float(point_ratio[j]), *_percentiles(ratio[:, j], level)),
        )
        for j, k in enumerate(keys)
    }


def unpaired_intervals(
    baselines: list[Columns],
    b: Columns,
    keys: list[str] | None = None,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    chunk: int | None = None,
) -> dict[str, PairedInterval | None]:
    """Intervals of the difference and ratio of each metric between run ``b`` and a baseline sampled
    several times (``baselines``: its repeats, other seeds), when ``b`` sampled tokens of its own.

    Nothing pairs the two, so each is resampled on its own: a baseline replicate first picks one of
    the repeats at random, then resamples that repeat's sequences (a two-level bootstrap), so the
    spread between repeats (seed, batch composition, a nondeterministic engine) widens the interval
    as much as the sequences' own spread does. The estimate is ``metric(b)`` minus (or over) the
    mean of the repeats' metrics."""
    if not baselines:
        raise ValueError("unpaired intervals need at least one baseline run")
    keys = available(b, available(baselines[0])) if keys is None else keys
    _check(len(b["n_tokens"]), n_boot, level)
    if len(b["n_tokens"]) == 0 or any(len(c["n_tokens"]) == 0 for c in baselines):
        return dict.fromkeys(keys)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(baselines), n_boot)
    prepared_b = prepare(b, keys)
    draws_b = np.concatenate(
        [evaluate(w, prepared_b) for w in _replicates(len(b["n_tokens"]), n_boot, seed + 1, chunk)]
    )
    draws_a = np.empty_like(draws_b)
    for r, columns in enumerate(baselines):
        rows = np.flatnonzero(pick == r)
        if len(rows):
            n, prepared = len(columns["n_tokens"]), prepare(columns, keys)
            draws_a[rows] = np.concatenate(
                [evaluate(w, prepared) for w in _replicates(n, len(rows), seed + 2 + r, chunk)]
            )
    eb = _estimate(b, keys)
    ea = np.mean([_estimate(c, keys) for c in baselines], axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff, ratio, point_ratio = draws_b - draws_a, draws_b / draws_a, eb / ea
    return {
        k: PairedInterval(
            Interval(float(eb[j] - ea[j]), *_percentiles(diff[:, j], level)),
            Interval(float(point_ratio[j]), *_percentiles(ratio[:, j], level)),
        )
        for j, k in enumerate(keys)
    }


# A run's own intervals (run.json's ``intervals``): as many replicates as a sweep point's, with a fixed
# seed, so an analysis re-run on the same tokens gives the same numbers
RUN_N_BOOT = 2000
RUN_LEVEL = 0.95
RUN_SEED = 0


def run_intervals(columns: Columns) -> dict | None:
    """run.json's ``intervals``: the sequence-bootstrap interval of every metric the run's sequences
    can recompute (``group all``), as ``{key: [estimate, low, high]}`` with the level, replicates and
    seed; None for a run without sequences."""
    keys = available(columns)
    if not len(columns.get("n_tokens", ())) or not keys:
        return None
    found = bootstrap_intervals(columns, keys, n_boot=RUN_N_BOOT, level=RUN_LEVEL, seed=RUN_SEED)
    return {
        "unit": "sequence",
        "level": RUN_LEVEL,
        "n_boot": RUN_N_BOOT,
        "seed": RUN_SEED,
        "n_sequences": len(columns["n_tokens"]),
        "metrics": {k: [i.estimate, i.low, i.high] for k, i in found.items() if i is not None},
    }

"""The per-token and per-sequence mismatch terms every metric is reduced from (ARCHITECTURE.md, Metrics).

Pure, vectorized functions over model tokens only (prompt and tool tokens already removed), laid out
so that the tokens of one sequence are contiguous; ``starts`` marks where each sequence begins. All
arithmetic is float64, whatever the stored dtype. The conventions (``delta``, ``ratio``, what
``-inf`` means, which values are contract violations) are written once, in
:mod:`mismatch_probe.analysis.metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from mismatch_probe.errors import DataError


class TokenTerms(NamedTuple):
    delta: np.ndarray
    abs_delta: np.ndarray
    ratio: np.ndarray
    k1: np.ndarray
    k2: np.ndarray
    k3: np.ndarray
    prob_diff: np.ndarray
    mult_error: np.ndarray
    p_train: np.ndarray
    p_infer: np.ndarray


def check_logprobs(logp_train: np.ndarray, logp_infer: np.ndarray) -> None:
    """Raise :class:`DataError` when the log-probs violate the table's contract."""
    if logp_train.shape != logp_infer.shape:
        raise DataError(f"logp_train has {logp_train.shape[0]} values but logp_infer has {logp_infer.shape[0]}")
    for name, arr in (("logp_train", logp_train), ("logp_infer", logp_infer)):
        bad = np.isnan(arr)
        if bad.any():
            raise DataError(
                f"{int(bad.sum())} model tokens have NaN {name} (first at model-token index "
                f"{int(np.argmax(bad))}); the {'reference forward' if name == 'logp_train' else 'engine'} "
                "produced NaN, often an fp16 overflow: try bfloat16 or float32"
            )
        if np.isposinf(arr).any():
            raise DataError(f"{name} contains +inf, which is not a log-probability")
    if np.isneginf(logp_infer).any():
        raise DataError(
            f"{int(np.isneginf(logp_infer).sum())} sampled tokens have logp_infer = -inf: the engine reports zero "
            "probability for tokens it sampled, so its log-probs do not describe its sampler "
            "(check logprobs_mode against the sampling settings)"
        )


def token_terms(logp_train: np.ndarray, logp_infer: np.ndarray) -> TokenTerms:
    """Per-token mismatch terms in float64."""
    lt = np.asarray(logp_train, dtype=np.float64)
    li = np.asarray(logp_infer, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        delta = lt - li
        ratio = np.exp(delta)
        p_train, p_infer = np.exp(lt), np.exp(li)
        abs_delta = np.abs(delta)
        # in place where a temporary would be (the same values; fewer fresh arrays of every token)
        k2 = np.multiply(delta, delta)
        k2 *= 0.5
        # ratio - delta - 1 loses all precision for tiny |delta|; expm1 keeps it.
        k3 = np.expm1(delta)
        k3 -= delta
        prob_diff = np.subtract(p_train, p_infer)
        np.abs(prob_diff, out=prob_diff)
        return TokenTerms(
            delta=delta,
            abs_delta=abs_delta,
            ratio=ratio,
            k1=np.negative(delta),
            k2=k2,
            k3=k3,
            prob_diff=prob_diff,
            mult_error=np.exp(abs_delta),
            p_train=p_train,
            p_infer=p_infer,
        )


def segment_starts(*keys: np.ndarray) -> np.ndarray:
    """Start index of each run of equal consecutive keys (the sequences of a contiguous table)."""
    if not keys or len(keys[0]) == 0:
        return np.zeros(0, dtype=np.int64)
    change = np.zeros(len(keys[0]), dtype=bool)
    change[0] = True
    for key in keys:
        key = np.asarray(key)
        change[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(change)


class SequenceTerms(NamedTuple):
    n_tokens: np.ndarray
    max_mismatch: np.ndarray
    mean_mismatch: np.ndarray
    log_ppl_infer: np.ndarray
    log_ppl_train: np.ndarray
    log_ratio: np.ndarray
    geo_ratio: np.ndarray
    min_token_log_ratio: np.ndarray
    k3_sum: np.ndarray  # sum of the tokens' K3: with n_tokens, the sufficient statistic of k3_kl
    mult_error_sum: np.ndarray  # sum of the tokens' exp|delta|: with n_tokens, that of mult_prob_error


def sequence_terms(
    terms: TokenTerms, logp_train: np.ndarray, logp_infer: np.ndarray, starts: np.ndarray
) -> SequenceTerms:
    """Reduce each sequence over its own tokens (``starts`` from :func:`segment_starts`)."""
    n = len(terms.delta)
    if len(starts) == 0:
        empty = np.zeros(0)
        return SequenceTerms(np.zeros(0, dtype=np.int64), *([empty] * 9))
    lt = np.asarray(logp_train, dtype=np.float64)
    li = np.asarray(logp_infer, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return sequence_terms_from_sums(
            np.diff(np.append(starts, n)),
            logp_train=np.add.reduceat(lt, starts),
            logp_infer=np.add.reduceat(li, starts),
            delta=np.add.reduceat(terms.delta, starts),
            prob_diff=np.add.reduceat(terms.prob_diff, starts),
            k3=np.add.reduceat(terms.k3, starts),
            mult_error=np.add.reduceat(terms.mult_error, starts),
            prob_diff_max=np.maximum.reduceat(terms.prob_diff, starts),
            delta_min=np.minimum.reduceat(terms.delta, starts),
        )


def sequence_terms_from_sums(
    n_tokens: np.ndarray,
    *,
    logp_train: np.ndarray,
    logp_infer: np.ndarray,
    delta: np.ndarray,
    prob_diff: np.ndarray,
    k3: np.ndarray,
    mult_error: np.ndarray,
    prob_diff_max: np.ndarray,
    delta_min: np.ndarray,
) -> SequenceTerms:
    """The sequence terms from each sequence's sums (and extrema) of its token terms: one place for
    both ways of reducing them (:func:`sequence_terms`, :mod:`.kernels`)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return SequenceTerms(
            n_tokens=n_tokens,
            max_mismatch=prob_diff_max,
            mean_mismatch=prob_diff / n_tokens,
            log_ppl_infer=-logp_infer / n_tokens,
            log_ppl_train=-logp_train / n_tokens,
            log_ratio=delta,
            geo_ratio=np.exp(delta / n_tokens),
            min_token_log_ratio=delta_min,
            k3_sum=k3,
            mult_error_sum=mult_error,
        )


def quantiles(values: np.ndarray, qs: dict[str, float]) -> dict[str, float | None]:
    """Linear-interpolation quantiles that stay ``inf`` (not NaN) when the tail is infinite."""
    if len(values) == 0:
        return {k: None for k in qs}
    finite_max = np.finfo(np.float64).max
    vals = np.minimum(np.asarray(values, dtype=np.float64), finite_max)
    out = np.quantile(vals, list(qs.values()))
    # An interpolation that touched an infinite neighbour lands above 1e300.
    return {k: (math.inf if v > 1e300 else float(v)) for k, v in zip(qs, out)}


def bucket_index(values: np.ndarray, edges: tuple) -> np.ndarray:
    """Bucket ``i`` holds ``edges[i] <= v < edges[i+1]``; the last bucket also takes ``v >= edges[-1]``
    for open-ended edges and ``v == edges[-1]`` for closed ones. (The number of inner edges at or
    below each value: ``searchsorted(edges[1:-1], v, side="right")``, as branch-free comparisons,
    several times faster for these few edges.)"""
    values = np.asarray(values)
    out = np.zeros(values.shape, dtype=np.uint8)
    for edge in edges[1:-1]:
        out += values >= edge
    return out


@dataclass
class ShardTerms:
    """What :meth:`MetricsAccumulator.add` computed for a shard, for other accumulators to reuse."""

    logp_train: np.ndarray
    logp_infer: np.ndarray
    sequences: SequenceTerms  # one per sequence (``starts``)
    segments: np.ndarray  # start of each segment: a sequence, or its part in one turn
    segment_turn: np.ndarray  # the turn of each segment
    # the compiled pass (analysis/kernels.py) keeps no per-token terms: computed on first use
    known_terms: TokenTerms | None = None
    peers: Any = None  # the compiled pass's share of the peer metrics (a peer_metrics.PeerPart)

    @property
    def terms(self) -> TokenTerms:
        if self.known_terms is None:
            self.known_terms = token_terms(self.logp_train, self.logp_infer)
        return self.known_terms

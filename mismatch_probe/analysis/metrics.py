"""Mismatch metrics (ARCHITECTURE.md, Metrics) as pure, vectorized functions over model tokens.

Everything here takes NumPy arrays of model tokens only (prompt and tool tokens already
removed), laid out so that the tokens of one sequence are contiguous. ``starts`` marks where
each sequence begins. All arithmetic is float64, whatever the stored dtype.

Conventions, documented once:

* ``delta = logp_train - logp_infer``; ``ratio = exp(delta)`` (training over inference).
* ``logp_train == -inf`` is allowed: the reference gives the sampled token zero probability
  (e.g. outside its own top-p set under processed semantics). Then ``p_train = 0``,
  ``ratio = 0`` and the delta-based metrics (K1, K2, K3, |delta|, multiplicative error) are
  ``inf`` — the true value of a KL between distributions with different support. It is counted
  in ``n_zero_prob_train``.
* NaN anywhere, ``+inf`` anywhere, or ``logp_infer == -inf`` (the engine reports zero probability
  for a token it sampled) are contract violations and raise :class:`DataError`.
* ``chi2_token`` / ``chi2_seq`` are ``E[w^2] - 1`` as verl computes them (comparable with verl
  dashboards). They assume ``E[w] = 1``; the sample mean of ``w`` fluctuates around 1, so near
  zero they can come out slightly negative. ``chi2_token_sn`` / ``chi2_seq_sn`` are the
  self-normalized ``E[w^2] / E[w]^2 - 1``, computed from squared deviations, never negative.
* Sequence-level values (``seq_*``, ``log_ppl_*``, ``chi2_seq*``) reduce each sequence over its
  own tokens first, then average over sequences; everything else averages over tokens.
* A group with no model tokens gives ``None`` for every value and 0 for the counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from mismatch_probe.config.spec import CorrectionThresholds
from mismatch_probe.errors import DataError

# The sequence log-ratio is clamped before exponentiating in chi2_seq, as verl's rollout
# correction safety bound does ([exp(-20), exp(20)]).
SEQ_LOG_RATIO_CLAMP = 20.0

P_INFER_BUCKET_EDGES = (0.0, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 0.99, 1.0)
POSITION_BUCKET_EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
LENGTH_BUCKET_EDGES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}

# Canonical keys (ARCHITECTURE.md, Metrics): reports and gates rely on them; add, never rename.
CANONICAL_KEYS = (
    "k3_kl",
    "k1_kl",
    "abs_delta_mean",
    "abs_delta_p99",
    "prob_diff_max",
    "prob_diff_mean",
    "seq_max_mismatch_mean",
    "seq_max_mismatch_gt_0_5_share",
    "mult_prob_error",
    "chi2_token",
    "chi2_seq",
    "ess",
    "pearson_prob",
    "log_ppl_infer",
    "log_ppl_train",
    "n_model_tokens",
    "n_sequences",
)
CORRECTION_KEYS = (
    "token_tis_clipped_share",
    "token_mask_share",
    "seq_tis_clipped_share",
    "seq_mis_masked_share",
    "geo_rejected_share",
    "worst_token_rejected_share",
)


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
        return TokenTerms(
            delta=delta,
            abs_delta=abs_delta,
            ratio=ratio,
            k1=-delta,
            k2=0.5 * delta * delta,
            # ratio - delta - 1 loses all precision for tiny |delta|; expm1 keeps it.
            k3=np.expm1(delta) - delta,
            prob_diff=np.abs(p_train - p_infer),
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
    n_tokens = np.diff(np.append(starts, n))
    lt = np.asarray(logp_train, dtype=np.float64)
    li = np.asarray(logp_infer, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        log_ratio = np.add.reduceat(terms.delta, starts)
        return SequenceTerms(
            n_tokens=n_tokens,
            max_mismatch=np.maximum.reduceat(terms.prob_diff, starts),
            mean_mismatch=np.add.reduceat(terms.prob_diff, starts) / n_tokens,
            log_ppl_infer=-np.add.reduceat(li, starts) / n_tokens,
            log_ppl_train=-np.add.reduceat(lt, starts) / n_tokens,
            log_ratio=log_ratio,
            geo_ratio=np.exp(log_ratio / n_tokens),
            min_token_log_ratio=np.minimum.reduceat(terms.delta, starts),
            k3_sum=np.add.reduceat(terms.k3, starts),
            mult_error_sum=np.add.reduceat(terms.mult_error, starts),
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
    for open-ended edges and ``v == edges[-1]`` for closed ones."""
    return np.searchsorted(np.asarray(edges[1:-1]), values, side="right").astype(np.int16)


@dataclass
class _Moments:
    """Running co-moments for a streaming Pearson correlation (Chan et al. pairwise merge)."""

    n: int = 0
    mean_x: float = 0.0
    mean_y: float = 0.0
    m2x: float = 0.0
    m2y: float = 0.0
    cxy: float = 0.0

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        nb = len(x)
        if nb == 0:
            return
        mx, my = float(x.mean()), float(y.mean())
        dx, dy = x - mx, y - my
        m2x, m2y, cxy = float(dx @ dx), float(dy @ dy), float(dx @ dy)
        na, n = self.n, self.n + nb
        ddx, ddy = mx - self.mean_x, my - self.mean_y
        self.mean_x += ddx * nb / n
        self.mean_y += ddy * nb / n
        self.m2x += m2x + ddx * ddx * na * nb / n
        self.m2y += m2y + ddy * ddy * na * nb / n
        self.cxy += cxy + ddx * ddy * na * nb / n
        self.n = n

    def pearson(self) -> float | None:
        if self.n < 2 or self.m2x <= 0 or self.m2y <= 0:
            return None
        return self.cxy / math.sqrt(self.m2x * self.m2y)

    def relative_variance_x(self) -> float | None:
        """``mean((x - mean x)^2) / (mean x)^2`` = ``E[x^2] / E[x]^2 - 1``, from a sum of squares, so
        it is never negative (the difference form can round below 0)."""
        if self.n == 0 or self.mean_x == 0:
            return None
        return (self.m2x / self.n) / (self.mean_x * self.mean_x)


def self_normalized_chi2(weights: np.ndarray) -> float | None:
    """``E[w^2] / E[w]^2 - 1`` of importance weights: the chi-square divergence estimate that
    normalizes by the weights' own sample mean instead of assuming it is 1, so it is >= 0 by
    construction (it is ``1 / ESS - 1``)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0:
        return None
    mean = w.mean()
    if not mean > 0:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.mean((w - mean) ** 2) / (mean * mean))


def pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson correlation in float64; None for fewer than two points, a constant side, or non-finite values."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) < 2 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        return None
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / denom) if denom > 0 else None


def _share(count: int, total: int) -> float | None:
    return count / total if total else None


@dataclass
class MetricsAccumulator:
    """Streams shards of model tokens into the batch-level metrics (ARCHITECTURE.md, Metrics).

    Feed it chunks that never split a sequence (the table's shards hold whole sequences); the
    result equals one call over the concatenation. Per-token state kept for exact quantiles is
    float32 |delta| plus its p_infer bucket index (5 bytes a token).
    """

    thresholds: CorrectionThresholds = field(default_factory=CorrectionThresholds)

    def __post_init__(self) -> None:
        self._n = 0
        self._sums = {k: 0.0 for k in ("k1", "k2", "k3", "abs_delta", "prob_diff", "mult_error", "ratio", "ratio2")}
        self._prob_diff_max = -math.inf
        self._moments = _Moments()
        self._ratio_moments = _Moments()  # x = y = token ratio: its running variance (chi2_token_sn)
        self._counts = {"token_tis": 0, "token_mask": 0, "zero_prob_train": 0}
        self._abs_delta: list[np.ndarray] = []
        self._p_bucket: list[np.ndarray] = []
        n_pb, n_pos = len(P_INFER_BUCKET_EDGES) - 1, len(POSITION_BUCKET_EDGES)
        self._p_bucket_sums = {k: np.zeros(n_pb) for k in ("count", "abs_delta", "prob_diff", "k3")}
        self._pos_bucket_sums = {k: np.zeros(n_pos) for k in ("count", "abs_delta", "prob_diff", "k3")}
        self._pos_bucket_max = np.full(n_pos, -np.inf)
        self._seq: dict[str, list[np.ndarray]] = {k: [] for k in SequenceTerms._fields}

    def add(
        self,
        logp_train: np.ndarray,
        logp_infer: np.ndarray,
        starts: np.ndarray,
        positions: np.ndarray | None = None,
    ) -> None:
        """Add model tokens whose sequences begin at ``starts`` (indices into this chunk)."""
        check_logprobs(np.asarray(logp_train), np.asarray(logp_infer))
        n = len(logp_train)
        if n == 0:
            return
        t = token_terms(logp_train, logp_infer)
        th = self.thresholds
        self._n += n
        with np.errstate(invalid="ignore", over="ignore"):
            for key, arr in (
                ("k1", t.k1),
                ("k2", t.k2),
                ("k3", t.k3),
                ("abs_delta", t.abs_delta),
                ("prob_diff", t.prob_diff),
                ("mult_error", t.mult_error),
                ("ratio", t.ratio),
                ("ratio2", t.ratio * t.ratio),
            ):
                self._sums[key] += float(arr.sum())
        self._prob_diff_max = max(self._prob_diff_max, float(t.prob_diff.max()))
        self._moments.add(t.p_train, t.p_infer)
        self._ratio_moments.add(t.ratio, t.ratio)
        self._counts["token_tis"] += int((t.delta > math.log(th.token_tis)).sum())
        self._counts["token_mask"] += int(
            ((t.delta < math.log(th.token_mask_low)) | (t.delta > math.log(th.token_mask_high))).sum()
        )
        self._counts["zero_prob_train"] += int(np.isneginf(np.asarray(logp_train)).sum())

        self._abs_delta.append(t.abs_delta.astype(np.float32))
        p_bucket = bucket_index(t.p_infer, P_INFER_BUCKET_EDGES)
        self._p_bucket.append(p_bucket.astype(np.uint8))
        self._accumulate_buckets(self._p_bucket_sums, p_bucket, t)
        if positions is not None:
            pos_bucket = bucket_index(np.asarray(positions), POSITION_BUCKET_EDGES + (np.inf,))
            self._accumulate_buckets(self._pos_bucket_sums, pos_bucket, t)
            np.maximum.at(self._pos_bucket_max, pos_bucket, t.prob_diff)

        seq = sequence_terms(t, logp_train, logp_infer, np.asarray(starts, dtype=np.int64))
        for key, arr in seq._asdict().items():
            self._seq[key].append(arr)

    @property
    def n_tokens(self) -> int:
        return self._n

    @staticmethod
    def _accumulate_buckets(sums: dict, bucket: np.ndarray, t: TokenTerms) -> None:
        size = len(sums["count"])
        sums["count"] += np.bincount(bucket, minlength=size)
        with np.errstate(invalid="ignore"):
            sums["abs_delta"] += np.bincount(bucket, weights=t.abs_delta, minlength=size)
            sums["prob_diff"] += np.bincount(bucket, weights=t.prob_diff, minlength=size)
            sums["k3"] += np.bincount(bucket, weights=t.k3, minlength=size)

    def sequences(self) -> SequenceTerms:
        """Per-sequence terms (sample-turns in the per-turn groups), in the order they were added."""
        return SequenceTerms(**{k: (np.concatenate(v) if v else np.zeros(0)) for k, v in self._seq.items()})

    def metrics(self) -> dict:
        """Batch-level metrics under the canonical keys (ARCHITECTURE.md, Metrics) (plus a few extras)."""
        n = self._n
        seq = self.sequences()
        n_seq = len(seq.n_tokens)
        out: dict = {"n_model_tokens": n, "n_sequences": n_seq, "n_zero_prob_train": self._counts["zero_prob_train"]}
        if n == 0:
            for key in CANONICAL_KEYS + _EXTRA_KEYS:
                out.setdefault(key, None)
            out["seq_max_mismatch_gt_0_5_count"] = 0
            return out
        s = self._sums
        mean = {k: v / n for k, v in s.items()}
        abs_delta = np.concatenate(self._abs_delta)
        q = quantiles(abs_delta, QUANTILES)
        with np.errstate(over="ignore", invalid="ignore"):
            clamped = np.clip(seq.log_ratio, -SEQ_LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CLAMP)
            chi2_seq = float(np.mean(np.exp(2.0 * clamped)) - 1.0)
            chi2_seq_sn = self_normalized_chi2(np.exp(clamped))
            ess = (s["ratio"] ** 2) / (n * s["ratio2"]) if s["ratio2"] > 0 else None
            log_ppl_diff = seq.log_ppl_train - seq.log_ppl_infer
        gt = int((seq.max_mismatch > 0.5).sum())
        out.update(
            k3_kl=mean["k3"],
            k1_kl=mean["k1"],
            k2_kl=mean["k2"],
            abs_delta_mean=mean["abs_delta"],
            abs_delta_p50=q["p50"],
            abs_delta_p90=q["p90"],
            abs_delta_p99=q["p99"],
            abs_delta_max=float(abs_delta.max()),
            prob_diff_max=self._prob_diff_max,
            prob_diff_mean=mean["prob_diff"],
            mult_prob_error=mean["mult_error"],
            chi2_token=mean["ratio2"] - 1.0,
            chi2_seq=chi2_seq,
            chi2_token_sn=self._ratio_moments.relative_variance_x(),
            chi2_seq_sn=chi2_seq_sn,
            ess=ess,
            pearson_prob=self._moments.pearson(),
            log_ppl_infer=float(seq.log_ppl_infer.mean()),
            log_ppl_train=float(seq.log_ppl_train.mean()),
            log_ppl_diff_mean=float(log_ppl_diff.mean()),
            log_ppl_abs_diff_mean=float(np.abs(log_ppl_diff).mean()),
            pearson_log_ppl=pearson(seq.log_ppl_infer, seq.log_ppl_train),
            seq_max_mismatch_mean=float(seq.max_mismatch.mean()),
            seq_max_mismatch_gt_0_5_share=gt / n_seq,
            seq_max_mismatch_gt_0_5_count=gt,
            seq_mean_mismatch_mean=float(seq.mean_mismatch.mean()),
            seq_log_ratio_mean=float(seq.log_ratio.mean()),
            seq_geo_ratio_mean=float(seq.geo_ratio.mean()),
            seq_min_token_ratio_min=float(np.exp(seq.min_token_log_ratio.min())),
        )
        return out

    def corrections(self) -> dict:
        """Share of data each published correction would clip or drop, with its thresholds."""
        n = self._n
        seq = self.sequences()
        n_seq = len(seq.n_tokens)
        th = self.thresholds
        out: dict[str, Any] = {
            "token_tis_clipped_share": _share(self._counts["token_tis"], n),
            "token_mask_share": _share(self._counts["token_mask"], n),
        }
        if n_seq:
            with np.errstate(invalid="ignore"):
                geo_log = seq.log_ratio / seq.n_tokens
            out.update(
                seq_tis_clipped_share=float((seq.log_ratio > math.log(th.seq_tis)).mean()),
                seq_mis_masked_share=float((seq.log_ratio > math.log(th.seq_mis)).mean()),
                geo_rejected_share=float(
                    ((geo_log < math.log1p(-th.geo_eps)) | (geo_log > math.log1p(th.geo_eps))).mean()
                ),
                worst_token_rejected_share=float((seq.min_token_log_ratio < math.log(th.worst_token_tau)).mean()),
            )
        else:
            out.update({k: None for k in CORRECTION_KEYS[2:]})
        out["thresholds"] = th.as_record()
        return out

    def breakdowns(self) -> dict:
        """Tables the report draws: by p_infer bucket, by token position, by response length."""
        return {
            "p_infer_buckets": self._p_infer_table(),
            "position_buckets": self._position_table(),
            "response_length_buckets": self._length_table(),
        }

    def _p_infer_table(self) -> list[dict]:
        if not self._n:
            return []
        abs_delta = np.concatenate(self._abs_delta)
        bucket = np.concatenate(self._p_bucket)
        sums = self._p_bucket_sums
        rows = []
        order = np.argsort(bucket, kind="stable")
        bounds = np.searchsorted(bucket[order], np.arange(len(P_INFER_BUCKET_EDGES)))
        for i in range(len(P_INFER_BUCKET_EDGES) - 1):
            count = int(sums["count"][i])
            row: dict[str, Any] = {
                "p_infer_lo": P_INFER_BUCKET_EDGES[i],
                "p_infer_hi": P_INFER_BUCKET_EDGES[i + 1],
                "count": count,
                "share": count / self._n,
            }
            if count:
                values = abs_delta[order[bounds[i] : bounds[i + 1]]]
                row.update(
                    abs_delta_mean=float(sums["abs_delta"][i] / count),
                    **{f"abs_delta_{k}": v for k, v in quantiles(values, QUANTILES).items()},
                    abs_delta_max=float(values.max()),
                    prob_diff_mean=float(sums["prob_diff"][i] / count),
                    k3_mean=float(sums["k3"][i] / count),
                )
            rows.append(row)
        return rows

    def _position_table(self) -> list[dict]:
        sums = self._pos_bucket_sums
        edges = POSITION_BUCKET_EDGES + (None,)
        rows = []
        for i in range(len(POSITION_BUCKET_EDGES)):
            count = int(sums["count"][i])
            if not count:
                continue
            rows.append(
                {
                    "position_lo": edges[i],
                    "position_hi": edges[i + 1],
                    "count": count,
                    "abs_delta_mean": float(sums["abs_delta"][i] / count),
                    "prob_diff_mean": float(sums["prob_diff"][i] / count),
                    "prob_diff_max": float(self._pos_bucket_max[i]),
                    "k3_mean": float(sums["k3"][i] / count),
                }
            )
        return rows

    def _length_table(self) -> list[dict]:
        seq = self.sequences()
        if not len(seq.n_tokens):
            return []
        edges = LENGTH_BUCKET_EDGES + (None,)
        bucket = bucket_index(seq.n_tokens, LENGTH_BUCKET_EDGES + (np.inf,))
        rows = []
        for i in range(len(LENGTH_BUCKET_EDGES)):
            sel = bucket == i
            count = int(sel.sum())
            if not count:
                continue
            rows.append(
                {
                    "length_lo": edges[i],
                    "length_hi": edges[i + 1],
                    "count": count,
                    "seq_max_mismatch_mean": float(seq.max_mismatch[sel].mean()),
                    "seq_max_mismatch_gt_0_5_share": float((seq.max_mismatch[sel] > 0.5).mean()),
                    "seq_mean_mismatch_mean": float(seq.mean_mismatch[sel].mean()),
                    "seq_abs_log_ratio_mean": float(np.abs(seq.log_ratio[sel]).mean()),
                }
            )
        return rows


_EXTRA_KEYS = (
    "k2_kl",
    "abs_delta_p50",
    "abs_delta_p90",
    "abs_delta_max",
    "log_ppl_diff_mean",
    "log_ppl_abs_diff_mean",
    "seq_mean_mismatch_mean",
    "seq_log_ratio_mean",
    "seq_geo_ratio_mean",
    "seq_min_token_ratio_min",
    "pearson_log_ppl",
    "chi2_token_sn",
    "chi2_seq_sn",
)


def _expert_bits(ids: np.ndarray, word: int) -> np.ndarray:
    """The ids in [64 * word, 64 * word + 64) of each top-k set, as one uint64 bitmask per set."""
    rel = ids.astype(np.int64) - 64 * word
    inside = (rel >= 0) & (rel < 64)
    bits = np.left_shift(np.uint64(1), np.clip(rel, 0, 63).astype(np.uint64))
    return np.bitwise_or.reduce(np.where(inside, bits, np.uint64(0)), axis=-1)


def shared_experts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|A & B|`` for every pair of top-k expert sets (last axis), via bitmasks and popcount."""
    if a.size == 0:
        return np.zeros(a.shape[:-1], dtype=np.int64)
    words = (int(max(a.max(), b.max())) + 64) // 64
    out = np.zeros(a.shape[:-1], dtype=np.int64)
    for w in range(words):
        out += np.bitwise_count(_expert_bits(a, w) & _expert_bits(b, w))
    return out


class RoutingComparison(NamedTuple):
    same: np.ndarray  # bool [tokens, layers]: the same expert set on both sides
    shared: np.ndarray  # int [tokens, layers]: experts in common


def compare_routing(
    experts_infer: np.ndarray, experts_train: np.ndarray, n_layers: int, top_k: int
) -> RoutingComparison:
    """Per token and layer: same expert set?, and how many experts in common (sorted ids in)."""
    shape = (len(experts_infer), n_layers, top_k)
    ei, et = np.asarray(experts_infer).reshape(shape), np.asarray(experts_train).reshape(shape)
    same = (ei == et).all(axis=-1)
    shared = np.full(same.shape, top_k, dtype=np.int64)
    differ = ~same  # usually a few percent of rows: only those need the set intersection
    if differ.any():
        shared[differ] = shared_experts(ei[differ], et[differ])
    return RoutingComparison(same, shared)


@dataclass
class RoutingAccumulator:
    """Per-layer agreement of the top-k expert sets behind each model token, engine vs reference.

    Fed per-token comparisons (:func:`compare_routing`). A token "flips" when any layer sends it
    to a different set of experts; the result splits the mismatch between flipped and agreeing
    tokens, which is where MoE mismatch usually hides.
    """

    n_layers: int
    top_k: int

    def __post_init__(self) -> None:
        self._n = 0
        self._same = np.zeros(self.n_layers, dtype=np.int64)
        self._overlap = np.zeros(self.n_layers, dtype=np.int64)
        self._differing_hist = np.zeros(self.n_layers + 1, dtype=np.int64)
        self._groups = {
            g: {"n": 0, "abs_delta": 0.0, "prob_diff": 0.0, "k3": 0.0, "prob_diff_max": -math.inf}
            for g in ("flipped", "agreed")
        }

    def add(self, comparison: RoutingComparison, logp_train: np.ndarray, logp_infer: np.ndarray) -> None:
        n = len(logp_train)
        if n == 0:
            return
        same, shared = comparison
        self._n += n
        self._same += same.sum(axis=0)
        self._overlap += shared.sum(axis=0)
        self._differing_hist += np.bincount(self.n_layers - same.sum(axis=-1), minlength=self.n_layers + 1)
        t = token_terms(logp_train, logp_infer)
        flipped = ~same.all(axis=-1)
        with np.errstate(invalid="ignore", over="ignore"):
            for name, sel in (("flipped", flipped), ("agreed", ~flipped)):
                g = self._groups[name]
                if sel.any():
                    g["n"] += int(sel.sum())
                    g["abs_delta"] += float(t.abs_delta[sel].sum())
                    g["prob_diff"] += float(t.prob_diff[sel].sum())
                    g["k3"] += float(t.k3[sel].sum())
                    g["prob_diff_max"] = max(g["prob_diff_max"], float(t.prob_diff[sel].max()))

    def result(self, moe_layers: list[int] | None = None) -> dict:
        n = self._n
        groups: dict[str, dict[str, Any]] = {}
        for name, g in self._groups.items():
            groups[name] = {"n_tokens": g["n"]} | (
                {
                    "abs_delta_mean": g["abs_delta"] / g["n"],
                    "prob_diff_mean": g["prob_diff"] / g["n"],
                    "prob_diff_max": g["prob_diff_max"],
                    "k3_mean": g["k3"] / g["n"],
                }
                if g["n"]
                else {"abs_delta_mean": None, "prob_diff_mean": None, "prob_diff_max": None, "k3_mean": None}
            )
        return {
            "moe_layers": list(moe_layers) if moe_layers is not None else list(range(self.n_layers)),
            "top_k": self.top_k,
            "n_tokens": n,
            "set_agreement_by_layer": (self._same / n).tolist() if n else None,
            "overlap_by_layer": (self._overlap / (n * self.top_k)).tolist() if n else None,
            "set_agreement_mean": float((self._same / n).mean()) if n else None,
            "tokens_with_flip_share": groups["flipped"]["n_tokens"] / n if n else None,
            "layers_differing_histogram": self._differing_hist.tolist(),
            "flipped": groups["flipped"],
            "agreed": groups["agreed"],
        }


def compute_metrics(
    logp_train: np.ndarray,
    logp_infer: np.ndarray,
    starts: np.ndarray,
    thresholds: CorrectionThresholds | None = None,
) -> tuple[dict, dict]:
    """One-shot form: (metrics, corrections) for model tokens whose sequences begin at ``starts``."""
    acc = MetricsAccumulator(thresholds or CorrectionThresholds())
    acc.add(logp_train, logp_infer, starts)
    return acc.metrics(), acc.corrections()


__all__ = [
    "CANONICAL_KEYS",
    "CORRECTION_KEYS",
    "CorrectionThresholds",
    "MetricsAccumulator",
    "RoutingAccumulator",
    "RoutingComparison",
    "SequenceTerms",
    "TokenTerms",
    "check_logprobs",
    "compare_routing",
    "compute_metrics",
    "quantiles",
    "segment_starts",
    "self_normalized_chi2",
    "sequence_terms",
    "shared_experts",
    "token_terms",
]

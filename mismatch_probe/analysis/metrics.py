"""Mismatch metrics (ARCHITECTURE.md, Metrics): the batch metrics and correction what-ifs of a run,
reduced in one streaming pass (:class:`MetricsAccumulator`) from the token and sequence terms of
:mod:`mismatch_probe.analysis.terms`. MoE routing agreement is :mod:`.routing_agreement`, the
routing replay (R3) what-if :mod:`.routing_replay`.

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
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from mismatch_probe.analysis.kernels import (
    CELL_COUNTS,
    CELL_SUMS,
    FIRST_PEER_MOM,
    MOMENTS,
    PEER_MAX,
    PEER_MIN,
    PEER_SUMS,
    SEGMENT_SUMS,
    TABLE_ROWS,
    Loops,
    compiled,
    shard_loop,
)
from mismatch_probe.analysis.order_stats import BINS as ORDER_BINS
from mismatch_probe.analysis.order_stats import HI as ORDER_HI
from mismatch_probe.analysis.order_stats import float32_bits, needed_ranks, order_statistics, quantiles_from_bits
from mismatch_probe.analysis.peer_metrics import (
    LOG4,
    SAFETY_BOUND,
    SEQUENCE_SUMS,
    TOKEN_M2,
    TOKEN_MAX,
    TOKEN_MIN,
    TOKEN_SUMS,
    PeerPart,
    sequence_values,
)
from mismatch_probe.analysis.terms import (
    SequenceTerms,
    ShardTerms,
    TokenTerms,
    bucket_index,
    check_logprobs,
    quantiles,
    sequence_terms,
    sequence_terms_from_sums,
    token_terms,
)
from mismatch_probe.config.spec import CorrectionThresholds

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
# the K3 of what each correction keeps: the tokens a token correction leaves unclipped or unmasked,
# the tokens of the sequences a sequence correction leaves whole. "Does the correction rescue this
# precision?": is that K3 back near a bf16 run's, at what share of the data?
KEPT_K3 = {
    "token_tis_clipped_share": "token_tis_kept_k3",
    "token_mask_share": "token_mask_kept_k3",
    "seq_tis_clipped_share": "seq_tis_kept_k3",
    "seq_mis_masked_share": "seq_mis_kept_k3",
    "geo_rejected_share": "geo_kept_k3",
    "worst_token_rejected_share": "worst_token_kept_k3",
}


@dataclass
class Moments:
    """Co-moments of a set of (x, y) pairs, merged across sets without loss (Chan et al.): a streaming
    Pearson correlation, and with x = y a streaming variance."""

    n: int = 0
    mean_x: float = 0.0
    mean_y: float = 0.0
    m2x: float = 0.0
    m2y: float = 0.0
    cxy: float = 0.0

    @classmethod
    def of(cls, x: np.ndarray, y: np.ndarray) -> Moments:
        if len(x) == 0:
            return cls()
        mx, my = float(x.mean()), float(y.mean())
        dx, dy = x - mx, y - my
        return cls(len(x), mx, my, float(dx @ dx), float(dy @ dy), float(dx @ dy))

    def merge(self, other: Moments) -> None:
        nb = other.n
        if nb == 0:
            return
        if self.n == 0:  # exact, so merging one part changes nothing
            self.n, self.mean_x, self.mean_y = other.n, other.mean_x, other.mean_y
            self.m2x, self.m2y, self.cxy = other.m2x, other.m2y, other.cxy
            return
        na, n = self.n, self.n + nb
        ddx, ddy = other.mean_x - self.mean_x, other.mean_y - self.mean_y
        self.mean_x += ddx * nb / n
        self.mean_y += ddy * nb / n
        self.m2x += other.m2x + ddx * ddx * na * nb / n
        self.m2y += other.m2y + ddy * ddy * na * nb / n
        self.cxy += other.cxy + ddx * ddy * na * nb / n
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


def _mean_k3(total: float, n: int) -> float | None:
    """Mean K3 of ``n`` kept tokens; None when a correction keeps nothing."""
    return total / n if n else None


# k3_kept_*: K3 summed over the tokens token TIS leaves unclipped / token MIS leaves unmasked (what
# each keeps as it came), so the K3 of what a correction keeps merges across shards like any sum
SUM_KEYS = (
    "k1",
    "k2",
    "k3",
    "abs_delta",
    "prob_diff",
    "mult_error",
    "ratio",
    "ratio2",
    "k3_kept_token_tis",
    "k3_kept_token_mask",
)
COUNT_KEYS = ("token_tis", "token_mask", "zero_prob_train")
BUCKET_KEYS = ("count", "abs_delta", "prob_diff", "k3")  # rows of the p_infer and position tables
N_P_BUCKETS = len(P_INFER_BUCKET_EDGES) - 1
N_POS_BUCKETS = len(POSITION_BUCKET_EDGES)


@dataclass
class TokenStats:
    """Everything the batch metrics need from a set of model tokens, except the |delta| quantiles
    (order statistics, kept apart) and the per-sequence terms: sums, counts, maxima and co-moments,
    all of which merge exactly across sets (sums up to the order of summation)."""

    n: int = 0
    sums: np.ndarray = field(default_factory=lambda: np.zeros(len(SUM_KEYS)))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(len(COUNT_KEYS), dtype=np.int64))
    prob_diff_max: float = -math.inf
    prob: Moments = field(default_factory=Moments)  # x = p_train, y = p_infer
    ratio: Moments = field(default_factory=Moments)  # x = y = the token ratio (chi2_token_sn)
    p_buckets: np.ndarray = field(default_factory=lambda: np.zeros((len(BUCKET_KEYS), N_P_BUCKETS)))
    pos_buckets: np.ndarray = field(default_factory=lambda: np.zeros((len(BUCKET_KEYS), N_POS_BUCKETS)))
    pos_max: np.ndarray = field(default_factory=lambda: np.full(N_POS_BUCKETS, -np.inf))

    def merge(self, other: TokenStats) -> None:
        self.n += other.n
        with np.errstate(invalid="ignore"):
            self.sums += other.sums
            self.p_buckets += other.p_buckets
            self.pos_buckets += other.pos_buckets
        self.counts += other.counts
        self.prob_diff_max = max(self.prob_diff_max, other.prob_diff_max)
        self.prob.merge(other.prob)
        self.ratio.merge(other.ratio)
        np.maximum(self.pos_max, other.pos_max, out=self.pos_max)

    @classmethod
    def merged(cls, parts: list[TokenStats]) -> TokenStats:
        out = cls()
        for part in parts:
            out.merge(part)
        return out

    def sum(self, key: str) -> float:
        return float(self.sums[SUM_KEYS.index(key)])

    def count(self, key: str) -> int:
        return int(self.counts[COUNT_KEYS.index(key)])


def _token_masks(t: TokenTerms, logp_train: np.ndarray, th: CorrectionThresholds) -> list[np.ndarray]:
    """Per token, in COUNT_KEYS order: clipped by token TIS, masked by token MIS, p_train = 0."""
    return [
        t.delta > math.log(th.token_tis),
        (t.delta < math.log(th.token_mask_low)) | (t.delta > math.log(th.token_mask_high)),
        np.isneginf(logp_train),
    ]


def cell_stats(
    t: TokenTerms,
    logp_train: np.ndarray,
    seg_starts: np.ndarray,
    seg_cell: np.ndarray,
    n_cells: int,
    p_bucket: np.ndarray,
    pos_bucket: np.ndarray | None,
    thresholds: CorrectionThresholds,
) -> list[TokenStats]:
    """:class:`TokenStats` of each cell of one shard, in one vectorized pass: tokens come in segments
    (``seg_starts``; a sequence, or the part of it in one turn) and segment ``i`` belongs to cell
    ``seg_cell[i]``. Each token sum is reduced per segment (``reduceat``, contiguous) and then per
    cell, so no cell's tokens are ever copied out; a shard of one cell (one turn) sums directly."""
    n = len(t.delta)
    seg_len = np.diff(np.append(seg_starts, n))
    tok_cell = np.repeat(seg_cell, seg_len) if n_cells > 1 else None
    stats = [TokenStats() for _ in range(n_cells)]
    with np.errstate(invalid="ignore", over="ignore"):
        masks = _token_masks(t, logp_train, thresholds)
        # np.where, not k3 * ~mask: a p_train = 0 token has K3 = inf, and inf * 0 is NaN
        kept = [np.where(m, 0.0, t.k3) for m in masks[:2]]
        tokens = (t.k1, t.k2, t.k3, t.abs_delta, t.prob_diff, t.mult_error, t.ratio, t.ratio * t.ratio, *kept)
        if tok_cell is None:
            s = stats[0]
            s.n = n
            s.sums[:] = [a.sum() for a in tokens]
            s.counts[:] = [int(m.sum()) for m in masks]
            s.prob_diff_max = float(t.prob_diff.max())
            s.prob = Moments.of(t.p_train, t.p_infer)
            s.ratio = Moments.of(t.ratio, t.ratio)
        else:
            n_cell = np.bincount(seg_cell, weights=seg_len, minlength=n_cells).astype(np.int64)

            def by_cell(arr: np.ndarray, dtype=None) -> np.ndarray:
                return np.bincount(seg_cell, weights=np.add.reduceat(arr, seg_starts, dtype=dtype), minlength=n_cells)

            sums = np.stack([by_cell(a) for a in tokens], axis=1)
            counts = np.stack([by_cell(m, np.int64) for m in masks], axis=1).round().astype(np.int64)
            prob_max = np.full(n_cells, -np.inf)
            np.maximum.at(prob_max, seg_cell, np.maximum.reduceat(t.prob_diff, seg_starts))
            # co-moments about each cell's own mean, as a one-cell shard computes them
            mean_x, mean_y, mean_r = by_cell(t.p_train) / n_cell, by_cell(t.p_infer) / n_cell, sums[:, 6] / n_cell
            # each token's cell mean, repeated per segment (a few thousand) rather than gathered per token
            dx, dy, dr = (
                a - np.repeat(m[seg_cell], seg_len)
                for a, m in ((t.p_train, mean_x), (t.p_infer, mean_y), (t.ratio, mean_r))
            )
            m2x, m2y, cxy, m2r = by_cell(dx * dx), by_cell(dy * dy), by_cell(dx * dy), by_cell(dr * dr)
            for c, s in enumerate(stats):
                s.n, s.sums[:], s.counts[:], s.prob_diff_max = int(n_cell[c]), sums[c], counts[c], float(prob_max[c])
                s.prob = Moments(s.n, float(mean_x[c]), float(mean_y[c]), float(m2x[c]), float(m2y[c]), float(cxy[c]))
                s.ratio = Moments(s.n, float(mean_r[c]), float(mean_r[c]), float(m2r[c]), float(m2r[c]), float(m2r[c]))
        table = _p_bucket_table(t, p_bucket, tok_cell, n_cells)
        for c, s in enumerate(stats):
            s.p_buckets = table[:, c]
        if pos_bucket is not None:
            table, top = _position_table(t, pos_bucket, seg_starts, tok_cell, n_cells)
            for c, s in enumerate(stats):
                s.pos_buckets, s.pos_max = table[:, c], top[c]
    return stats


def _p_bucket_table(t: TokenTerms, bucket: np.ndarray, tok_cell: np.ndarray | None, n_cells: int) -> np.ndarray:
    """[BUCKET_KEYS, cell, p_infer bucket] sums: one bincount per row over cell x bucket."""
    key = bucket if tok_cell is None else tok_cell * N_P_BUCKETS + bucket
    size = n_cells * N_P_BUCKETS
    rows = [np.bincount(key, minlength=size)]
    rows += [np.bincount(key, weights=a, minlength=size) for a in (t.abs_delta, t.prob_diff, t.k3)]
    return np.stack(rows).reshape(len(BUCKET_KEYS), n_cells, N_P_BUCKETS)


def _position_table(
    t: TokenTerms, bucket: np.ndarray, seg_starts: np.ndarray, tok_cell: np.ndarray | None, n_cells: int
) -> tuple[np.ndarray, np.ndarray]:
    """[BUCKET_KEYS, cell, position bucket] sums and [cell, bucket] max |delta p|. Positions rise
    within a segment, so it crosses each bucket edge once: the tokens are reduced per run of one
    (segment, bucket), a few runs a sequence, and only the runs are binned."""
    n = len(bucket)
    change = np.empty(n, dtype=bool)
    change[0] = True
    np.not_equal(bucket[1:], bucket[:-1], out=change[1:])
    change[seg_starts] = True
    runs = np.flatnonzero(change)
    key = bucket[runs].astype(np.int64)
    if tok_cell is not None:
        key += tok_cell[runs] * N_POS_BUCKETS
    size = n_cells * N_POS_BUCKETS
    rows = [np.bincount(key, weights=np.diff(np.append(runs, n)), minlength=size)]
    rows += [
        np.bincount(key, weights=np.add.reduceat(a, runs), minlength=size) for a in (t.abs_delta, t.prob_diff, t.k3)
    ]
    top = np.full(size, -np.inf)
    np.maximum.at(top, key, np.maximum.reduceat(t.prob_diff, runs))
    return np.stack(rows).reshape(len(BUCKET_KEYS), n_cells, N_POS_BUCKETS), top.reshape(n_cells, N_POS_BUCKETS)


# groups of MetricsAccumulator: every token, the first assistant turn, the later ones, or one turn index
Group = str | int
GROUP_TURNS = {"first": lambda t: t == 0, "later": lambda t: t >= 1}


@dataclass
class MetricsAccumulator:
    """Streams shards of model tokens into the batch-level metrics (ARCHITECTURE.md, Metrics), for
    every token (group ``"all"``, whose sequences are the ``starts`` given) and, when ``turn`` is
    given, per turn: ``"first"`` (turn 0), ``"later"`` (turns >= 1) and each turn index ``t``, whose
    sequences are the parts of a sequence in one turn (a sample's turns come in order).

    Feed it chunks that never split a sequence (the table's shards hold whole sequences); the
    result equals one call over the concatenation (sums up to the order of summation). One pass
    per chunk serves every group: per-turn statistics (:func:`cell_stats`, or :func:`shard_pass`,
    the compiled loop of analysis/kernels.py, which also computes the peer metrics' share) merged
    per group. The per-token state kept for exact |delta| quantiles is float32 |delta|, its p_infer
    bucket and its turn when the chunk has several (5-7 bytes a token), selected exactly at the end
    (:mod:`.order_stats`).
    """

    thresholds: CorrectionThresholds = field(default_factory=CorrectionThresholds)
    # select each p_infer bucket's |delta| quantiles with the groups' (the run report's bucket table
    # reads them). False: only when a bucket's are asked for (a timeline step's row reads the
    # groups' alone: 3 histogram cells instead of 27)
    bucket_quantiles: bool = True

    def __post_init__(self) -> None:
        self._n = 0
        self._cells: dict[int, TokenStats] = {}  # by turn (0 when no turns are given)
        self._abs_delta: list[np.ndarray] = []  # float32 |delta| as its bit pattern (float32_bits), per chunk
        self._p_bucket: list[np.ndarray] = []
        self._turn: list[np.ndarray | int] = []  # per token, or the one turn of the chunk
        self._seq: list[SequenceTerms] = []
        self._seg_seq: list[SequenceTerms] = []
        self._seg_turn: list[np.ndarray] = []
        self._order_stats: dict | None = None  # (group, bucket) -> {rank: value}, until the next add

    def add(
        self,
        logp_train: np.ndarray,
        logp_infer: np.ndarray,
        starts: np.ndarray,
        positions: np.ndarray | None = None,
        turn: np.ndarray | None = None,
    ) -> ShardTerms | None:
        """Add model tokens whose sequences begin at ``starts`` (indices into this chunk); ``turn``:
        each token's assistant turn (None: all turn 0). Returns the shard's token and sequence terms
        (None for an empty chunk)."""
        lt_in, li_in = np.asarray(logp_train), np.asarray(logp_infer)
        n = len(lt_in)
        loops = compiled(n) if n and lt_in.shape == li_in.shape else None
        if loops is None:
            check_logprobs(lt_in, li_in)
        if n == 0:
            return None
        starts = np.asarray(starts, dtype=np.int64)
        if turn is None:
            segments, seg_turn = starts, np.zeros(len(starts), dtype=np.int16)
        else:
            turn = np.asarray(turn)
            if turn.shape != lt_in.shape:
                raise ValueError(f"{len(turn)} turns for {n} tokens")
            if turn.min() < _TURN_MIN or turn.max() >= _TURN_MIN + _TURN_RANGE:
                raise ValueError(
                    f"turn indices must fit int16 (the table's turn column), got {turn.min()}..{turn.max()}"
                )
            change = np.zeros(n, dtype=bool)
            change[starts] = True
            change[1:] |= turn[1:] != turn[:-1]
            segments = np.flatnonzero(change)
            seg_turn = turn[segments]
        turns, seg_cell = np.unique(seg_turn, return_inverse=True)
        if loops is not None:
            done = shard_pass(loops, lt_in, li_in, starts, segments, seg_cell, len(turns), positions, self.thresholds)
            if done is None:
                check_logprobs(lt_in, li_in)  # raises: the loop saw a value the contract refuses
                raise AssertionError("the compiled pass refused log-probs check_logprobs accepts")
            parts, seq, seg_seq = done.cells, done.sequences, done.segments
            abs_delta_bits, p_bucket = done.abs_delta_bits, done.p_bucket
            shard = ShardTerms(lt_in, li_in, seq, segments, seg_turn, peers=done.peers)
        else:
            lt, li = lt_in.astype(np.float64, copy=False), li_in.astype(np.float64, copy=False)
            t = token_terms(lt, li)
            seq = sequence_terms(t, lt, li, starts)
            seg_seq = seq if len(segments) == len(starts) else sequence_terms(t, lt, li, segments)
            p_bucket = bucket_index(t.p_infer, P_INFER_BUCKET_EDGES)
            pos_bucket = None if positions is None else bucket_index(positions, POSITION_BUCKET_EDGES + (np.inf,))
            parts = cell_stats(t, lt, segments, seg_cell, len(turns), p_bucket, pos_bucket, self.thresholds)
            abs_delta_bits = float32_bits(t.abs_delta)
            shard = ShardTerms(lt, li, seq, segments, seg_turn, known_terms=t)
        for value, part in zip(turns.tolist(), parts):
            self._cells.setdefault(value, TokenStats()).merge(part)
        self._n += n
        self._abs_delta.append(abs_delta_bits)
        self._p_bucket.append(p_bucket)
        # a shard of one turn (most are: single-turn runs) keeps the turn, not a copy per token
        self._turn.append(int(turns[0]) if turn is None or len(turns) == 1 else turn.astype(np.int16))
        self._seq.append(seq)
        self._seg_seq.append(seg_seq)
        self._seg_turn.append(seg_turn)
        self._order_stats = None
        return shard

    @property
    def n_tokens(self) -> int:
        return self._n

    @property
    def turns(self) -> list[int]:
        """The turn indices seen, in order."""
        return sorted(self._cells)

    def _turns_of(self, group: Group) -> list[int]:
        if group == "all":
            return self.turns
        if isinstance(group, str):
            if group not in GROUP_TURNS:
                raise ValueError(f"unknown group {group!r}: all, first, later or a turn index")
            return [t for t in self.turns if GROUP_TURNS[group](t)]
        return [group] if group in self._cells else []

    def stats(self, group: Group = "all") -> TokenStats:
        return TokenStats.merged([self._cells[t] for t in self._turns_of(group)])

    def sequences(self, group: Group = "all") -> SequenceTerms:
        """Per-sequence terms, in the order they were added: sequences in ``"all"``, their parts in one
        turn (sample-turns) in the turn groups."""
        if group == "all":
            parts = self._seq
        else:
            wanted = np.asarray(self._turns_of(group), dtype=np.int64)
            keeps = [np.isin(turns, wanted) for turns in self._seg_turn]
            parts = [SequenceTerms(*(a[keep] for a in seq)) for seq, keep in zip(self._seg_seq, keeps)]
        return (
            SequenceTerms(*(np.concatenate(v) if v else np.zeros(0) for v in zip(*parts))) if parts else _NO_SEQUENCES
        )

    # --- |delta| order statistics -------------------------------------------------------------

    def _order_statistics(self) -> dict:
        """``{(group, bucket): {rank: |delta|}}``: the order statistics behind every group's quantiles
        and maximum (bucket: a p_infer bucket, or None for the whole group), selected exactly from
        the stored float32 |delta| (:func:`.order_stats.order_statistics`, two passes over it).

        A token's cell is its turn class (before the first turn, first, later) and p_infer bucket,
        which serves "all", "first", "later" and any turn index alone in its class. Turn indices
        that share a class (turns 1, 2, ... of multi-turn runs) take passes of their own, cells by
        turn index, 64 at a time, so the histograms stay small whatever the number of turns."""
        if self._order_stats is None:
            turns = self.turns
            klass = {t: 0 if t < 0 else 1 if t == 0 else 2 for t in turns}
            alone = [t for t in turns if list(klass.values()).count(klass[t]) == 1]
            requests = []
            groups: list[Group] = ["all", "first", "later", *alone]
            for group in groups:
                classes = sorted({klass[t] for t in self._turns_of(group)})
                requests += self._requests(group, classes, buckets=isinstance(group, str))
            found = self._select(requests, klass, 3, by_bucket=self.bucket_quantiles)
            shared = [t for t in turns if t not in alone]
            for lo in range(0, len(shared), _TURNS_PER_PASS):
                batch = shared[lo : lo + _TURNS_PER_PASS]
                requests = [((t, None), [i], self._cells[t].n) for i, t in enumerate(batch)]
                found |= self._select(requests, {t: i for i, t in enumerate(batch)}, len(batch), by_bucket=False)
            self._order_stats = found
        return self._order_stats

    def _requests(self, group: Group, classes: list[int], buckets: bool) -> list[_Request]:
        """(key, cells, size) of a group whose turns fall in ``classes``: the whole group and, with
        ``buckets`` and :attr:`bucket_quantiles`, each of its p_infer buckets (cell = class * buckets
        + bucket; without them, cell = class)."""
        counts = self._bucket_counts(group)
        if not self.bucket_quantiles:
            return [((group, None), classes, int(counts.sum()))]
        out: list[_Request] = [
            ((group, None), [c * N_P_BUCKETS + b for c in classes for b in range(N_P_BUCKETS)], int(counts.sum()))
        ]
        if buckets:
            out += [((group, b), [c * N_P_BUCKETS + b for c in classes], int(counts[b])) for b in range(N_P_BUCKETS)]
        return out

    def _bucket_counts(self, group: Group) -> np.ndarray:
        """Tokens of a group per p_infer bucket."""
        return sum((self._cells[t].p_buckets[0] for t in self._turns_of(group)), np.zeros(N_P_BUCKETS))

    def _bucket_requests(self, group: Group) -> list[_Request]:
        """A group's p_infer buckets, asked for apart (:meth:`_quantiles`): its turns as one class."""
        counts = self._bucket_counts(group)
        return [((group, b), [b], int(counts[b])) for b in range(N_P_BUCKETS)]

    def _select(self, requests: list, cell_of_turn: dict[int, int], n_turn_cells: int, by_bucket: bool = True) -> dict:
        """Run the requests ((key, cells, size)) in one :func:`.order_stats.order_statistics` call;
        a token's cell is ``cell_of_turn[turn]`` (times the buckets, plus its bucket, ``by_bucket``)."""
        requests = [r for r in requests if r[2]]
        lut = np.full(_TURN_RANGE, -1, dtype=np.int64)  # the table's turn is int16: a lookup over its range
        for t, c in cell_of_turn.items():
            lut[t - _TURN_MIN] = c
        width = N_P_BUCKETS if by_bucket else 1
        loops = compiled(sum(len(a) for a in self._abs_delta))  # bit for bit either way

        def chunks():
            for abs_delta, bucket, turn in zip(self._abs_delta, self._p_bucket, self._turn):
                if isinstance(turn, int):  # a shard of one turn: its one cell, or none
                    c = int(lut[turn - _TURN_MIN])
                    if c < 0 or not by_bucket:
                        yield abs_delta, np.full(len(abs_delta), c)
                    else:
                        yield abs_delta, bucket.astype(np.int64) + c * width
                    continue
                if loops is not None:  # one loop, not a temporary per step
                    yield abs_delta, loops.cells(turn, bucket, lut, _TURN_MIN, width)
                    continue
                cell = lut[turn.astype(np.int64) - _TURN_MIN]
                yield abs_delta, (np.where(cell >= 0, cell * width + bucket, -1) if by_bucket else cell)

        ranks = [needed_ranks(size, QUANTILES) for _, _, size in requests]
        found = order_statistics(
            chunks, n_turn_cells * width, [cells for _, cells, _ in requests], ranks, n_values=self._n
        )
        return {
            key: dict(zip(r, bits.view(np.float32).astype(np.float64).tolist()))
            for (key, _, _), r, bits in zip(requests, ranks, found)
        }

    def _quantiles(self, group: Group, bucket: int | None, n: int) -> tuple[dict[str, float | None], float | None]:
        """|delta| quantiles (QUANTILES) and maximum of a group (and p_infer bucket)."""
        if n == 0:
            return quantiles(np.zeros(0), QUANTILES), None
        found = self._order_statistics()
        if (group, bucket) not in found:  # a turn index's (or, without bucket_quantiles, any group's) buckets
            found |= self._select(self._bucket_requests(group), dict.fromkeys(self._turns_of(group), 0), 1)
        stats = found[(group, bucket)]
        return quantiles_from_bits(n, QUANTILES, stats), stats[n - 1]

    # --- results ------------------------------------------------------------------------------

    def metrics(self, group: Group = "all") -> dict:
        """Batch-level metrics under the canonical keys (ARCHITECTURE.md, Metrics) (plus a few extras)."""
        st = self.stats(group)
        n = st.n
        seq = self.sequences(group)
        n_seq = len(seq.n_tokens)
        out: dict = {"n_model_tokens": n, "n_sequences": n_seq, "n_zero_prob_train": st.count("zero_prob_train")}
        if n == 0:
            for key in CANONICAL_KEYS + _EXTRA_KEYS:
                out.setdefault(key, None)
            out["seq_max_mismatch_gt_0_5_count"] = 0
            return out
        mean = {k: st.sum(k) / n for k in SUM_KEYS}
        q, abs_delta_max = self._quantiles(group, None, n)
        with np.errstate(over="ignore", invalid="ignore"):
            clamped = np.clip(seq.log_ratio, -SEQ_LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CLAMP)
            chi2_seq = float(np.mean(np.exp(2.0 * clamped)) - 1.0)
            chi2_seq_sn = self_normalized_chi2(np.exp(clamped))
            ratio2 = st.sum("ratio2")
            ess = (st.sum("ratio") ** 2) / (n * ratio2) if ratio2 > 0 else None
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
            abs_delta_max=abs_delta_max,
            prob_diff_max=st.prob_diff_max,
            prob_diff_mean=mean["prob_diff"],
            mult_prob_error=mean["mult_error"],
            chi2_token=mean["ratio2"] - 1.0,
            chi2_seq=chi2_seq,
            chi2_token_sn=st.ratio.relative_variance_x(),
            chi2_seq_sn=chi2_seq_sn,
            ess=ess,
            pearson_prob=st.prob.pearson(),
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

    def corrections(self, group: Group = "all") -> dict:
        """Share of data each published correction would clip or drop, with its thresholds."""
        st = self.stats(group)
        n = st.n
        seq = self.sequences(group)
        n_seq = len(seq.n_tokens)
        th = self.thresholds
        out: dict[str, Any] = {}
        for key, count in (("token_tis_clipped_share", "token_tis"), ("token_mask_share", "token_mask")):
            hit = st.count(count)
            out[key] = _share(hit, n)
            out[KEPT_K3[key]] = _mean_k3(st.sum(f"k3_kept_{count}"), n - hit)
        if n_seq:
            with np.errstate(invalid="ignore"):
                geo_log = seq.log_ratio / seq.n_tokens
            dropped = {
                "seq_tis_clipped_share": seq.log_ratio > math.log(th.seq_tis),
                "seq_mis_masked_share": seq.log_ratio > math.log(th.seq_mis),
                "geo_rejected_share": (geo_log < math.log1p(-th.geo_eps)) | (geo_log > math.log1p(th.geo_eps)),
                "worst_token_rejected_share": seq.min_token_log_ratio < math.log(th.worst_token_tau),
            }
            for key, hit in dropped.items():
                out[key] = float(hit.mean())
                keep = ~hit
                out[KEPT_K3[key]] = _mean_k3(float(seq.k3_sum[keep].sum()), int(seq.n_tokens[keep].sum()))
        else:
            out.update({k: None for k in CORRECTION_KEYS[2:]})
            out.update({KEPT_K3[k]: None for k in CORRECTION_KEYS[2:]})
        out["thresholds"] = th.as_record()
        return out

    def breakdowns(self, group: Group = "all") -> dict:
        """Tables the report draws: by p_infer bucket, by token position, by response length."""
        st = self.stats(group)
        return {
            "p_infer_buckets": self._p_infer_table(group, st),
            "position_buckets": self._position_table(st),
            "response_length_buckets": self._length_table(self.sequences(group)),
        }

    def _p_infer_table(self, group: Group, st: TokenStats) -> list[dict]:
        if not st.n:
            return []
        sums = dict(zip(BUCKET_KEYS, st.p_buckets))
        rows = []
        for i in range(N_P_BUCKETS):
            count = int(sums["count"][i])
            row: dict[str, Any] = {
                "p_infer_lo": P_INFER_BUCKET_EDGES[i],
                "p_infer_hi": P_INFER_BUCKET_EDGES[i + 1],
                "count": count,
                "share": count / st.n,
            }
            if count:
                q, top = self._quantiles(group, i, count)
                row.update(
                    abs_delta_mean=float(sums["abs_delta"][i] / count),
                    **{f"abs_delta_{k}": v for k, v in q.items()},
                    abs_delta_max=top,
                    prob_diff_mean=float(sums["prob_diff"][i] / count),
                    k3_mean=float(sums["k3"][i] / count),
                )
            rows.append(row)
        return rows

    @staticmethod
    def _position_table(st: TokenStats) -> list[dict]:
        sums = dict(zip(BUCKET_KEYS, st.pos_buckets))
        edges = POSITION_BUCKET_EDGES + (None,)
        rows = []
        for i in range(N_POS_BUCKETS):
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
                    "prob_diff_max": float(st.pos_max[i]),
                    "k3_mean": float(sums["k3"][i] / count),
                }
            )
        return rows

    @staticmethod
    def _length_table(seq: SequenceTerms) -> list[dict]:
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


_NO_SEQUENCES = SequenceTerms(np.zeros(0, dtype=np.int64), *([np.zeros(0)] * 9))
_Request = tuple[tuple[Group, int | None], list[int], int]  # (group, bucket), cells, size
_TURN_MIN, _TURN_RANGE = -(1 << 15), 1 << 16
_TURNS_PER_PASS = 64  # cells of a pass over turn indices: 64 x 65536 counts = 32 MiB
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
# every scalar metrics() reports, canonical first: a timeline's per-step columns
METRIC_KEYS = CANONICAL_KEYS + _EXTRA_KEYS


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


# ---- the compiled pass as the NumPy path's types ---------------------------------------------------
# The loops and their layouts are in analysis/kernels.py, which imports nothing of the analysis; their
# glue is here, so no module imports in a circle.


class ShardPass(NamedTuple):
    """The loop's results, as the NumPy path's types."""

    cells: list[TokenStats]  # one per cell
    segments: SequenceTerms  # one per segment
    sequences: SequenceTerms  # one per sequence (starts)
    peers: PeerPart
    abs_delta_bits: np.ndarray  # float32 |delta| as its bit pattern (order_stats.float32_bits)
    p_bucket: np.ndarray  # uint8


def warm_up() -> float:
    """Compile (or load from the cache) every loop for both dtypes of the log-probs, on a few
    tokens; the seconds it took (0 on the NumPy path). What the first shard of a process pays;
    benchmarks call it before their clock starts."""
    t0 = time.perf_counter()
    loops = compiled()
    if loops is None:
        return 0.0
    turn = np.array([0, 1, 1, 0, 0, 1], np.int16)
    # the shard's loop for each dtype, called directly: a few tokens take NumPy (COMPILED_MIN_TOKENS)
    for dtype in (np.float32, np.float64):
        logp = np.log(np.linspace(0.1, 0.9, 6, dtype=dtype))
        segments, seg_cell = np.array([0, 1, 3, 5]), np.array([0, 1, 0, 1])
        shard_pass(
            loops,
            logp,
            logp[::-1].copy(),
            np.array([0, 3]),
            segments,
            seg_cell,
            2,
            np.arange(6),
            CorrectionThresholds(),
        )
    # the order statistics' loops, which a few tokens would not reach (they select those directly)
    bits, lut = np.arange(6, dtype=np.uint32), np.zeros(1 << 16, np.int64)
    cells = loops.cells(turn, np.zeros(6, np.uint8), lut, 0, 2)
    loops.histogram(bits, cells, ORDER_HI, np.zeros(2 * ORDER_BINS, np.int64))
    loops.candidates(bits, cells, ORDER_HI, np.zeros(2 * ORDER_BINS, np.int32))
    return time.perf_counter() - t0


def shard_pass(
    loops: Loops,
    lt: np.ndarray,
    li: np.ndarray,
    starts: np.ndarray,
    segments: np.ndarray,
    seg_cell: np.ndarray,
    n_cells: int,
    positions: np.ndarray | None,
    thresholds: CorrectionThresholds,
) -> ShardPass | None:
    """The statistics of one non-empty shard (float32 or float64 log-probs); None when a log-prob
    breaks the table's contract (the caller's check names it)."""
    th = thresholds
    th_arr = np.array(
        [
            math.log(th.token_tis),
            math.log(th.token_mask_low),
            math.log(th.token_mask_high),
            th.token_tis,
            th.token_mask_low,
            th.token_mask_high,
            math.exp(-SAFETY_BOUND),
            math.exp(SAFETY_BOUND),
            LOG4,
        ]
    )
    pos = np.zeros(0, np.int64) if positions is None else np.asarray(positions, np.int64)
    segments = np.asarray(segments, np.int64)
    one_per_sequence = len(segments) == len(starts)
    # each segment's sequence (segments split sequences, never join them)
    seg_seq = np.arange(len(segments)) if one_per_sequence else np.searchsorted(starts, segments, side="right") - 1
    lt, li = _float(lt), _float(li)
    n_bad, cells, segs, peers, bits, p_bucket = shard_loop(
        loops,
        lt,
        li,
        pos,
        positions is not None,
        segments,
        np.asarray(seg_cell, np.int64),
        seg_seq,
        len(starts),
        n_cells,
        _P_EDGES,
        _POS_EDGES,
        th_arr,
    )
    if n_bad:
        return None
    cell_n, sums, counts, pd_max, p_sums, m2, p_tab, pos_tab, pos_max = cells
    sums, counts = _by_key(sums, CELL_SUMS, SUM_KEYS), _by_key(counts, CELL_COUNTS, COUNT_KEYS)
    p_tab = _by_key(p_tab, TABLE_ROWS, BUCKET_KEYS).transpose(2, 0, 1)  # [BUCKET_KEYS, cell, bucket]
    pos_tab = _by_key(pos_tab.transpose(1, 2, 0), TABLE_ROWS, BUCKET_KEYS).transpose(2, 0, 1)
    stats = []
    for c in range(n_cells):
        n = int(cell_n[c])
        mean_x, mean_y, mean_r = p_sums[c, 0] / n, p_sums[c, 1] / n, sums[c, SUM_KEYS.index("ratio")] / n
        stats.append(
            TokenStats(
                n=n,
                sums=sums[c],
                counts=counts[c],
                prob_diff_max=float(pd_max[c]),
                prob=Moments(n, float(mean_x), float(mean_y), float(m2[c, 0]), float(m2[c, 1]), float(m2[c, 3])),
                ratio=Moments(n, float(mean_r), float(mean_r), float(m2[c, 2]), float(m2[c, 2]), float(m2[c, 2])),
                p_buckets=p_tab[:, c],
                pos_buckets=pos_tab[:, c],
                pos_max=pos_max[c],
            )
        )
    seg, seg_pd_max, seg_d_min, seq, seq_pd_max, seq_d_min = segs
    seg_terms = _sequence_terms(np.diff(np.append(segments, len(lt))), seg, seg_pd_max, seg_d_min)
    seq_n = np.diff(np.append(starts, len(lt)))
    seq_terms = seg_terms if one_per_sequence else _sequence_terms(seq_n, seq, seq_pd_max, seq_d_min)
    peer_sums, peer_m2, peer_max, peer_min = peers
    part = PeerPart(
        len(lt),
        _by_key(peer_sums, PEER_SUMS, TOKEN_SUMS),
        _by_key(peer_m2, MOMENTS[FIRST_PEER_MOM:], TOKEN_M2),
        _by_key(peer_max, PEER_MAX, TOKEN_MAX),
        _by_key(peer_min, PEER_MIN, TOKEN_MIN),
        sequence_values(seq_n, dict(zip(SEQUENCE_SUMS, _by_key(seq, SEGMENT_SUMS, SEQUENCE_SUMS).T)), th),
        thresholds,
    )
    return ShardPass(stats, seg_terms, seq_terms, part, bits.view(np.uint32), p_bucket)


def _by_key(values: np.ndarray, layout: tuple[str, ...], keys: tuple[str, ...]) -> np.ndarray:
    """The last axis of ``values`` (in the loop's ``layout``) in the order of the NumPy path's ``keys``."""
    missing = [k for k in keys if k not in layout]
    if missing:
        raise NotImplementedError(f"the compiled pass computes no {', '.join(missing)}: add it to analysis/kernels.py")
    return values[..., [layout.index(k) for k in keys]]


def _float(x: np.ndarray) -> np.ndarray:
    """float32 and float64 as they are (one compiled loop each); anything else as float64."""
    x = np.ascontiguousarray(x)
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float64)


def _sequence_terms(n: np.ndarray, sums: np.ndarray, pd_max: np.ndarray, d_min: np.ndarray) -> SequenceTerms:
    named = ("logp_train", "logp_infer", "delta", "prob_diff", "k3", "mult_error")
    return sequence_terms_from_sums(
        n, **{k: sums[:, SEGMENT_SUMS.index(k)] for k in named}, prob_diff_max=pd_max, delta_min=d_min
    )


_P_EDGES = np.array(P_INFER_BUCKET_EDGES[1:-1], dtype=np.float64)  # terms.bucket_index's inner edges
_POS_EDGES = np.array(POSITION_BUCKET_EDGES[1:], dtype=np.int64)

__all__ = [
    "CANONICAL_KEYS",
    "CORRECTION_KEYS",
    "GROUP_TURNS",
    "KEPT_K3",
    "METRIC_KEYS",
    "CorrectionThresholds",
    "MetricsAccumulator",
    "Moments",
    "ShardTerms",
    "TokenStats",
    "cell_stats",
    "compute_metrics",
    "self_normalized_chi2",
]

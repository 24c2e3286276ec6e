"""The distributions a report draws, computed once from the per-token table.

Two sources, each kept once:

- token level, from one pass over the per-token table (:class:`DistributionAccumulator`), saved as
  ``<run>/distributions.json``: histograms over fixed edges (a 10M-token run gives the same file
  size as a 1k-token one) and the worst sequences with a bounded window of their tokens;
- sequence level, from ``sequences.parquet`` (:func:`with_sequences`, at render time): the
  per-sequence histograms and the log-ppl points, thinned to a bounded count.

Runs written before sequences.parquet (distributions version 1) stored both in the JSON file;
:func:`load` reads them as they are. Computing only: :mod:`mismatch_probe.report` draws it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.analysis.terms import TokenTerms, segment_starts, token_terms
from mismatch_probe.files import write_atomic

if TYPE_CHECKING:
    import pyarrow as pa

DISTRIBUTIONS_JSON = "distributions.json"
# 2: token level only (the sequence level comes from sequences.parquet); 1: both, read as stored
DISTRIBUTIONS_VERSION = 2
READABLE_VERSIONS = (1, 2)
GROUPS = ("first", "later")  # turn 0, turns >= 1; "all" is their sum

PROB_BINS = 100  # per axis of the p_infer x p_train density, linear on [0, 1]
# Log-ratio edges, symmetric and logarithmic in |x|: 5 bins a decade from 1e-7 to 1e2 on each side,
# one central bin (-1e-7, 1e-7), open ends. bf16 deltas sit around 1e-3, fp32 ones around 1e-7,
# so linear bins would put a whole run into one bin. delta = -inf (p_train = 0) lands in the first.
_MAGNITUDES = np.logspace(-7, 2, 46)
LOG_RATIO_EDGES = np.concatenate([[-np.inf], -_MAGNITUDES[::-1], _MAGNITUDES, [np.inf]])
SEQ_MAX_MISMATCH_EDGES = np.linspace(0.0, 1.0, 51)
# response length (model tokens) x per-sequence max |p_train - p_infer|, both logarithmic;
# the first mismatch bin [0, 1e-8) holds the exact zeros
LENGTH_EDGES = np.logspace(0, 5, 41)
MISMATCH_LOG_EDGES = np.concatenate([[0.0], np.logspace(-8, 0, 41)])
MISMATCH_LOG_EDGES[-1] = 1.0 + 1e-12  # |dp| = 1 exactly belongs to the last bin


def bin_index(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Index of the half-open bin [edges[i], edges[i+1]) of each value; values outside fall into
    the first or last bin, NaN into the last.

    Equal to ``clip(searchsorted(edges, values, side="right") - 1, 0, len(edges) - 2)``, without its
    binary search (~30 ns a value for the 94 log-ratio edges): a float64's upper 16 bits, taken in
    an order-preserving way, say how many edges lie below it, and one comparison settles the edge
    that shares them (edges whose upper bits collide fall back to the search)."""
    v = np.asarray(values, dtype=np.float64)
    table = _edge_table(np.asarray(edges, dtype=np.float64))
    if table is None:
        return np.clip(np.searchsorted(edges, v, side="right") - 1, 0, len(edges) - 2)
    below, edge_at = table
    top = _top16(v)
    out = below[top]  # the edges below the value's prefix, minus one: its bin if no edge shares it
    with np.errstate(invalid="ignore"):
        out += v >= edge_at[top]
    np.maximum(out, 0, out=out)  # (np.clip costs as much as all the rest)
    np.minimum(out, len(edges) - 2, out=out)
    out[np.isnan(v)] = len(edges) - 2  # searchsorted sorts NaN last
    return out


def _top16(v: np.ndarray) -> np.ndarray:
    """The upper 16 bits (sign, exponent, 4 mantissa bits) of each float64, -0.0 counted as +0.0."""
    return ((v + 0.0).view(np.uint64) >> np.uint64(48)).view(np.int64)


_EDGE_TABLES: dict[bytes, tuple[np.ndarray, np.ndarray] | None] = {}


def _edge_table(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """For every 16-bit prefix: how many edges lie below the floats that have it, and the edge that
    has it (NaN where none does, so the comparison is false); None when two edges share a prefix."""
    key = edges.tobytes()
    if key not in _EDGE_TABLES:
        prefixes = np.arange(1 << 16, dtype=np.uint64)
        # the prefixes in the order of the floats they start: negatives reversed, below positives
        ordered = np.where(prefixes >> np.uint64(15) == 1, ~prefixes & np.uint64(0x7FFF), prefixes | np.uint64(0x8000))
        tops = _top16(edges)
        edge_order = ordered[tops]
        if len(np.unique(tops)) < len(tops) or np.isnan(edges).any():
            _EDGE_TABLES[key] = None
        else:
            edge_at = np.full(1 << 16, np.nan)
            edge_at[tops] = edges + 0.0
            _EDGE_TABLES[key] = (np.searchsorted(edge_order, ordered, side="left") - 1, edge_at)
    return _EDGE_TABLES[key]


def _sparse(hist: np.ndarray) -> dict:
    i, j = np.nonzero(hist)
    return {"shape": list(hist.shape), "i": i.tolist(), "j": j.tolist(), "count": hist[i, j].tolist()}


def dense(sparse: dict) -> np.ndarray:
    """A histogram stored by :func:`_sparse` as a dense int64 array."""
    out = np.zeros(sparse["shape"], dtype=np.int64)
    out[np.asarray(sparse["i"], dtype=np.int64), np.asarray(sparse["j"], dtype=np.int64)] = sparse["count"]
    return out


def _thin(a: np.ndarray, n: int) -> np.ndarray:
    return a[:: max(1, -(-len(a) // n))]


def _edges() -> dict:
    """The bin edges, stored with the histograms (a fresh dict each time: results are mutable)."""
    return {
        "prob_bins": PROB_BINS,
        "log_ratio": LOG_RATIO_EDGES.tolist(),
        "seq_max_mismatch": SEQ_MAX_MISMATCH_EDGES.tolist(),
        "length": LENGTH_EDGES.tolist(),
        "mismatch_log": MISMATCH_LOG_EDGES.tolist(),
    }


def sequence_distributions(sequences: pa.Table, max_points: int = 5_000) -> dict:
    """The sequence level of the report's distributions, from sequences.parquet's rows: histograms
    of the ``all`` group (one sequence per sample) and, per turn group, one log-ppl point per
    sample-turn, thinned by a deterministic stride to at most ``max_points``."""
    from mismatch_probe.analysis.sequences import group_columns

    every = group_columns(sequences, "all")
    n_tokens, max_mismatch, log_ratio = every["n_tokens"], every["max_mismatch"], every["log_ratio"]
    length_hist = np.zeros((len(LENGTH_EDGES) - 1, len(MISMATCH_LOG_EDGES) - 1), dtype=np.int64)
    np.add.at(length_hist, (bin_index(n_tokens, LENGTH_EDGES), bin_index(max_mismatch, MISMATCH_LOG_EDGES)), 1)
    with np.errstate(invalid="ignore"):
        seq_ratio_bin = bin_index(log_ratio, LOG_RATIO_EDGES)
    log_ppl = {}
    for g in GROUPS:
        turns = group_columns(sequences, g)
        log_ppl[g] = {key: _thin(turns[key], max_points).tolist() for key in ("log_ppl_infer", "log_ppl_train")}
    return {
        "sequences": {
            "n_sequences": len(n_tokens),
            "max_mismatch_hist": np.bincount(
                bin_index(max_mismatch, SEQ_MAX_MISMATCH_EDGES), minlength=len(SEQ_MAX_MISMATCH_EDGES) - 1
            ).tolist(),
            "log_ratio_hist": np.bincount(seq_ratio_bin, minlength=len(LOG_RATIO_EDGES) - 1).tolist(),
            "length_vs_max_mismatch": _sparse(length_hist),
        },
        "log_ppl": log_ppl,
    }


def with_sequences(distributions: dict, sequences: pa.Table) -> dict:
    """The token-level distributions (as stored) joined with the sequence level, in the shape the
    report draws: ``sequences`` and each turn group's ``log_ppl_infer`` / ``log_ppl_train``."""
    seq = sequence_distributions(sequences)
    groups = {g: {**distributions["groups"][g], **seq["log_ppl"][g]} for g in GROUPS}
    return {**distributions, "groups": groups, "sequences": seq["sequences"]}


@dataclass
class DistributionAccumulator:
    """Streams shards of model tokens (whole sequences per shard) into the report's token
    histograms and keeps the ``worst_k`` samples with the largest token probability gap."""

    worst_k: int = 12
    result: dict | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        n_ratio = len(LOG_RATIO_EDGES) - 1
        self._prob = {g: np.zeros(PROB_BINS * PROB_BINS, dtype=np.int64) for g in GROUPS}
        self._delta = {g: np.zeros(n_ratio, dtype=np.int64) for g in GROUPS}
        self._worst_gap = np.zeros(0)
        self._worst_sample = np.zeros(0, dtype=np.int64)

    def add(self, logp_train: np.ndarray, logp_infer: np.ndarray, sample_id: np.ndarray, turn: np.ndarray) -> None:
        if len(logp_train) == 0:
            return
        terms = token_terms(logp_train, logp_infer)
        starts = segment_starts(sample_id)
        self.add_terms(terms, turn, np.asarray(sample_id)[starts], np.maximum.reduceat(terms.prob_diff, starts))

    def add_terms(self, terms: TokenTerms, turn: np.ndarray, samples: np.ndarray, max_gap: np.ndarray) -> None:
        """A shard whose :func:`token_terms` are computed: each token's ``turn``, and per sample its
        id and largest |p_train - p_infer| (``samples``, ``max_gap``: the metrics pass's sequences)."""
        p_train, p_infer = terms.p_train, terms.p_infer
        if len(p_train) == 0:
            return
        # first / later as the upper half of one histogram: one bincount per shard, no copies
        later = np.asarray(turn) >= 1
        cell = np.minimum((p_infer * PROB_BINS).astype(np.int64), PROB_BINS - 1) * PROB_BINS + np.minimum(
            (p_train * PROB_BINS).astype(np.int64), PROB_BINS - 1
        )
        n_ratio = len(LOG_RATIO_EDGES) - 1
        ratio_bin = bin_index(terms.delta, LOG_RATIO_EDGES)
        cell += later * (PROB_BINS * PROB_BINS)
        ratio_bin += later * n_ratio
        counted = np.asarray(turn) >= 0  # tokens before the first assistant turn are in neither group
        if not counted.all():
            cell, ratio_bin = cell[counted], ratio_bin[counted]
        prob = np.bincount(cell, minlength=2 * PROB_BINS * PROB_BINS)
        delta = np.bincount(ratio_bin, minlength=2 * n_ratio)
        for i, group in enumerate(GROUPS):
            self._prob[group] += prob[i * PROB_BINS * PROB_BINS : (i + 1) * PROB_BINS * PROB_BINS]
            self._delta[group] += delta[i * n_ratio : (i + 1) * n_ratio]
        gaps = np.concatenate([self._worst_gap, max_gap])
        samples = np.concatenate([self._worst_sample, samples])
        if len(gaps) > self.worst_k:
            # finish()'s order, ties by sample id: argpartition keeps an arbitrary one of tied gaps,
            # which differed between NumPy 1.26 and 2 (and can between SIMD builds) on the example run
            keep_idx = np.lexsort((samples, -gaps))[: self.worst_k]
            gaps, samples = gaps[keep_idx], samples[keep_idx]
        self._worst_gap, self._worst_sample = gaps, samples

    def finish(self) -> dict:
        """The stored form, token level (JSON-safe apart from NaN/inf, which :func:`save` converts)."""
        groups = {
            g: {
                "n_tokens": int(self._delta[g].sum()),
                "prob_hist": _sparse(self._prob[g].reshape(PROB_BINS, PROB_BINS)),
                "log_ratio_hist": self._delta[g].tolist(),
            }
            for g in GROUPS
        }
        order = np.lexsort((self._worst_sample, -self._worst_gap))  # worst first, ties by sample id
        self.result = {
            "version": DISTRIBUTIONS_VERSION,
            "edges": _edges(),
            "groups": groups,
            "worst": [
                {"sample_id": int(s), "max_prob_diff": float(g)}
                for s, g in zip(self._worst_sample[order], self._worst_gap[order])
            ],
        }
        return self.result


WORST_COLUMNS = ["sample_id", "prompt_id", "turn", "position", "token_id", "is_model_token", "logp_infer", "logp_train"]


def worst_sequences(
    run_dir: str | Path, worst: list[dict], tokenizer=None, *, head: int = 48, window: int = 320
) -> list[dict]:
    """The tokens of the worst samples, for the report: the first ``head`` tokens (the start of the
    prompt) and ``window`` tokens centred on the model token with the largest probability gap, so a
    16k-token sequence costs the report as much as a short one. Token text comes from
    ``tokenizer`` (one token at a time, so a character split across tokens shows as U+FFFD);
    without one it is null and the report shows ids.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    from mismatch_probe.table.tokens import TOKENS_DIR, read_parquet, shard_paths

    wanted = [w["sample_id"] for w in worst]
    if not wanted:
        return []
    parts = []
    for path in shard_paths(Path(run_dir), TOKENS_DIR):
        t = read_parquet(path, columns=WORST_COLUMNS)
        t = t.filter(pc.is_in(t.column("sample_id"), value_set=pa.array(wanted, pa.int64())))
        if t.num_rows:
            parts.append(t)
    if not parts:
        return []
    table = pa.concat_tables(parts)
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in WORST_COLUMNS}
    out = []
    for item in worst:
        rows = np.flatnonzero(cols["sample_id"] == item["sample_id"])
        rows = rows[np.argsort(cols["position"][rows], kind="stable")]
        if not len(rows):
            continue
        model = cols["is_model_token"][rows].astype(bool)
        with np.errstate(invalid="ignore"):
            p_infer = np.where(model, np.exp(cols["logp_infer"][rows].astype(np.float64)), np.nan)
            p_train = np.where(model, np.exp(cols["logp_train"][rows].astype(np.float64)), np.nan)
            gap = np.where(model, np.abs(p_train - p_infer), -1.0)
        worst_at = int(np.argmax(gap))
        n = len(rows)
        lo = max(0, min(worst_at - window // 2, n - window))
        shown = np.unique(np.concatenate([np.arange(min(head, n)), np.arange(lo, min(n, lo + window))]))
        sel = rows[shown]
        ids = cols["token_id"][sel].astype(np.int64)
        text = (
            [tokenizer.decode([int(i)], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]
            if tokenizer is not None
            else None
        )
        with np.errstate(divide="ignore"):  # p_train = 0 gives delta = -inf, as in the metrics
            delta = np.log(p_train[model]) - np.log(p_infer[model]) if model.any() else np.zeros(0)
        out.append(
            {
                "sample_id": int(item["sample_id"]),
                "prompt_id": str(cols["prompt_id"][rows[0]]),
                "n_tokens": int(n),
                "n_model_tokens": int(model.sum()),
                "n_turns": len(np.unique(cols["turn"][rows][model])),
                "max_prob_diff": float(gap[worst_at]),
                "worst_position": int(cols["position"][rows[worst_at]]),
                "log_ratio": float(np.sum(delta)) if len(delta) else None,
                "tokens": {
                    "position": cols["position"][sel].astype(int).tolist(),
                    "token_id": ids.tolist(),
                    "text": text,
                    "turn": cols["turn"][sel].astype(int).tolist(),
                    "is_model": model[shown].tolist(),
                    "p_infer": p_infer[shown].tolist(),
                    "p_train": p_train[shown].tolist(),
                },
            }
        )
    return out


def save(run_dir: str | Path, distributions: dict) -> Path:
    from mismatch_probe.record import json_safe

    path = Path(run_dir) / DISTRIBUTIONS_JSON
    write_atomic(path, json.dumps(json_safe(distributions), separators=(",", ":"), allow_nan=False))
    return path


def _float(v) -> float:
    """Undo :func:`mismatch_probe.record.json_safe`: null is NaN, "inf" / "-inf" are infinities."""
    return float("nan") if v is None else float(v)


def load(run_dir: str | Path) -> dict | None:
    """The stored distributions with their infinities and NaNs restored, or None when the run has
    none (written before they existed) or an unknown version of them. Version 2 holds the token
    level only (join the sequence level with :func:`with_sequences`); version 1 holds both."""
    path = Path(run_dir) / DISTRIBUTIONS_JSON
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("version") not in READABLE_VERSIONS:
        return None
    data["edges"]["log_ratio"] = [_float(v) for v in data["edges"]["log_ratio"]]
    for group in data["groups"].values():  # a sequence whose reference p is 0 has log-ppl inf
        for key in ("log_ppl_infer", "log_ppl_train"):
            if key in group:  # version 1
                group[key] = [_float(v) for v in group[key]]
    for seq in data.get("worst_sequences") or []:
        for key in ("p_infer", "p_train"):
            seq["tokens"][key] = [_float(v) for v in seq["tokens"][key]]
    return data

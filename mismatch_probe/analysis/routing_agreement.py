"""MoE routing agreement: per layer, whether the engine and the reference send each model token to
the same top-k experts, and the mismatch of the tokens whose routing flipped against those whose
routing agreed (run.json's ``routing``; ARCHITECTURE.md, Metrics)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from mismatch_probe.analysis.terms import TokenTerms, token_terms

# The number of set bits of each byte value, for popcount_by_bytes.
_BYTE_POPCOUNT = np.array([v.bit_count() for v in range(256)], dtype=np.uint8)


def popcount_by_bytes(x: np.ndarray) -> np.ndarray:
    """The set bits of each element of an unsigned integer array, as ``np.bitwise_count`` counts them
    (uint8, the array's shape): each element's bytes looked up in a 256-entry table and added. Exact,
    in integers only; for NumPy 1.26, which has no ``np.bitwise_count`` (older verl releases pin
    ``numpy<2``)."""
    x = np.asarray(x)
    if x.dtype.kind != "u":
        raise TypeError(f"popcount_by_bytes counts the bits of unsigned integers, not {x.dtype}")
    flat = np.ascontiguousarray(x).reshape(-1)  # .view(np.uint8) needs contiguous memory
    per_byte = _BYTE_POPCOUNT[flat.view(np.uint8)].reshape(flat.size, x.dtype.itemsize)
    return per_byte.sum(axis=1, dtype=np.uint8).reshape(x.shape)


# NumPy >= 2.0's ufunc where there is one (faster); the same counts otherwise.
popcount = getattr(np, "bitwise_count", popcount_by_bytes)


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
        out += popcount(_expert_bits(a, w) & _expert_bits(b, w))
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

    def add(
        self,
        comparison: RoutingComparison,
        logp_train: np.ndarray | None = None,
        logp_infer: np.ndarray | None = None,
        terms: TokenTerms | None = None,
        keep: np.ndarray | None = None,
    ) -> None:
        """Add the comparisons of some tokens, with their log-probs or their :func:`token_terms`;
        ``keep`` (a mask) takes only some of them, without copying the terms it does not use."""
        if terms is None:
            if logp_train is None or logp_infer is None:
                raise ValueError("RoutingAccumulator.add needs the log-probs or their token terms")
            terms = token_terms(logp_train, logp_infer)
        same, shared = comparison
        abs_delta, prob_diff, k3 = terms.abs_delta, terms.prob_diff, terms.k3
        if keep is not None:
            same, shared = same[keep], shared[keep]
            abs_delta, prob_diff, k3 = abs_delta[keep], prob_diff[keep], k3[keep]
        n = len(abs_delta)
        if n == 0:
            return
        self._n += n
        self._same += same.sum(axis=0)
        self._overlap += shared.sum(axis=0)
        self._differing_hist += np.bincount(self.n_layers - same.sum(axis=-1), minlength=self.n_layers + 1)
        flipped = ~same.all(axis=-1)
        with np.errstate(invalid="ignore", over="ignore"):
            for name, sel in (("flipped", flipped), ("agreed", ~flipped)):
                g = self._groups[name]
                if sel.any():
                    g["n"] += int(sel.sum())
                    g["abs_delta"] += float(abs_delta[sel].sum())
                    g["prob_diff"] += float(prob_diff[sel].sum())
                    g["k3"] += float(k3[sel].sum())
                    g["prob_diff_max"] = max(g["prob_diff_max"], float(prob_diff[sel].max()))

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

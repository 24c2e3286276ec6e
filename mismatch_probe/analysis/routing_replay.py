"""The routing replay (R3) what-if: the mismatch left when the reference's routing is forced to the
engine's experts, against the reference routing freely (run.json's ``routing.replay``;
ARCHITECTURE.md, Metrics)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_probe.analysis.terms import TokenTerms

# what a ReplayAccumulator sums per group of tokens
REPLAY_SUMS = ("n", "k3_free", "k3_replayed", "prob_diff_free", "prob_diff_replayed")


@dataclass
class ReplayAccumulator:
    """The routing replay (R3) what-if: the engine against the reference routing freely, and
    against the reference with the routing behind each token forced to the engine's experts, over
    the same model tokens. What routing replay in the trainer would leave of the mismatch: K3 and
    mean |p_train - p_infer| of each, for all tokens and for those whose routing flipped."""

    def __post_init__(self) -> None:
        self._sums = {g: dict.fromkeys(REPLAY_SUMS, 0.0) for g in ("all", "flipped")}

    def add(
        self, free: TokenTerms, replayed: TokenTerms, flipped: np.ndarray | None = None, keep: np.ndarray | None = None
    ) -> None:
        """Tokens' :func:`token_terms` with free and with replayed routing (the same tokens, in
        order); ``flipped``: tokens whose routing differs in any layer; ``keep``: a mask of the
        tokens to take."""
        if flipped is None:
            flipped = np.zeros(len(free.k3), dtype=bool)
        columns = (free.k3, replayed.k3, free.prob_diff, replayed.prob_diff)
        if keep is not None:
            columns, flipped = tuple(c[keep] for c in columns), flipped[keep]
        for name, sel in (("all", None), ("flipped", flipped)):
            sums = self._sums[name]
            sums["n"] += len(columns[0]) if sel is None else int(sel.sum())
            for key, column in zip(REPLAY_SUMS[1:], columns):
                sums[key] += float(column.sum() if sel is None else column[sel].sum())

    @property
    def n_tokens(self) -> int:
        return int(self._sums["all"]["n"])

    def result(self) -> dict:
        """``n_tokens``, ``k3_free`` and ``k3_replayed`` (means), ``gap_closed_share`` (the share
        of the free K3 that replay removes: 1 - replayed / free; None when free is 0), ``prob_diff_mean_free``
        / ``_replayed``, and the same for the tokens whose routing flipped (``flipped``)."""
        return replay_result(self._sums["all"]) | {"flipped": replay_result(self._sums["flipped"])}


def replay_result(sums: dict[str, float]) -> dict:
    """Means of a :class:`ReplayAccumulator`'s sums (None without tokens)."""
    n = int(sums["n"])
    if not n:
        return {"n_tokens": 0} | dict.fromkeys(
            ("k3_free", "k3_replayed", "gap_closed_share", "prob_diff_mean_free", "prob_diff_mean_replayed")
        )
    free, replayed = sums["k3_free"] / n, sums["k3_replayed"] / n
    return {
        "n_tokens": n,
        "k3_free": free,
        "k3_replayed": replayed,
        "gap_closed_share": 1.0 - replayed / free if free > 0 else None,
        "prob_diff_mean_free": sums["prob_diff_free"] / n,
        "prob_diff_mean_replayed": sums["prob_diff_replayed"] / n,
    }

"""Per-sequence results of the metrics pass (``sequences.parquet``).

The metrics accumulators already reduce every sequence (sum of log-ratios, max |delta p|, ...);
this keeps those rows with their ids instead of throwing them away, so the gate's sequence
statistics, the report and bootstrap intervals read them instead of re-reading the token table.

Rows come in three groups, as the metrics do: ``all`` (one row per sample, every model token of all
its turns; ``turn`` is null), ``first`` (turn 0) and ``later`` (one row per sample-turn, turn >= 1).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from mismatch_probe.analysis.metrics import GROUP_TURNS, MetricsAccumulator, ShardTerms
from mismatch_probe.analysis.terms import SequenceTerms

SEQUENCE_GROUPS = ("all", "first", "later")

SCHEMA = pa.schema(
    [
        ("group", pa.string()),
        ("sample_id", pa.int64()),
        ("turn", pa.int32()),
        *[(name, pa.int64() if name == "n_tokens" else pa.float64()) for name in SequenceTerms._fields],
    ]
)


class SequenceIds:
    """The ids of the sequences an accumulator reduces, in the order it reduces them."""

    def __init__(self) -> None:
        self._samples: list[np.ndarray] = []
        self._turns: list[np.ndarray] = []

    def add(self, sample_id: np.ndarray, turn: np.ndarray | None, starts: np.ndarray) -> None:
        self._samples.append(np.asarray(sample_id)[starts].astype(np.int64))
        self._turns.append(
            np.full(len(starts), -1, np.int32) if turn is None else np.asarray(turn)[starts].astype(np.int32)
        )

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._samples:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        return np.concatenate(self._samples), np.concatenate(self._turns)


class SequenceCollector:
    """Fed by :func:`~mismatch_probe.analysis.analyze.analyze` with the ids of each group's sequences;
    ``table`` holds the rows once the pass is finished."""

    def __init__(self) -> None:
        self.ids = {g: SequenceIds() for g in SEQUENCE_GROUPS}
        self.table: pa.Table | None = None

    def add(self, sample_id: np.ndarray, turn: np.ndarray, starts: np.ndarray, shard: ShardTerms) -> None:
        """The ids of a shard's sequences: samples (``starts``) in ``all``, and the segments of one
        turn that :meth:`MetricsAccumulator.add` reduced (``shard``) in the turn groups."""
        self.ids["all"].add(sample_id, None, starts)
        for name, select in GROUP_TURNS.items():
            self.ids[name].add(sample_id, turn, shard.segments[select(shard.segment_turn)])

    def finish(self, accumulator: MetricsAccumulator) -> pa.Table:
        self.table = sequence_table({g: (self.ids[g], accumulator.sequences(g)) for g in SEQUENCE_GROUPS})
        return self.table


def sequence_table(groups: dict[str, tuple[SequenceIds, MetricsAccumulator | SequenceTerms]]) -> pa.Table:
    """One Arrow table of every group's sequences (``turn`` null in the ``all`` group); each group's
    terms given, or an accumulator whose ``all`` group they are."""
    parts = []
    for group, (ids, acc) in groups.items():
        samples, turns = ids.arrays()
        terms = acc if isinstance(acc, SequenceTerms) else acc.sequences()
        if len(samples) != len(terms.n_tokens):
            raise AssertionError(f"{group}: {len(samples)} ids for {len(terms.n_tokens)} sequences")
        columns = {
            "group": pa.array([group] * len(samples), pa.string()),
            "sample_id": pa.array(samples, pa.int64()),
            "turn": pa.array(turns, pa.int32(), mask=turns < 0),
            **{
                name: pa.array(np.asarray(getattr(terms, name)), SCHEMA.field(name).type)
                for name in SequenceTerms._fields
            },
        }
        parts.append(pa.table(columns, schema=SCHEMA))
    return pa.concat_tables(parts) if parts else SCHEMA.empty_table()


def group_columns(table: pa.Table, group: str) -> dict[str, np.ndarray]:
    """One group's rows of a sequences table, in its order: every :class:`SequenceTerms` column plus
    ``sample_id`` and ``turn`` (-1 where null, the ``all`` group). A column newer than the file
    (``mult_error_sum``, added after 0.1.0's first tables) is absent rather than invented."""
    import pyarrow.compute as pc

    rows = table.filter(pc.equal(table.column("group"), group))
    out = {name: rows.column(name).to_numpy() for name in SequenceTerms._fields if name in rows.column_names}
    out["sample_id"] = rows.column("sample_id").to_numpy()
    out["turn"] = rows.column("turn").fill_null(-1).to_numpy()
    return out


def sequence_values(table: pa.Table) -> dict[str, dict[str, np.ndarray]]:
    """Per group, every value a gate check's ``sequence_metric`` may name, for every sequence."""
    out = {}
    for g in SEQUENCE_GROUPS:
        col = group_columns(table, g)
        with np.errstate(invalid="ignore", over="ignore"):
            out[g] = {
                "max_mismatch": col["max_mismatch"],
                "mean_mismatch": col["mean_mismatch"],
                "log_ratio": col["log_ratio"],
                "abs_log_ratio": np.abs(col["log_ratio"]),
                "geo_ratio": col["geo_ratio"],
                "min_token_ratio": np.exp(col["min_token_log_ratio"]),
                "log_ppl_infer": col["log_ppl_infer"],
                "log_ppl_train": col["log_ppl_train"],
                "log_ppl_abs_diff": np.abs(col["log_ppl_train"] - col["log_ppl_infer"]),
                "n_tokens": col["n_tokens"].astype(np.float64),
            }
    return out

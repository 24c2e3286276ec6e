"""A finished run as the report reads it: its record and distributions (the token level from
distributions.json, the sequence level from sequences.parquet), both computed from its per-token
table when the run predates them; and a timeline's steps.parquet as columns by step
(:func:`step_columns`). Needs no engine, no GPU and no model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mismatch_probe.record import RunRecord, read_record

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa


@dataclass
class RunData:
    path: Path
    record: RunRecord
    dist: dict
    label: str = ""  # set for comparisons
    color: str = ""


def load_run(run_dir: str | Path) -> RunData:
    """A finished run's record and distributions."""
    from mismatch_probe.analysis import distributions
    from mismatch_probe.analysis.analyze import sequences_from_tokens
    from mismatch_probe.table.tokens import read_sequences

    run_dir = Path(run_dir)
    record = read_record(run_dir)
    assert record is not None  # read_record returns None only with missing_ok
    dist = distributions.load(run_dir)
    if dist is None:
        dist = compute_distributions(run_dir, record)
    elif "sequences" not in dist:  # the current format; version 1 stored the sequence level too
        sequences = read_sequences(run_dir)
        dist = distributions.with_sequences(
            dist, sequences if sequences is not None else sequences_from_tokens(run_dir)
        )
    return RunData(run_dir, record, dist)


def compute_distributions(run_dir: Path, record: RunRecord, tokenizer=None) -> dict:
    """Distributions from the per-token table, with the worst sequences' text when a tokenizer is
    given or the run's model directory is still where run.json says."""
    from mismatch_probe.analysis.analyze import analyze
    from mismatch_probe.analysis.distributions import DistributionAccumulator, with_sequences, worst_sequences
    from mismatch_probe.analysis.metrics import CorrectionThresholds
    from mismatch_probe.analysis.sequences import SequenceCollector

    thresholds = CorrectionThresholds(**record.spec.corrections)
    routing = record.engine.routing if record.engine else None
    acc, sequences = DistributionAccumulator(), SequenceCollector()
    analyze(run_dir, thresholds, routing.to_dict() if routing else None, acc, sequences)
    dist = acc.finish() if acc.result is None else acc.result
    if tokenizer is None:
        tokenizer = _tokenizer_if_present(record)
    dist["worst_sequences"] = worst_sequences(run_dir, dist["worst"], tokenizer)
    return with_sequences(dist, sequences.table)


def _tokenizer_if_present(record: RunRecord):
    model = record.inputs.model if record.inputs else None
    if not model or not Path(model, "config.json").is_file():
        return None
    try:
        from mismatch_probe.modeling.loading import load_tokenizer

        return load_tokenizer(Path(model), trust_remote_code=bool(record.spec.trust_remote_code))
    except Exception:  # token ids are shown instead of text
        return None


Columns = dict[str, dict[str, "np.ndarray"]]  # turn group -> column -> values by step (null: NaN)


def step_columns(table: pa.Table) -> Columns:
    """steps.parquet's rows of each turn group as float arrays, one value per step (null: NaN)."""
    import pyarrow.compute as pc

    out: Columns = {}
    for group in ("all", "first", "later"):
        rows = table.filter(pc.equal(table.column("group"), group))
        out[group] = {
            name: rows.column(name).to_numpy(zero_copy_only=False).astype(float)
            for name in rows.column_names
            if name != "group"
        }
    return out

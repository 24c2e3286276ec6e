"""The generic dump: one row per sample in Parquet or JSON Lines (docs/dump-format.md).

For frameworks without a reader of their own (OpenRLHF, TRL, ms-swift, in-house trainers): write
the token ids, which of them the policy sampled, and the engine's log-prob of each, and
optionally the trainer's log-probs, turn ids and routed experts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.dumps.base import DumpReader
from mismatch_probe.dumps.samples import DumpSample
from mismatch_probe.errors import ConfigError

REQUIRED = ("token_ids", "model_mask", "logp_engine")
OPTIONAL = ("logp_trainer", "turn", "routed_experts", "prompt_id", "finish_reason", "sample_id")
COLUMNS = REQUIRED + OPTIONAL
SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
PARQUET_BATCH_ROWS = 256  # rows read at a time: memory stays bounded whatever the file's size


class GenericDump(DumpReader):
    format = "generic"

    def __init__(self, path: Path, **_: Any) -> None:
        super().__init__(path)
        if path.is_dir():
            self.files = sorted(f for f in path.iterdir() if f.suffix in SUFFIXES and f.is_file())
            if not self.files:
                raise ConfigError(f"{path} holds no .parquet or .jsonl file", hint="see docs/dump-format.md")
        elif path.suffix in SUFFIXES:
            self.files = [path]
        else:
            raise ConfigError(
                f"{path} is neither Parquet nor JSON Lines (.parquet, .jsonl)", hint="see docs/dump-format.md"
            )
        for f in self.files:
            if SUFFIXES[f.suffix] == "parquet":
                self._check_columns(f, _parquet_columns(f))

    def _check_columns(self, f: Path, names: list[str]) -> None:
        missing = [c for c in REQUIRED if c not in names]
        if missing:
            raise ConfigError(
                f"{f} lacks the column(s) {', '.join(missing)}",
                hint="a generic dump has token_ids, model_mask and logp_engine per sample (docs/dump-format.md)",
            )
        if "logp_trainer" in names:
            self.has_trainer = True

    def samples(self) -> Iterator[DumpSample]:
        for f in self.files:
            rows = _parquet_rows(f) if SUFFIXES[f.suffix] == "parquet" else _jsonl_rows(f, self)
            for k, row in rows:
                yield _sample(row, f"{f.name}, row {k}")


def _parquet_columns(f: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(f).names
    except Exception as exc:  # not Parquet, truncated
        raise ConfigError(f"{f} is not a readable Parquet file ({exc})") from None


def _parquet_rows(f: Path) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(f)
    wanted = [c for c in COLUMNS if c in parquet.schema_arrow.names]
    k = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=wanted):
        columns = {name: batch.column(name) for name in wanted}
        for i in range(batch.num_rows):
            yield k, {name: _value(col, i) for name, col in columns.items()}
            k += 1


def _value(column, i: int):
    """Row ``i`` of an Arrow column: a NumPy array for lists of numbers (no Python objects per token)."""
    import pyarrow as pa

    item = column[i]
    if not item.is_valid:
        return None
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        values = item.values
        if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
            return item.as_py()  # routed experts: nested lists, converted by the sample
        return values.to_numpy(zero_copy_only=False)
    return item.as_py()


def _jsonl_rows(f: Path, reader: GenericDump) -> Iterator[tuple[int, dict]]:
    with open(f, encoding="utf-8") as fh:
        for k, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{f}:{k + 1}: not a JSON object ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{f}:{k + 1}: not a JSON object")
            if k == 0:
                reader._check_columns(f, list(row))
            yield k, row


def _sample(row: dict, where: str) -> DumpSample:
    for name in REQUIRED:
        if row.get(name) is None:
            raise ConfigError(f"{where}: no {name}", hint="see docs/dump-format.md")
    experts = row.get("routed_experts")
    prompt_id = row.get("prompt_id")
    return DumpSample(
        where=where,
        token_ids=np.asarray(row["token_ids"]),
        model_mask=np.asarray(row["model_mask"]),
        logp_engine=_floats(row["logp_engine"], where, "logp_engine"),
        logp_trainer=None if row.get("logp_trainer") is None else _floats(row["logp_trainer"], where, "logp_trainer"),
        turn=None if row.get("turn") is None else np.asarray(row["turn"]),
        experts=None if experts is None else np.asarray(experts),
        prompt_id=None if prompt_id is None else str(prompt_id),
        finish_reason=row.get("finish_reason"),
    )


def _floats(values, where: str, key: str) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key} is not a list of numbers") from None

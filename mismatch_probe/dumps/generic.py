"""The generic dump: one row per sample in Parquet or JSON Lines (docs/dump-format.md).

For frameworks without a reader of their own (OpenRLHF, TRL, ms-swift, in-house trainers): write
the token ids, which of them the policy sampled, and the engine's log-prob of each, and
optionally the trainer's log-probs, turn ids and routed experts.

Steps: a file or a directory of files is one step, unless names carry ``step_<N>`` (``step<N>``,
``step-<N>``): files named so (``step_120.jsonl``, ``step_000120.rank0.parquet``) or directories
(``step_120/``, every data file in it) are step N, several files of a step being read in name order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.dumps import jsonl
from mismatch_probe.dumps.base import UNNUMBERED, DumpReader, Listing, select_step
from mismatch_probe.dumps.samples import DumpSample, FlatSamples, SampleColumns
from mismatch_probe.errors import ConfigError

REQUIRED = ("token_ids", "model_mask", "logp_engine")
OPTIONAL = ("logp_trainer", "turn", "routed_experts", "prompt_id", "finish_reason", "sample_id")
COLUMNS = REQUIRED + OPTIONAL
SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
PARQUET_BATCH_ROWS = 256  # rows read at a time: memory stays bounded whatever the file's size
# "step_120", "step120", "step-000120" in a name, not "mystep1" or "rank0"
STEP_NAME = re.compile(r"(?:^|[^a-z0-9])step[_-]?(\d+)(?![0-9])", re.IGNORECASE)
WHAT = "generic dump files (.parquet, .jsonl)"


class GenericDump(DumpReader):
    format = "generic"

    def __init__(self, path: Path, *, step: int | None = None, listing: Listing | None = None, **_: Any) -> None:
        super().__init__(path, listing=listing)
        steps = self.listed_steps(path)
        if not steps:
            raise ConfigError(f"{path} holds no .parquet or .jsonl file", hint="see docs/dump-format.md")
        picked, self.files = select_step(steps, step, path, WHAT)
        self.step = picked if _step_of(self.files[0]) is not None else step
        for f in self.files:
            if SUFFIXES[f.suffix] == "parquet":
                self._check_columns(f, _parquet_columns(f))

    @classmethod
    def available_steps(cls, path: Path) -> dict[int, list[Path]]:
        """``step_<N>`` files and directories by N; otherwise the file, or the directory's files, as one step."""
        if not path.is_dir():
            if path.suffix not in SUFFIXES:
                raise ConfigError(
                    f"{path} is neither Parquet nor JSON Lines (.parquet, .jsonl)", hint="see docs/dump-format.md"
                )
            own = _step_of(path)
            return {UNNUMBERED if own is None else own: [path]}
        flat = _data_files(path)
        steps: dict[int, list[Path]] = {}
        for f in flat:
            number = _step_number(f.name)
            if number is not None:
                steps.setdefault(number, []).append(f)
        for d in sorted(p for p in path.iterdir() if p.is_dir()):
            number = _step_number(d.name)
            if number is not None and _data_files(d):
                steps.setdefault(number, []).extend(_data_files(d))
        if not steps:  # one step: the directory's files (named after its step, if the directory is)
            own = _step_number(path.name)
            return {UNNUMBERED if own is None else own: flat} if flat else {}
        unnamed = [f.name for f in flat if _step_number(f.name) is None]
        if unnamed:
            raise ConfigError(
                f"{path} holds per-step files (step_<N>) and {', '.join(unnamed[:3])}, which names no step",
                hint="name each file after its step (step_<N>.jsonl) or move the others out (docs/dump-format.md)",
            )
        return {s: sorted(files) for s, files in sorted(steps.items())}

    def _check_columns(self, f: Path, names: list[str]) -> None:
        missing = [c for c in REQUIRED if c not in names]
        if missing:
            raise ConfigError(
                f"{f} lacks the column(s) {', '.join(missing)}",
                hint="a generic dump has token_ids, model_mask and logp_engine per sample (docs/dump-format.md)",
            )
        if "logp_trainer" in names:
            self.has_trainer = True

    def read_samples(self) -> Iterator[DumpSample]:
        for f in self.files:
            rows = _parquet_rows(f) if SUFFIXES[f.suffix] == "parquet" else _jsonl_rows(f, self)
            for k, row in rows:
                yield _sample(row, f"{f.name}, row {k}")

    def sample_columns(self) -> Iterator[SampleColumns] | None:
        """Parquet's record batches as flat columns (a step of Parquet files alone)."""
        if any(SUFFIXES[f.suffix] != "parquet" for f in self.files):
            return None
        return (_columns(batch, f, k) for f in self.files for k, batch in _parquet_batches(f))


def _data_files(directory: Path) -> list[Path]:
    return sorted(f for f in directory.iterdir() if f.suffix in SUFFIXES and f.is_file())


def _step_number(name: str) -> int | None:
    """The N of ``step_<N>`` in a name."""
    match = STEP_NAME.search(name)
    return int(match.group(1)) if match else None


def _step_of(f: Path) -> int | None:
    """The step a data file's name says, or its directory's (``step_120/rank0.jsonl``); None: neither."""
    own = _step_number(f.name)
    return own if own is not None else _step_number(f.parent.name)


def _parquet_columns(f: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(f).names
    except Exception as exc:  # not Parquet, truncated
        raise ConfigError(f"{f} is not a readable Parquet file ({exc})") from None


def _parquet_batches(f: Path) -> Iterator[tuple[int, Any]]:
    """(the first row's number, the record batch) of the columns a sample reads."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(f)
    wanted = [c for c in COLUMNS if c in parquet.schema_arrow.names]
    k = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=wanted):
        yield k, batch
        k += batch.num_rows


def _parquet_rows(f: Path) -> Iterator[tuple[int, dict]]:
    for k, batch in _parquet_batches(f):
        yield from _batch_rows(batch, k)


def _batch_rows(batch, k: int) -> Iterator[tuple[int, dict]]:
    columns = {name: _rows_of(batch.column(name)) for name in batch.schema.names}
    for i in range(batch.num_rows):
        yield k + i, {name: rows(i) for name, rows in columns.items()}


def _columns(batch, f: Path, k: int) -> SampleColumns:
    """A record batch as :class:`SampleColumns` (its rows numbered from ``k``)."""
    return SampleColumns(
        batch.num_rows,
        lambda: (_sample(row, f"{f.name}, row {i}") for i, row in _batch_rows(batch, k)),
        _flat_samples(batch),
    )


def _flat_samples(batch) -> FlatSamples | None:
    """The batch's columns laid flat, where every row has the plain form; None otherwise."""
    names = batch.schema.names
    if "turn" in names and batch.column("turn").null_count < batch.num_rows:
        return None
    if any(name not in names for name in (*REQUIRED, "logp_trainer")):
        return None
    ids, mask, engine, trainer = (
        _flat(batch.column(n)) for n in ("token_ids", "model_mask", "logp_engine", "logp_trainer")
    )
    if ids is None or mask is None or engine is None or trainer is None:
        return None
    if ids[0].dtype.kind not in "iu" or mask[0].dtype.kind not in "iufb" or not np.array_equal(ids[1], mask[1]):
        return None
    is_model = mask[0] if mask[0].dtype == bool else mask[0] != 0  # as astype(bool): NaN is true
    return FlatSamples(ids[1], ids[0], is_model, engine[0], engine[1], trainer[0], trainer[1])


def _flat(column) -> tuple[np.ndarray, np.ndarray] | None:
    """(the values, the offsets from 0) of a column of lists of numbers with no null row; None for
    any other (see :func:`_list_values`, or a null list)."""
    got = None if column.null_count else _list_values(column)
    if got is None or got[0].dtype.kind not in "iufb":
        return None
    flat, offsets = got
    return flat[offsets[0] : offsets[-1]], offsets - offsets[0]


def _list_values(column) -> tuple[np.ndarray, np.ndarray] | None:
    """(the batch's values as NumPy, the offsets into them) of a list column; None for a column of
    anything else, of nested lists, or with a null among integers or booleans (to_numpy would make
    them floats or objects)."""
    import pyarrow as pa

    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return None
    values = column.values  # the whole batch's (a sliced column's offsets index into them)
    nested = pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
    if nested or (values.null_count and not pa.types.is_floating(values.type)):
        return None
    return values.to_numpy(zero_copy_only=False), column.offsets.to_numpy().astype(np.int64)


def _rows_of(column) -> Callable[[int], Any]:
    """Row ``i`` of an Arrow column, converted a batch at a time: a NumPy array for lists of numbers
    (no Python objects per token), a slice of the batch's values; Python values otherwise."""
    import pyarrow as pa

    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
        return column.to_pylist().__getitem__
    got = _list_values(column)
    if got is None:  # nested lists, or a null among ints or booleans: row by row, as before
        return lambda i: _value(column, i)
    flat, offsets = got
    valid = column.is_valid().to_numpy(zero_copy_only=False) if column.null_count else None

    def row(i: int):
        if valid is not None and not valid[i]:
            return None
        return flat[offsets[i] : offsets[i + 1]]

    return row


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
    for n, line in jsonl.lines(f):
        row = jsonl.loads(line, f"{f}:{n}")
        if not isinstance(row, dict):
            raise ConfigError(f"{f}:{n}: not a JSON object")
        if n == 1:
            reader._check_columns(f, list(row))
        yield n - 1, row


def _sample(row: dict, where: str) -> DumpSample:
    for name in REQUIRED:
        if row.get(name) is None:
            raise ConfigError(f"{where}: no {name}", hint="see docs/dump-format.md")
    experts = row.get("routed_experts")
    prompt_id = row.get("prompt_id")
    return DumpSample(
        where=where,
        token_ids=_ints(row["token_ids"]),
        model_mask=_mask(row["model_mask"]),
        logp_engine=_floats(row["logp_engine"], where, "logp_engine"),
        logp_trainer=None if row.get("logp_trainer") is None else _floats(row["logp_trainer"], where, "logp_trainer"),
        turn=None if row.get("turn") is None else np.asarray(row["turn"]),
        experts=None if experts is None else np.asarray(experts),
        prompt_id=None if prompt_id is None else str(prompt_id),
        finish_reason=row.get("finish_reason"),
    )


def _floats(values, where: str, key: str) -> np.ndarray:
    try:
        return jsonl.floats(values)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key} is not a list of numbers") from None


def _mask(values) -> np.ndarray:
    """A mask: a JSON list as booleans (not 0), or Parquet's NumPy array as it is."""
    return jsonl.flags(values) if isinstance(values, list) else np.asarray(values)


def _ints(values) -> np.ndarray:
    """Token ids: a JSON list (parsed fast), or Parquet's NumPy array as it is."""
    return jsonl.ints(values) if isinstance(values, list) else np.asarray(values)

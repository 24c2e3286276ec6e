"""A timeline directory's step files: one Parquet file per analysed step, and steps.parquet.

A step's rows are written once, atomically, to ``steps/step-NNNNNNNN.parquet``, with the step's
source fingerprint (its files' names, sizes and modification times, and the options that decide its
rows) in the file's metadata. A re-run keeps every step whose fingerprint is unchanged and analyses
only the others, so a killed import loses at most the steps in flight, and a live run's new steps
cost only themselves. ``steps.parquet`` is rebuilt from the step files (sorted by step) after each
pass: the same steps give the same file, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.analysis.timeline import STEP_SCHEMA, rows_table
from mismatch_probe.files import atomic_path
from mismatch_probe.timeline_record import STEP_PARTS, STEPS_PARQUET, step_name

FINGERPRINT_KEY = b"mismatch_probe.step_source"


def part_path(out: Path, step: int) -> Path:
    return out / STEP_PARTS / f"{step_name(step)}.parquet"


def write_step(out: Path, step: int, rows: list[dict], fingerprint: str) -> Path:
    """The rows of one step, with the fingerprint of what they were computed from."""
    table = rows_table(rows)
    table = table.replace_schema_metadata({FINGERPRINT_KEY: fingerprint.encode()})
    path = part_path(out, step)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def done_steps(out: Path) -> dict[int, str]:
    """Every analysed step with its source fingerprint (a step file from an older schema: none)."""
    done: dict[int, str] = {}
    for f in sorted((out / STEP_PARTS).glob("step-*.parquet")):
        try:
            step = int(f.stem.removeprefix("step-"))
            schema = pq.read_schema(f)
        except (ValueError, OSError, pa.ArrowInvalid):
            continue  # not a step file, or a truncated one: analysed again
        meta = schema.metadata or {}
        if schema.remove_metadata() == STEP_SCHEMA and FINGERPRINT_KEY in meta:
            done[step] = meta[FINGERPRINT_KEY].decode()
    return done


def consolidate(out: Path) -> pa.Table:
    """steps.parquet from the step files, sorted by step, written atomically; returns the table."""
    files = [part_path(out, step) for step in sorted(done_steps(out))]
    table = (
        pa.concat_tables([pq.read_table(f).replace_schema_metadata(None) for f in files])
        if files
        else STEP_SCHEMA.empty_table()
    )
    with atomic_path(out / STEPS_PARQUET) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return table


def read_steps(out: Path) -> pa.Table:
    path = out / STEPS_PARQUET
    return pq.read_table(path) if path.is_file() else STEP_SCHEMA.empty_table()


def source_fingerprint(files: list[Path], options: dict) -> str:
    """What decides a step's rows: its files (name, size, modification time) and the options."""
    import hashlib

    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    payload = json.dumps({"files": stats, "options": options}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]

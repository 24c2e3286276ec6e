"""On-disk layout of a run: rollout shards from the engine, the per-token table, atomic writes.

A run directory::

    run.json              spec, environment, metrics (written last; the source of truth)
    rollouts/part-*.parquet   one row per sample, as the engine produced it (lists of ids)
    tokens.parquet/part-*.parquet   one row per token (ARCHITECTURE.md, Per-token table), whole sequences per shard

Shards are written to a temporary name and renamed, so a crash or Ctrl-C leaves only complete
shards, and a re-run with the same spec skips them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.files import atomic_path
from mismatch_probe.record import SEQUENCES_PARQUET

ROLLOUTS_DIR = "rollouts"
# rollouts/.received/: a remote engine's answers as they arrived, until their shards are written
# (a dot-directory, which Arrow's readers skip)
RECEIVED_DIR = ".received"
TOKENS_DIR = "tokens.parquet"

# One row per token of every sequence (ARCHITECTURE.md, Per-token table).
TOKEN_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.int64(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("turn", pa.int16(), nullable=False),
        pa.field("position", pa.int32(), nullable=False),
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("is_model_token", pa.bool_(), nullable=False),
        pa.field("logp_infer", pa.float32()),
        pa.field("logp_train", pa.float32()),
        pa.field("entropy_train", pa.float32()),
        # the engine's own log-prob of the token from a prefill over the whole sequence (raw logits);
        # null where the engine did not re-score (decode-vs-prefill check off or not comparable)
        pa.field("logp_prefill", pa.float32()),
        # MoE only: the sorted top-k expert ids of every MoE layer behind the token's probability,
        # on each side, as little-endian int16 [moe_layers x k] bytes (np.frombuffer(b, "<i2"));
        # null on non-model tokens and for dense models. Binary, not list<int16>: Parquet decodes
        # it ~10x faster (no repetition levels per id).
        pa.field("experts_infer", pa.binary()),
        pa.field("experts_train", pa.binary()),
        # imported runs (dumps/): the training framework's own log-prob of the token, when the run
        # was re-scored by the reference (logp_train) and the dump had the trainer's; else null
        pa.field("logp_trainer", pa.float32()),
        # MoE runs whose engine recorded routing (reference.routing_replay): the reference's log-prob
        # with the routing behind each model token forced to the engine's experts (R3: the row of
        # the input before it, in every MoE layer; other positions route freely); else null
        pa.field("logp_train_replay", pa.float32()),
    ]
)

# One row per sample: the engine's output before the reference sees it.
ROLLOUT_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.int64(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("turn", pa.list_(pa.int16()), nullable=False),
        pa.field("is_model_token", pa.list_(pa.bool_()), nullable=False),
        pa.field("logp_infer", pa.list_(pa.float32()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("experts_infer", pa.binary()),  # "<i2" bytes of [model tokens x layers x k], MoE only
        pa.field("logp_prefill", pa.list_(pa.float32())),  # NaN off model tokens; null when not re-scored
        # imported from a dump (dumps/): the training framework's own log-probs; NaN off model tokens
        pa.field("logp_trainer", pa.list_(pa.float32())),
    ]
)


@dataclass
class Rollout:
    """One sampled sequence: prompt and response ids with the engine's log-probs.

    ``logp_infer`` is NaN on tokens the policy did not generate.
    """

    sample_id: int
    prompt_id: str
    token_ids: np.ndarray  # int32, full sequence
    turn: np.ndarray  # int16, -1 on prompt/tool tokens
    is_model_token: np.ndarray  # bool
    logp_infer: np.ndarray  # float32
    finish_reason: str
    experts_infer: np.ndarray | None = None  # int16 [model tokens, moe layers, k]
    logp_prefill: np.ndarray | None = None  # float32, full sequence, NaN off model tokens
    logp_trainer: np.ndarray | None = None  # float32, full sequence, NaN off model tokens (imported)

    @property
    def n_model_tokens(self) -> int:
        return int(self.is_model_token.sum())


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def write_table_atomic(table: pa.Table, path: Path) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def rollouts_to_table(rollouts: list[Rollout]) -> pa.Table:
    return pa.Table.from_pydict(
        {
            "sample_id": [r.sample_id for r in rollouts],
            "prompt_id": [r.prompt_id for r in rollouts],
            "token_ids": [r.token_ids for r in rollouts],
            "turn": [r.turn for r in rollouts],
            "is_model_token": [r.is_model_token for r in rollouts],
            "logp_infer": [r.logp_infer for r in rollouts],
            "finish_reason": [r.finish_reason for r in rollouts],
            "experts_infer": [
                None if r.experts_infer is None else r.experts_infer.astype("<i2").tobytes() for r in rollouts
            ],
            "logp_prefill": [r.logp_prefill for r in rollouts],
            "logp_trainer": [r.logp_trainer for r in rollouts],
        },
        schema=ROLLOUT_SCHEMA,
    )


def list_values(column: pa.ChunkedArray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flat values and offsets of a list column, without Python objects per element."""
    arr = column.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return values[offsets[0] : offsets[-1]], offsets - offsets[0]


def table_to_rollouts(table: pa.Table, routing_width: tuple[int, int] | None = None) -> list[Rollout]:
    """Rollouts from a shard; ``routing_width`` = (moe layers, k) reshapes ``experts_infer``."""
    ids, off = list_values(table.column("token_ids"), np.int32)
    turn, _ = list_values(table.column("turn"), np.int16)
    mask, _ = list_values(table.column("is_model_token"), np.bool_)
    logp, _ = list_values(table.column("logp_infer"), np.float32)
    experts = table.column("experts_infer").to_pylist()
    prefill, prefill_valid = _optional_lists(table.column("logp_prefill"))
    trainer, trainer_valid = _optional_lists(table.column("logp_trainer"))
    out = []
    for i, (sid, pid, fin) in enumerate(
        zip(
            table.column("sample_id").to_pylist(),
            table.column("prompt_id").to_pylist(),
            table.column("finish_reason").to_pylist(),
        )
    ):
        a, b = off[i], off[i + 1]
        ex = None
        if experts[i] is not None and routing_width is not None:
            ex = np.frombuffer(experts[i], dtype="<i2").reshape(-1, *routing_width)
        lp = prefill[a:b] if prefill is not None and prefill_valid[i] else None
        lt = trainer[a:b] if trainer is not None and trainer_valid[i] else None
        out.append(Rollout(sid, pid, ids[a:b], turn[a:b], mask[a:b], logp[a:b], fin, ex, lp, lt))
    return out


def _optional_lists(column: pa.ChunkedArray) -> tuple[np.ndarray | None, np.ndarray]:
    """A nullable float list column's flat values (None when every row is null) and row validity."""
    if column.null_count == len(column):
        return None, np.zeros(len(column), dtype=bool)
    return list_values(column, np.float32)[0], column.is_valid().to_numpy(zero_copy_only=False)


def read_rollout_shard(path: Path, routing_width: tuple[int, int] | None = None) -> list[Rollout]:
    return table_to_rollouts(pq.read_table(path, schema=ROLLOUT_SCHEMA), routing_width)


def _experts_column(parts: list[np.ndarray | None], model: np.ndarray) -> pa.Array:
    """One binary value per token: a model token's [layers x k] ids as "<i2" bytes; null elsewhere."""
    present = [p for p in parts if p is not None]
    if not parts or len(present) < len(parts):
        return pa.nulls(len(model), pa.binary())
    flat = np.concatenate([p.reshape(len(p), -1) for p in present]).astype("<i2")
    row_bytes = np.where(model, flat.shape[1] * 2, 0)
    offsets = np.concatenate([[0], np.cumsum(row_bytes)]).astype(np.int32)
    validity = np.packbits(model, bitorder="little")
    return pa.BinaryArray.from_buffers(
        pa.binary(),
        len(model),
        [pa.py_buffer(validity), pa.py_buffer(offsets), pa.py_buffer(flat.tobytes())],
        null_count=int((~model).sum()),
    )


def token_table(
    rollouts: list[Rollout],
    logp_train: list[np.ndarray],
    entropy_train: list[np.ndarray],
    experts_train: list[np.ndarray | None] | None = None,
    logp_trainer: list[np.ndarray | None] | None = None,
    *,
    logp_replay: list[np.ndarray] | None = None,
) -> pa.Table:
    """Explode scored rollouts into the per-token table (vectorized over the whole shard).
    ``logp_trainer``: a dump's trainer log-probs beside the reference's (None: a null column);
    ``logp_replay``: the reference's with the engine's routing replayed (``Scores.logp_replay``)."""
    lengths = np.array([len(r.token_ids) for r in rollouts], dtype=np.int64)
    total = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    position = (np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)).astype(np.int32)

    def cat(parts, dtype):
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    model = cat([r.is_model_token for r in rollouts], np.bool_)
    logp_infer = cat([r.logp_infer for r in rollouts], np.float32)
    lt = cat(logp_train, np.float32)
    ent = cat(entropy_train, np.float32)
    prefill = cat(
        [
            r.logp_prefill if r.logp_prefill is not None else np.full(len(r.token_ids), np.nan, np.float32)
            for r in rollouts
        ],
        np.float32,
    )
    trainer = cat(
        [
            t if t is not None else np.full(len(r.token_ids), np.nan, np.float32)
            for r, t in zip(rollouts, logp_trainer or [None] * len(rollouts))
        ],
        np.float32,
    )
    replay = cat(logp_replay, np.float32) if logp_replay is not None else np.full(len(model), np.nan, np.float32)
    prompt_ids = pa.DictionaryArray.from_arrays(
        pa.array(np.repeat(np.arange(len(rollouts), dtype=np.int32), lengths)),
        pa.array([r.prompt_id for r in rollouts], pa.string()),
    ).cast(pa.string())
    return pa.Table.from_arrays(
        [
            pa.array(np.repeat(np.array([r.sample_id for r in rollouts], dtype=np.int64), lengths)),
            prompt_ids,
            pa.array(cat([r.turn for r in rollouts], np.int16)),
            pa.array(position),
            pa.array(cat([r.token_ids for r in rollouts], np.int32)),
            pa.array(model),
            pa.array(logp_infer, mask=~model),
            pa.array(lt, mask=np.isnan(lt)),
            pa.array(ent, mask=np.isnan(ent)),
            pa.array(prefill, mask=np.isnan(prefill) | ~model),
            _experts_column([r.experts_infer for r in rollouts], model),
            _experts_column(experts_train or [None] * len(rollouts), model),
            pa.array(trainer, mask=np.isnan(trainer) | ~model),
            pa.array(replay, mask=np.isnan(replay) | ~model),
        ],
        schema=TOKEN_SCHEMA,
    )


def piece_name(index: int, group: int, groups: int) -> str:
    """The scores one data-parallel group wrote for shard ``index`` (merged by :func:`merge_pieces`)."""
    return f"part-{index:05d}.dp{group}of{groups}.parquet"


def merge_pieces(pieces: list[pa.Table], sample_ids: list[int]) -> pa.Table:
    """One shard's token table from its data-parallel pieces, in the shard's own sample order
    (each piece holds whole samples, their rows in position order): the table one process writes."""
    table = pa.concat_tables(pieces)
    ids = np.asarray(sample_ids, dtype=np.int64)
    by_id = np.argsort(ids, kind="stable")
    sids = table.column("sample_id").to_numpy()
    at = np.minimum(np.searchsorted(ids[by_id], sids), max(len(ids) - 1, 0))
    held = sum(len(np.unique(t.column("sample_id").to_numpy())) for t in pieces)  # a sample in two pieces counts twice
    if len(ids) == 0 or not np.array_equal(ids[by_id][at], sids) or held != len(ids):
        raise ValueError(f"the pieces hold {held} samples, not the shard's {len(ids)}")
    key = by_id[at]  # each row's sample's place in the shard
    return table.take(pa.array(np.argsort(key, kind="stable")))


def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """One Parquet file as a table. ``ParquetFile.read``, not ``pq.read_table``: the latter goes
    through pyarrow.dataset, whose first use imports pandas (0.2 s of every command's start)."""
    with pq.ParquetFile(path) as f:
        return f.read(columns=columns)


def shard_paths(run_dir: Path, subdir: str) -> list[Path]:
    d = Path(run_dir) / subdir
    return sorted(d.glob("part-*.parquet")) if d.is_dir() else []


MODEL_TOKEN_COLUMNS = (
    "sample_id",
    "turn",
    "position",
    "logp_infer",
    "logp_train",
    "logp_prefill",
    "experts_infer",
    "experts_train",
    "logp_trainer",
    "logp_train_replay",
)
# absent from older tables: logp_prefill before schema version 2, logp_trainer before imports,
# logp_train_replay before routing replay
OPTIONAL_COLUMNS = ("logp_prefill", "logp_trainer", "logp_train_replay")
EXPERT_COLUMNS = ("experts_infer", "experts_train")


def _experts_2d(column: pa.ChunkedArray, keep: np.ndarray) -> np.ndarray | None:
    """Rows ``keep`` of an experts column as int16 [rows, layers * k], or None when all are null."""
    arr = column.combine_chunks().filter(pa.array(keep))
    if len(arr) == 0 or arr.null_count == len(arr):
        return None
    if arr.null_count:
        raise ValueError(f"{arr.null_count} model tokens lack expert ids while others have them")
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    return data.view("<i2").reshape(len(arr), -1)


def iter_model_tokens(run_dir: Path, columns=MODEL_TOKEN_COLUMNS, prefetch: bool = True) -> Iterator[dict[str, Any]]:
    """Yield one dict of NumPy columns per token shard, model tokens only (whole sequences per shard).

    Expert-id columns come back as int16 [tokens, layers * k], or None when the run has none; an
    optional column the table lacks comes back as None; nulls in float columns come back as NaN.
    With ``prefetch``, the next shard is read in a background thread while the caller works on this
    one (Parquet decoding and NumPy both release the GIL), at the cost of one more shard in memory.
    """
    paths = shard_paths(run_dir, TOKENS_DIR)
    if not prefetch or len(paths) < 2:
        yield from (read_model_tokens(path, columns) for path in paths)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-shard") as pool:
        ahead = pool.submit(read_model_tokens, paths[0], columns)
        for path in paths[1:]:
            shard = ahead.result()
            ahead = pool.submit(read_model_tokens, path, columns)
            yield shard
        yield ahead.result()


def read_model_tokens(path: Path, columns=MODEL_TOKEN_COLUMNS) -> dict[str, Any]:
    """One token shard's model tokens, as :func:`iter_model_tokens` yields each."""
    with pq.ParquetFile(path) as f:  # one open: the footer gives the schema, then the columns
        present = set(f.schema_arrow.names)
        wanted = [c for c in columns if c in present or c not in OPTIONAL_COLUMNS]
        t = f.read(columns=list(dict.fromkeys((*wanted, "is_model_token"))))
    keep = t.column("is_model_token").to_numpy(zero_copy_only=False)
    return {
        c: None
        if c not in wanted
        else _experts_2d(t.column(c), keep)
        if c in EXPERT_COLUMNS
        else t.column(c).to_numpy(zero_copy_only=False)[keep]
        for c in columns
    }


def read_sequences(run_dir: str | Path) -> pa.Table | None:
    """A run's per-sequence table (sequences.parquet), or None for runs older than that file."""
    path = Path(run_dir) / SEQUENCES_PARQUET
    return read_parquet(path) if path.is_file() else None


def write_sequences(run_dir: str | Path, table: pa.Table) -> None:
    write_table_atomic(table, Path(run_dir) / SEQUENCES_PARQUET)

"""The parent <-> engine-worker protocol: JSON header lines, Arrow IPC payloads.

A message is one UTF-8 JSON line; when its ``payload`` field is set, exactly that many bytes of an
Arrow IPC stream follow. Token ids and log-probs travel as Arrow lists (no per-token Python
objects, no JSON floats), so what the parent writes to the rollout shard is bit-identical to what
the engine returned. Both sides import only NumPy and PyArrow from here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from mismatch_probe.engines.base import Completion, GenerationRequest, ScoreRequest

PROTOCOL_VERSION = 2  # 2: the start reply carries the adapter's capabilities


@dataclass
class Message:
    header: dict
    table: pa.Table | None = None


def send(stream: BinaryIO, header: dict, table: pa.Table | None = None) -> None:
    payload = b""
    if table is not None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        payload = sink.getvalue().to_pybytes()
        header = {**header, "payload": len(payload)}
    stream.write(json.dumps(header).encode() + b"\n" + payload)
    stream.flush()


def receive(stream: BinaryIO) -> Message | None:
    """The next message, or None at end of stream (the other side is gone)."""
    line = stream.readline()
    if not line:
        return None
    header = json.loads(line)
    size = header.get("payload")
    if not size:
        return Message(header)
    data = _read_exactly(stream, size)
    if data is None:
        return None
    return Message(header, pa.ipc.open_stream(pa.py_buffer(data)).read_all())


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _lists(arrays: list[np.ndarray], dtype) -> pa.Array:
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _unlist(column: pa.ChunkedArray, dtype) -> list[np.ndarray]:
    arr = column.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(arr))]


def requests_to_table(requests: list[GenerationRequest]) -> pa.Table:
    return pa.table(
        {
            "prompt_token_ids": _lists([r.prompt_token_ids for r in requests], np.int32),
            "max_tokens": pa.array([r.max_tokens for r in requests], pa.int32()),
            "messages": pa.array(
                [None if r.messages is None else json.dumps(r.messages) for r in requests], pa.string()
            ),
        }
    )


def table_to_requests(table: pa.Table) -> list[GenerationRequest]:
    ids = _unlist(table.column("prompt_token_ids"), np.int32)
    return [
        GenerationRequest(p, int(m), None if chat is None else json.loads(chat))
        for p, m, chat in zip(ids, table.column("max_tokens").to_pylist(), table.column("messages").to_pylist())
    ]


def completions_to_table(completions: list[Completion]) -> pa.Table:
    echoed = [c.prompt_token_ids for c in completions]
    experts = [c.experts for c in completions]
    return pa.table(
        {
            "token_ids": _lists([c.token_ids for c in completions], np.int32),
            "logprobs": _lists([c.logprobs for c in completions], np.float32),
            "finish_reason": pa.array([c.finish_reason for c in completions], pa.string()),
            "prompt_token_ids": pa.array(
                [None if e is None else e.astype(np.int32) for e in echoed], pa.list_(pa.int32())
            ),
            "experts": pa.array([None if e is None else e.astype("<i2").tobytes() for e in experts], pa.binary()),
            "experts_shape": pa.array(
                [None if e is None else list(e.shape[1:]) for e in experts], pa.list_(pa.int32())
            ),
        }
    )


def table_to_completions(table: pa.Table) -> list[Completion]:
    tokens = _unlist(table.column("token_ids"), np.int32)
    logprobs = _unlist(table.column("logprobs"), np.float32)
    out = []
    for i, (reason, echoed, experts, shape) in enumerate(
        zip(
            table.column("finish_reason").to_pylist(),
            table.column("prompt_token_ids").to_pylist(),
            table.column("experts").to_pylist(),
            table.column("experts_shape").to_pylist(),
        )
    ):
        out.append(
            Completion(
                token_ids=tokens[i],
                logprobs=logprobs[i],
                finish_reason=reason,
                prompt_token_ids=None if echoed is None else np.asarray(echoed, np.int32),
                experts=None if experts is None else np.frombuffer(experts, "<i2").reshape(-1, *shape),
            )
        )
    return out


def score_requests_to_table(requests: list[ScoreRequest]) -> pa.Table:
    return pa.table(
        {
            "token_ids": _lists([r.token_ids for r in requests], np.int32),
            "start": pa.array([r.start for r in requests], pa.int32()),
        }
    )


def table_to_score_requests(table: pa.Table) -> list[ScoreRequest]:
    ids = _unlist(table.column("token_ids"), np.int32)
    return [ScoreRequest(t, int(s)) for t, s in zip(ids, table.column("start").to_pylist())]


def logprobs_to_table(logprobs: list[np.ndarray]) -> pa.Table:
    return pa.table({"logprobs": _lists(logprobs, np.float32)})


def table_to_logprobs(table: pa.Table) -> list[np.ndarray]:
    return _unlist(table.column("logprobs"), np.float32)

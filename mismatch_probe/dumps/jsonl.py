"""JSON Lines as the dump readers parse them (NeMo-RL's training-data log, prime-rl's token
exports, the generic format): one object per line, read as bytes and decoded by msgspec (3-4x the
standard library's ``json``; orjson is as fast, and msgspec also decodes prime-rl's msgpack and
can skip the members a reader does not read), its per-token lists made NumPy arrays in one pass
by ``np.fromiter`` (integers through ``array``, masks through ``bytes``: C loops that refuse
anything else, which then takes the general path). benchmarks/bench_json_parse.py measures the choice.

Python's ``json.dumps`` writes ``NaN``, ``Infinity`` and ``-Infinity`` unless told not to (NeMo-RL's
logger lets it), which strict JSON parsers refuse; a line msgspec refuses is parsed
again by the standard library, so such a line parses as it always did (at the cost of two parses,
for that line alone), and a line that is no JSON at all gets the standard library's message.
"""

from __future__ import annotations

import array
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from mismatch_probe.errors import ConfigError

PARSER = "msgspec.json"
_DECODE = msgspec.json.Decoder().decode
READ_BUFFER = 1 << 20


def lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number from 1, line)`` for every line of ``path`` that is not blank."""
    # a 1 MiB buffer: a row of thousands of tokens is read whole, not 8 KiB at a time and joined
    with open(path, "rb", buffering=READ_BUFFER) as fh:
        for k, line in enumerate(fh, 1):
            if line.strip():
                yield k, line


def keeping(keys: Iterable[str]) -> Callable[[bytes], dict[str, Any]]:
    """A decoder of one JSON object that builds ``keys`` alone: every other member (NeMo-RL's
    ``advantages``, the half of prime-rl's export columns that are diagnostics) is skipped
    unparsed. A key the line lacks is absent from the dict; a line that is no object is refused."""
    names = tuple(keys)
    row = msgspec.defstruct("Row", [(k, Any, msgspec.UNSET) for k in names])
    decode = msgspec.json.Decoder(row).decode

    def decoded(line: bytes) -> dict[str, Any]:
        r = decode(line)
        return {k: v for k in names if (v := getattr(r, k)) is not msgspec.UNSET}

    return decoded


def loads(line: bytes, where: str, decode: Callable[[bytes], Any] = _DECODE) -> Any:
    """One line's value (through ``decode``, e.g. :func:`keeping`'s); ``where`` ("file:line")
    names it in the error."""
    try:
        return decode(line)
    except msgspec.DecodeError:  # validation errors too (a line that is no object)
        pass  # NaN or Infinity; or broken, and the standard library's message says where
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not JSON ({getattr(exc, 'msg', exc)})") from None


def floats(values: Any) -> np.ndarray:
    """A flat float64 array of a JSON list of numbers (``null``: NaN)."""
    if isinstance(values, list):
        try:
            return np.fromiter(values, np.float64, len(values))
        except (TypeError, ValueError):  # nested lists, or not numbers: asarray's rules and errors
            pass
    return np.asarray(values, dtype=np.float64).reshape(-1)


def ints(values: Any) -> np.ndarray:
    """A flat int64 array of a JSON list of integers. A list holding anything else (1.5, null)
    comes back as float64, which the sample's checks refuse, naming it (a cast would truncate)."""
    if isinstance(values, list):
        try:  # ints and booleans alone: array's C loop (a float, null or list raises)
            return np.frombuffer(array.array("q", values), np.int64)
        except (TypeError, OverflowError):
            pass
    v = floats(values)
    with np.errstate(invalid="ignore"):
        whole = v.astype(np.int64)
    return whole if np.array_equal(whole, v) else v


def flags(values: Any) -> np.ndarray:
    """A flat bool array of a JSON list of 0/1 or booleans (a mask): true where an entry is not
    0, as ``floats(values) != 0`` (NaN: true)."""
    if isinstance(values, list):
        try:  # integers 0-255 and booleans alone: bytes' C loop (anything else raises)
            return np.frombuffer(bytes(values), np.uint8) != 0
        except (TypeError, ValueError):
            pass
    return floats(values) != 0

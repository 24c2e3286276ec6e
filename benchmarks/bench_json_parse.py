"""JSON Lines dumps (NeMo-RL's log, prime-rl's token export, the generic format): parsers' tokens/s.

    python benchmarks/bench_json_parse.py [--rows 256] [--width 4096] [--repeat 5] [--clock cpu|wall]

Writes one step as NeMo-RL's ``train_data_step{N}.jsonl``, as prime-rl's token export
(``token_exports/step_N/rank_r.jsonl``) and as the generic format's JSON Lines (the writers of the
import tests, tests/dumps/training_run.py: NeMo-RL's rows right-padded to the batch's longest,
log-probs as Python floats of float32 values; prime-rl's 17 per-token columns, of which a reader
needs 4; the generic rows with ``null`` off model tokens), then times, best of ``--repeat`` (CPU time of this process by default, which other
work on the machine does not inflate; ``--clock wall`` for wall time), in this one process:

- each parser on every line, alone (``parse``) and with the per-token lists made NumPy arrays
  (``+ numpy``: ``np.fromiter``, what the readers do, and ``np.asarray`` beside it); msgspec also
  decoding only the members a reader reads (``fields read``: ``jsonl.keeping``, the others skipped);
- ``pyarrow.json`` reading the whole file with an explicit schema of the same fields (no lines);
- the reader itself, ``open_dump(...).samples()``, with its parser and with the standard library's
  ``json.loads`` and ``np.asarray`` in their place (how the readers parsed before).

Tokens are the token ids in the file (NeMo-RL's padding included) for the parsers, the unpadded
tokens of the samples for the readers. Each ratio is against the standard library doing the same
(``json.loads``; ``json.loads`` and ``np.asarray``; the reader as it parsed before).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "dumps")]

import smoke  # benchmarks/smoke.py: the --smoke flag
from training_run import Sequence, Step, write_generic, write_nemo_rl, write_prime_rl

SMOKE = {"rows": 8, "width": 512, "repeat": 1}

# the per-token fields each reader turns into arrays: (key, dtype)
FIELDS = {
    "nemo-rl": [
        ("token_ids", np.int64),
        ("token_loss_mask", np.int64),
        ("generation_logprobs", np.float64),
        ("prev_logprobs", np.float64),
    ],
    "prime-rl": [
        ("token_ids", np.int64),
        ("loss_mask", np.bool_),  # JSON booleans
        ("inference_logprobs", np.float64),
        ("trainer_logprobs", np.float64),
    ],
    "generic": [
        ("token_ids", np.int64),
        ("model_mask", np.int64),
        ("logp_engine", np.float64),
        ("logp_trainer", np.float64),
    ],
}


def synthetic_step(rows: int, width: int, seed: int = 0) -> Step:
    """Rows of ``width / 2`` to ``width`` tokens (200 of prompt, a tool's 40 inside every other
    response), float32 log-probs."""
    rng = np.random.default_rng(seed)
    sequences = []
    for k in range(rows):
        n = int(rng.integers(width // 2, width))
        mask = np.r_[np.zeros(200, bool), np.ones(n - 200, bool)]
        if k % 2:
            mask[400:440] = False
        engine = -rng.exponential(0.7, n).astype(np.float32)
        trainer = (engine + rng.normal(0, 0.01, n)).clip(max=0).astype(np.float32)
        engine[~mask], trainer[~mask] = np.nan, np.nan
        sequences.append(Sequence(f"p-{k // 8}", 200, rng.integers(0, 150_000, n), mask, engine, trainer))
    return Step(sequences)


def parsers(fields) -> dict[str, Callable[[bytes], Any]]:
    """Each installed parser, as a function of one line."""
    out: dict[str, Callable[[bytes], Any]] = {"json (stdlib)": json.loads}
    if importlib.util.find_spec("orjson"):
        import orjson

        out["orjson"] = orjson.loads
    if importlib.util.find_spec("msgspec"):
        import msgspec

        from mismatch_probe.dumps import jsonl

        out["msgspec.json"] = msgspec.json.Decoder().decode
        out["msgspec.json, fields read"] = jsonl.keeping(key for key, _ in fields)
    return out


def first(value: Any) -> Any:
    """NeMo-RL keeps the batch's leading dimension of 1: ``[[...]]`` -> ``[...]``."""
    return value[0] if value and isinstance(value[0], list) else value


def to_numpy_fromiter(row: dict, fields) -> int:
    arrays = []
    for key, dtype in fields:
        values = first(row[key])
        try:
            arrays.append(np.fromiter(values, dtype, len(values)))
        except TypeError:  # null among the floats: NaN
            arrays.append(np.asarray(values, dtype=dtype))
    return len(arrays[0])


def to_numpy_asarray(row: dict, fields) -> int:
    arrays = [np.asarray(first(row[key]), dtype=dtype) for key, dtype in fields]
    return len(arrays[0])


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
CLOCK = CLOCKS["cpu"]


def best(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of ``repeat`` runs, each after a collection (the previous run's garbage is not
    this one's)."""
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times)


def each(lines: list[bytes], fn: Callable[[bytes], Any]) -> None:
    """``fn`` on every line, keeping nothing (as a reader holds one row at a time)."""
    for line in lines:
        fn(line)


def pyarrow_read(path: Path, fields) -> None:
    import pyarrow as pa
    import pyarrow.json as pj

    nested = path.name.startswith("train_data")  # NeMo-RL: [[...]]

    def typ(dtype):
        inner = pa.list_({np.int64: pa.int64(), np.bool_: pa.bool_()}.get(dtype, pa.float64()))
        return pa.list_(inner) if nested else inner

    schema = pa.schema([(key, typ(dtype)) for key, dtype in fields])
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    table = pj.read_json(path, parse_options=options)
    for key, _ in fields:
        column = table.column(key).combine_chunks().flatten()
        (column.flatten() if nested else column).to_numpy(zero_copy_only=False)


def reader_samples(fmt: str, path: Path) -> int:
    from mismatch_probe.dumps import get_format, open_dump

    return sum(len(s.token_ids) for s in open_dump(get_format(fmt), path).samples())


def stdlib_readers():
    """The readers as they parsed before: ``json.loads`` per line, ``np.asarray`` per list."""
    from mismatch_probe.dumps import jsonl

    saved = (jsonl.loads, jsonl.floats, jsonl.ints)

    def restore() -> None:
        jsonl.loads, jsonl.floats, jsonl.ints = saved

    jsonl.loads = lambda line, where, decode=None: json.loads(line)
    jsonl.floats = lambda values: np.asarray(values, dtype=np.float64).reshape(-1)
    jsonl.ints = lambda values: np.asarray(values, dtype=np.int64).reshape(-1)
    return restore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--width", type=int, default=4096, help="the longest row, in tokens")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time (steady on a shared machine; pyarrow's threads are summed); wall",
    )
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    from mismatch_probe.dumps import jsonl

    step = synthetic_step(args.rows, args.width)
    with tempfile.TemporaryDirectory() as tmp:
        write_prime_rl(step, Path(tmp) / "prime", 1, ranks=1, rollouts=False)
        files = {
            "nemo-rl": write_nemo_rl(step, Path(tmp) / "logs"),
            "prime-rl": Path(tmp) / "prime" / "token_exports" / "step_1" / "rank_0.jsonl",
            "generic": write_generic(step, Path(tmp) / "generic.jsonl"),
        }
        for fmt, path in files.items():
            reader_path = path.parent if fmt == "prime-rl" else path
            lines = path.read_bytes().splitlines()
            fields = FIELDS[fmt]
            tokens = sum(len(first(json.loads(line)["token_ids"])) for line in lines)
            print(
                f"\n{fmt}: {path.name}, {len(lines)} rows, {tokens:,} token ids, {path.stat().st_size / 2**20:.1f} MiB"
            )
            rows: list[tuple[str, float, int]] = []
            for name, parse in parsers(fields).items():
                rows.append((f"{name} parse", best(lambda p=parse: each(lines, p), args.repeat), tokens))
                for how, convert in (("fromiter", to_numpy_fromiter), ("asarray", to_numpy_asarray)):
                    seconds = best(lambda p=parse, c=convert: each(lines, lambda x: c(p(x), fields)), args.repeat)
                    rows.append((f"{name} + numpy ({how})", seconds, tokens))
            rows.append(
                ("pyarrow.json.read_json + numpy", best(lambda: pyarrow_read(path, fields), args.repeat), tokens)
            )
            n = reader_samples(fmt, reader_path)
            seconds = best(lambda: reader_samples(fmt, reader_path), args.repeat)
            rows.append((f"reader.samples(), {jsonl.PARSER}", seconds, n))
            restore = stdlib_readers()
            try:
                seconds = best(lambda: reader_samples(fmt, reader_path), args.repeat)
                rows.append(("reader.samples(), json + asarray", seconds, n))
            finally:
                restore()
            # each row against the standard library doing the same: parse alone, parse and NumPy (as the
            # readers did before), the reader
            before = {
                "parse": rows[0][1],
                "numpy": next(r[1] for r in rows if r[0] == "json (stdlib) + numpy (asarray)"),
                "reader": rows[-1][1],
            }
            print(f"{'':46s} {'seconds':>8s} {'M tokens/s':>11s} {'vs json':>8s}")
            for name, seconds, n_tokens in rows:
                kind = "reader" if name.startswith("reader") else "parse" if name.endswith("parse") else "numpy"
                print(f"{name:46s} {seconds:8.3f} {n_tokens / seconds / 1e6:11.2f} {before[kind] / seconds:7.2f}x")


if __name__ == "__main__":
    main()

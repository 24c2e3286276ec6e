"""Prompts sampled from an RL framework's dataset (``frameworks/datasets.py``): rows/s and peak memory.

    python benchmarks/bench_dataset_prompts.py [--rows 1000000] [--n 512] [--tokenizer-rows 20000]

Writes a dataset in verl's Parquet layout (``prompt`` a list<struct<content, role>> of a system and a
user message, beside ``data_source``, ``ability``, ``reward_model`` and ``extra_info`` with a long
reference solution, the columns the prompt does not need), in row groups of 64k rows, and the same
rows as JSON Lines in slime's text layout. Then, each in a fresh interpreter (so its peak resident
memory is its own): ``write_dataset_prompts`` sampling ``--n`` prompts from each, by characters; the
same on a dataset of ``--tokenizer-rows`` rows by the fixture model's tokens (chat template applied);
and, for scale, ``pandas.read_parquet`` of the whole file, what reading it without ``columns=``
holds. Prints rows/s and the peak resident memory (VmHWM) of each, beside that of an interpreter that only
imported pyarrow and the module (reading JSON Lines never imports pyarrow).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import smoke  # benchmarks/smoke.py: the --smoke flag

SMOKE = {"rows": 3000, "n": 32, "tokenizer_rows": 200}
TINY = ROOT / "fixtures" / "models" / "tiny-qwen2"


def write_dataset(directory: Path, rows: int) -> tuple[Path, Path]:
    """verl's Parquet and slime's JSON Lines of the same ``rows`` questions, written in chunks."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
    rng = np.random.default_rng(0)
    words = np.array(
        [
            "the",
            "a",
            "of",
            "to",
            "and",
            "sum",
            "product",
            "prime",
            "number",
            "digit",
            "total",
            "each",
            "many",
            "how",
            "what",
        ]
    )
    parquet, jsonl = directory / "train.parquet", directory / "train.jsonl"
    chunk = 65536
    with pq.ParquetWriter(parquet, pa.schema([("data_source", pa.string()), ("prompt", chat),
                                              ("ability", pa.string()),
                                              ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
                                              ("extra_info", pa.struct([("index", pa.int64()), ("solution", pa.string())]))])) as w, \
            open(jsonl, "w") as fh:  # fmt: skip
        for start in range(0, rows, chunk):
            m = min(chunk, rows - start)
            lengths = rng.lognormal(3.5, 0.8, m).astype(int) + 3
            questions = [" ".join(rng.choice(words, k)) + "?" for k in lengths]
            prompt = [
                [{"content": "Think step by step.", "role": "system"}, {"content": q, "role": "user"}]
                for q in questions
            ]
            table = pa.table(
                {
                    "data_source": ["synthetic"] * m,
                    "prompt": pa.array(prompt, type=chat),
                    "ability": ["math"] * m,
                    "reward_model": [{"ground_truth": "42", "style": "rule"}] * m,
                    "extra_info": [{"index": start + i, "solution": "step " * 100} for i in range(m)],
                }
            )
            w.write_table(table)
            fh.writelines(json.dumps({"input": q, "label": "42", "solution": "step " * 100}) + "\n" for q in questions)
    return parquet, jsonl


# VmHWM, the interpreter's own high-water mark: ru_maxrss would carry over this (parent) process's
# peak through fork and exec on Linux; elsewhere ru_maxrss (KiB on Linux, bytes on macOS)
PEAK = """
def peak_mib():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform != "darwin" else 2**20)
"""

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
{peak}
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
if args["what"] == "pandas":
    import pandas as pd
    rows = len(pd.read_parquet(args["path"]))
    extra = {{}}
else:
    from mismatch_probe.frameworks.datasets import LAYOUTS, write_dataset_prompts
    tokenizer = None
    if args.get("tokenizer"):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args["tokenizer"])
    t0 = time.perf_counter()
    res = write_dataset_prompts(args["path"], args["out"], layout=LAYOUTS[args["layout"]], n=args["n"], tokenizer=tokenizer)
    rows = res.rows
    extra = {{"written": res.written, "skipped": res.skipped, "edges": res.strata_edges, "unit": res.length_unit}}
dt = time.perf_counter() - t0
print(json.dumps({{"rows": rows, "seconds": dt, "peak_mib": peak_mib(), **extra}}))
"""


def child(**args) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD.format(root=str(ROOT), peak=PEAK), json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode:
        sys.exit(f"{args['what']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def baseline_mib() -> float:
    """An interpreter that imported the module and pyarrow, before reading anything."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import pyarrow.parquet, msgspec, numpy\n"
        f"import mismatch_probe.frameworks.datasets\n{PEAK}\nprint(peak_mib())"
    )
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--tokenizer-rows", type=int, default=20_000)
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        t0 = time.perf_counter()
        parquet, jsonl = write_dataset(d, args.rows)
        (d / "small").mkdir()
        small, _ = write_dataset(d / "small", args.tokenizer_rows)
        print(
            f"dataset: {args.rows:,} rows, Parquet {parquet.stat().st_size / 2**20:.0f} MiB, "
            f"JSON Lines {jsonl.stat().st_size / 2**20:.0f} MiB (written in {time.perf_counter() - t0:.1f} s)"
        )
        print(f"baseline interpreter (imports only): {baseline_mib():.0f} MiB peak")
        runs = [
            ("verl Parquet, by characters", {"what": "sample", "path": str(parquet), "layout": "verl"}),
            ("slime JSON Lines, by characters", {"what": "sample", "path": str(jsonl), "layout": "slime"}),
            (
                f"verl Parquet of {args.tokenizer_rows:,} rows, by tokens",
                {"what": "sample", "path": str(small), "layout": "verl", "tokenizer": str(TINY)},
            ),
            ("pandas.read_parquet, every column (for scale)", {"what": "pandas", "path": str(parquet)}),
        ]
        for name, spec in runs:
            got = child(out=str(d / "prompts.jsonl"), n=args.n, **spec)
            line = f"{name}: {got['rows']:,} rows in {got['seconds']:.2f} s = {got['rows'] / got['seconds']:,.0f} rows/s, peak {got['peak_mib']:.0f} MiB"
            if "written" in got:
                line += f"; wrote {got['written']}, strata edges {got['edges']} {got['unit']}"
                assert got["written"] == min(args.n, got["rows"]) and got["skipped"] == 0, got
            print(line)


if __name__ == "__main__":
    main()

"""Importing a training framework's dump: tokens per second and peak memory, at two dump sizes.

    python benchmarks/bench_import.py [--tokens 1000000] [--scale 4] [--formats generic-parquet,nemo-rl,slime]

Writes a synthetic step (prompts of 200 tokens, responses of 300-900 with a tool call in every
other one, bf16-like log-prob noise) in each format, as the writers of the import tests write them
(tests/dumps/training_run.py), then imports it into a run directory in a fresh child process and
reports wall time, tokens/s and peak RSS, at ``--tokens`` and at ``--scale`` times as many: an
import that streams holds one file (slime: one step's .pt, as slime writes it) and one shard of
rollouts at a time, so its peak memory does not grow with the dump.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "dumps")]

import smoke  # benchmarks/smoke.py: the --smoke flag
from training_run import Sequence, Step, write_generic, write_nemo_rl, write_slime

MODEL = ROOT / "fixtures" / "models" / "tiny-qwen2"
# one format at two sizes: 2 imports (each a fresh process that loads the libraries an import needs)
SMOKE = {"tokens": 10_000, "scale": 2, "formats": "generic-parquet"}

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
from mismatch_probe.importing import import_dump
from mismatch_probe.modeling.loading import load_tokenizer
from pathlib import Path

def high_water_mib():  # VmHWM: this process's own peak (ru_maxrss would keep the forking parent's)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024

load_tokenizer(Path({model!r}))  # the libraries an import needs, loaded: the baseline
base = high_water_mib()
t0 = time.perf_counter()
ctx = import_dump({fmt!r}, {path!r}, model={model!r}, out={out!r})
seconds = time.perf_counter() - t0
print(json.dumps({{"seconds": seconds, "tokens": ctx.record.imported_from["tokens"],
                  "peak_mib": high_water_mib(), "baseline_mib": base}}))
"""


def synthetic_step(n_tokens: int, seed: int = 0) -> Step:
    rng = np.random.default_rng(seed)
    sequences, total, k = [], 0, 0
    while total < n_tokens:
        prompt = rng.integers(0, 1024, 200)
        response = rng.integers(0, 1024, int(rng.integers(300, 900)))
        mask = np.r_[np.zeros(200, bool), np.ones(len(response), bool)]
        if k % 2:  # a tool call: 40 tokens of tool output inside the response
            mask[300:340] = False
        ids = np.r_[prompt, response]
        engine = -rng.exponential(0.7, len(ids)).astype(np.float32)
        trainer = (engine + rng.normal(0, 0.01, len(ids))).clip(max=0).astype(np.float32)
        engine[~mask], trainer[~mask] = np.nan, np.nan
        sequences.append(Sequence(f"p-{k // 8}", 200, ids.astype(np.int64), mask, engine, trainer))
        total += len(ids)
        k += 1
    return Step(sequences)


def write(fmt: str, step: Step, d: Path) -> tuple[str, Path]:
    if fmt == "generic-parquet":
        return "generic", write_generic(step, d / "dump.parquet")
    if fmt == "generic-jsonl":
        return "generic", write_generic(step, d / "dump.jsonl")
    if fmt == "nemo-rl":
        return "nemo-rl", write_nemo_rl(step, d / "logs")
    if fmt == "slime":
        write_slime(step, d / "slime")
        return "slime", d / "slime"
    raise SystemExit(f"unknown format {fmt}")


def run_import(fmt: str, path: Path, out: Path) -> dict:
    code = CHILD.format(root=str(ROOT), model=str(MODEL), fmt=fmt, path=str(path), out=str(out))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--scale", type=int, default=4, help="also import a dump this many times larger")
    parser.add_argument("--formats", default="generic-parquet,generic-jsonl,nemo-rl,slime")
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    rows = []
    for fmt in args.formats.split(","):
        for n in (args.tokens, args.tokens * args.scale):
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                name, path = write(fmt, synthetic_step(n), Path(tmp))
                written = time.perf_counter() - t0
                size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
                r = run_import(name, path, Path(tmp) / "run")
                r.update(format=fmt, dump_mib=size / 2**20, write_s=written)
                rows.append(r)
                print(
                    f"{fmt:16s} {r['tokens']:>10,} tokens  dump {r['dump_mib']:7.1f} MiB  import {r['seconds']:6.2f} s  "
                    f"{r['tokens'] / r['seconds'] / 1e6:5.2f} M tokens/s  peak RSS {r['peak_mib']:6.0f} MiB "
                    f"(libraries {r['baseline_mib']:4.0f}, import {r['peak_mib'] - r['baseline_mib']:5.0f})",
                    flush=True,
                )
    print()
    for fmt in args.formats.split(","):
        small, large = [r for r in rows if r["format"] == fmt]
        print(
            f"{fmt:16s} {args.scale}x the tokens: {large['seconds'] / small['seconds']:.2f}x the time, "
            f"{(large['peak_mib'] - large['baseline_mib']) / max(small['peak_mib'] - small['baseline_mib'], 1):.2f}x "
            f"the import's own memory ({large['peak_mib'] / small['peak_mib']:.2f}x peak RSS)"
        )


if __name__ == "__main__":
    main()

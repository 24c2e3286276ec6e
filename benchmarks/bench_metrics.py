"""The analysis pass over a synthetic per-token table: wall time and peak memory, against reading.

    python benchmarks/bench_metrics.py [--tokens 10000000] [--shard-tokens 1000000]
    python benchmarks/bench_metrics.py --scale 10          # and 10x the tokens: linear time, bounded memory
    python benchmarks/bench_metrics.py --tokens 1000000 --moe-layers 48 --top-k 8   # with MoE routing

Writes a synthetic run (responses of 50-2000 tokens, 30% prompt/tool tokens, two turns per
sample) as Parquet shards in a temp directory, then times, each in a fresh child process, reading
the columns the analysis reads (the floor), ``analyze()`` alone, and the whole pass ``compare``
makes (``analyze()`` feeding the report's distributions and sequences.parquet's rows), and reports
wall time and peak RSS (VmHWM: the child starts with only the imports, so it is the pass's own
footprint plus the interpreter and libraries, given as a baseline). ``analyze()`` and the whole
pass run twice, in the same run: compiled (analysis/kernels.py; its loops compiled or loaded from
numba's cache before the clock starts: steady state) and on the NumPy path
(``MISMATCH_PROBE_NO_NUMBA=1``). The first call's cost is reported apart: compiling the loops
into an empty cache, and loading them from the cache (what each new process pays). Targets
(issue 24): the whole pass at most 3x the read; 10x the tokens at most 11x the time and 1.5 GiB;
(issue 56) the compiled analyze() at most 1.5x the read at 10M rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import smoke  # benchmarks/smoke.py: the --smoke flag

from mismatch_probe.table.tokens import TOKEN_SCHEMA, TOKENS_DIR, shard_name, write_table_atomic

SMOKE = {"tokens": 50_000, "shard_tokens": 20_000}  # 3 shards

CHILD = """
import json, re, sys, time
sys.path.insert(0, {root!r})
from mismatch_probe.analysis import kernels, metrics
from mismatch_probe.analysis.analyze import analyze
from mismatch_probe.analysis.distributions import DistributionAccumulator
from mismatch_probe.analysis.sequences import SequenceCollector
from mismatch_probe.table.tokens import iter_model_tokens
def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
# the loops compiled or loaded before the clock: steady state (the read and idle need none)
warm = metrics.warm_up() if {mode!r} in ("analyze", "full", "warm") else 0.0
base = hwm()
t0 = time.perf_counter()
n = 0
routing = {{"moe_layers": list(range({layers})), "top_k": {k}}} if {layers} else None
if {mode!r} == "analyze":
    n = analyze({run!r}, routing=routing)["metrics"]["n_model_tokens"]
elif {mode!r} == "full":
    extras = dict(distributions=DistributionAccumulator(), sequences=SequenceCollector())
    n = analyze({run!r}, routing=routing, **extras)["metrics"]["n_model_tokens"]
elif {mode!r} == "read":
    n = sum(len(s["logp_train"]) for s in iter_model_tokens({run!r}, prefetch=False))
dt = time.perf_counter() - t0
print(json.dumps({{"seconds": dt, "peak_rss_mib": hwm(), "baseline_rss_mib": base, "n_model_tokens": n, "warm_up": warm}}))
"""
# each timed mode, and whether it runs on the NumPy path
MODES = {
    "idle": False,
    "read": False,
    "analyze": False,
    "analyze-numpy": True,
    "full": False,
    "full-numpy": True,
}


def _experts(model, layers: int, k: int, flip: float, rng) -> tuple:
    """Sorted top-k ids per layer for model tokens; the reference differs on a ``flip`` share of rows."""
    import pyarrow as pa

    from mismatch_probe.table.tokens import _experts_column

    if not layers:
        return pa.nulls(len(model), pa.binary()), pa.nulls(len(model), pa.binary())
    n = int(model.sum())
    ei = np.sort(rng.choice(64, size=(n, layers, k)), axis=-1).astype(np.int16)
    et = ei.copy()
    rows = rng.random((n, layers)) < flip
    et[rows, 0] = (et[rows, 0] + 1) % 64
    et = np.sort(et, axis=-1)
    return _experts_column([ei], model), _experts_column([et], model)


def synthetic_table(given: dict, n: int):
    """A table of every column of TOKEN_SCHEMA, in its order: the ``given`` arrays, and every other
    (nullable: logp_prefill, logp_trainer, logp_train_replay, ...) all nulls, so a column the table
    gains needs nothing here."""
    import pyarrow as pa

    missing = [f.name for f in TOKEN_SCHEMA if f.name not in given and not f.nullable]
    if missing:
        raise SystemExit(f"TOKEN_SCHEMA has required columns the synthetic table does not build: {missing}")
    columns = [given[f.name] if f.name in given else pa.nulls(n, f.type) for f in TOKEN_SCHEMA]
    return pa.Table.from_arrays(columns, schema=TOKEN_SCHEMA)


def write_synthetic(run_dir: Path, tokens: int, shard_tokens: int, seed: int = 0, moe: tuple = (0, 0)) -> int:
    import pyarrow as pa

    sys.path.insert(0, str(ROOT))

    rng = np.random.default_rng(seed)
    written, shard, sample = 0, 0, 0
    while written < tokens:
        lengths = []
        while sum(lengths) < min(shard_tokens, tokens - written):
            lengths.append(int(rng.integers(50, 2000)))
        n = sum(lengths)
        sid = np.repeat(np.arange(sample, sample + len(lengths)), lengths)
        starts = np.r_[0, np.cumsum(lengths)[:-1]]
        pos = np.arange(n) - np.repeat(starts, lengths)
        frac = pos / np.repeat(lengths, lengths)
        turn = np.where(frac < 0.2, -1, np.where(frac < 0.6, 0, np.where(frac < 0.7, -1, 1))).astype(np.int16)
        model = turn >= 0
        li = np.log(rng.beta(5, 0.3, n)).astype(np.float32)
        lt = (li + rng.normal(0, 0.01, n)).clip(max=0).astype(np.float32)
        experts_infer, experts_train = _experts(model, *moe, 0.002, rng)
        given = {
            "sample_id": pa.array(sid),
            "prompt_id": pa.array(
                np.repeat(np.array([f"p{i}" for i in range(sample, sample + len(lengths))]), lengths)
            ),
            "turn": pa.array(turn),
            "position": pa.array(pos.astype(np.int32)),
            "token_id": pa.array(rng.integers(0, 150000, n).astype(np.int32)),
            "is_model_token": pa.array(model),
            "logp_infer": pa.array(li, mask=~model),
            "logp_train": pa.array(lt, mask=~model),
            "entropy_train": pa.array(np.zeros(n, np.float32)),
            "experts_infer": experts_infer,
            "experts_train": experts_train,
        }
        t = synthetic_table(given, n)
        write_table_atomic(t, run_dir / TOKENS_DIR / shard_name(shard))
        written += n
        sample += len(lengths)
        shard += 1
    return written


def child(run: str, mode: str, moe: tuple, numpy_path: bool = False, env: dict | None = None) -> dict:
    from mismatch_probe.analysis.kernels import DISABLE_ENV

    code = CHILD.format(root=str(ROOT), run=run, mode=mode.removesuffix("-numpy"), layers=moe[0], k=moe[1])
    env = {**os.environ, **(env or {})}
    env.pop(DISABLE_ENV, None)
    if numpy_path:
        env[DISABLE_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout)


def first_call(compile_too: bool) -> dict:
    """Seconds of the loops' first call in a process: compiled into an empty numba cache (with
    ``compile_too``: it takes a while), and loaded from the cache (what every later process pays)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {"NUMBA_CACHE_DIR": cache} if compile_too else {}
        compiled = child("", "warm", (0, 0), env=env)["warm_up"] if compile_too else None
        return {"compile": compiled, "load": child("", "warm", (0, 0), env=env)["warm_up"]}


def measure(tokens: int, args, moe: tuple) -> dict:
    """Write a synthetic run of ``tokens`` rows and time reading it, analyze() and the whole pass."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        t0 = time.perf_counter()
        # written by a child: the parent stays small, and the children's peaks are their own
        writer = [sys.executable, __file__, "--write-only", str(run), "--tokens", str(tokens)]
        writer += [
            "--shard-tokens",
            str(args.shard_tokens),
            "--moe-layers",
            str(args.moe_layers),
            "--top-k",
            str(args.top_k),
        ]
        total = int(subprocess.run(writer, capture_output=True, text=True, check=True).stdout.split()[-1])
        shards = list((run / "tokens.parquet").iterdir())
        size = sum(p.stat().st_size for p in shards)
        print(
            f"synthetic table: {total:,} rows in {len(shards)} shards, "
            f"{size / 2**20:.0f} MiB on disk, written in {time.perf_counter() - t0:.1f} s"
        )
        out = {mode: child(str(run), mode, moe, numpy_path) for mode, numpy_path in MODES.items()}
        read = out["read"]
        n = out["full"]["n_model_tokens"]
        print(f"  reading the same columns: {read['seconds']:.2f} s, peak RSS {read['peak_rss_mib']:.0f} MiB")
        for mode, what in (("analyze", "analyze()"), ("full", "the whole pass (+ distributions, sequences)")):
            compiled, numpy = out[mode], out[f"{mode}-numpy"]
            print(
                f"  {what}: compiled {compiled['seconds']:.2f} s ({compiled['seconds'] / read['seconds']:.2f}x the "
                f"read, {n / compiled['seconds'] / 1e6:.1f} M tok/s, peak RSS {compiled['peak_rss_mib']:.0f} MiB); "
                f"NumPy {numpy['seconds']:.2f} s ({numpy['seconds'] / read['seconds']:.2f}x the read, "
                f"peak RSS {numpy['peak_rss_mib']:.0f} MiB)"
            )
        print(f"  ({n:,} model tokens; interpreter + imports alone: {out['idle']['peak_rss_mib']:.0f} MiB)")
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--scale", type=int, default=0, help="also measure this many times the tokens, and compare")
    ap.add_argument("--shard-tokens", type=int, default=1_000_000)
    ap.add_argument("--moe-layers", type=int, default=0, help="add expert ids: MoE layers per token (0: dense)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--write-only", help=argparse.SUPPRESS)
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    moe = (args.moe_layers, args.top_k if args.moe_layers else 0)
    if args.write_only:
        print(write_synthetic(Path(args.write_only), args.tokens, args.shard_tokens, moe=moe))
        return
    calls = first_call(compile_too=not args.smoke)
    compiling = "not measured at the smoke size" if calls["compile"] is None else f"{calls['compile']:.1f} s"
    print(
        f"the compiled loops' first call in a process: compiling them into an empty numba cache {compiling}; "
        f"loading them from the cache (every later process) {calls['load']:.2f} s"
    )
    small = measure(args.tokens, args, moe)
    for mode, target in (("analyze", 1.5), ("full", 3.0)):
        ratios = [small[m]["seconds"] / small["read"]["seconds"] for m in (mode, f"{mode}-numpy")]
        print(
            f"{'analyze()' if mode == 'analyze' else 'whole pass'} / read at {args.tokens:,} rows: compiled "
            f"{ratios[0]:.2f}x, NumPy {ratios[1]:.2f}x (target <= {target}x)"
        )
    if args.scale:
        big = measure(args.tokens * args.scale, args, moe)
        growth = big["full"]["seconds"] / small["full"]["seconds"]
        peak = big["full"]["peak_rss_mib"]
        print(
            f"{args.scale}x the rows: {growth:.2f}x the time (target <= {args.scale * 1.1:.0f}x); "
            f"peak RSS {peak:.0f} MiB (target <= 1536 MiB); "
            f"read / read {big['read']['seconds'] / small['read']['seconds']:.2f}x"
        )


if __name__ == "__main__":
    main()

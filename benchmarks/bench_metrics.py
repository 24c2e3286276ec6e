"""Metrics over a synthetic per-token table: wall time and peak memory of `analyze()`.

    python benchmarks/bench_metrics.py [--tokens 10000000] [--shard-tokens 1000000]
    python benchmarks/bench_metrics.py --tokens 1000000 --moe-layers 48 --top-k 8   # with MoE routing

Writes a synthetic run (responses of 50-2000 tokens, 30% prompt/tool tokens, two turns per
sample) as Parquet shards in a temp directory, then times the streaming analysis (and, as a floor, just reading the same
columns) in a fresh child process and reports its wall time and peak RSS (the child starts with only the imports, so its
RSS is the analysis's own footprint plus the interpreter and libraries, given as a baseline).
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
sys.path.insert(0, str(ROOT))

from mismatch_probe.table.tokens import TOKEN_SCHEMA, TOKENS_DIR, shard_name, write_table_atomic

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from mismatch_probe.analysis.analyze import analyze
from mismatch_probe.table.tokens import iter_model_tokens
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
n = 0
if {mode!r} == "analyze":
    routing = {{"moe_layers": list(range({layers})), "top_k": {k}}} if {layers} else None
    n = analyze({run!r}, routing=routing)["metrics"]["n_model_tokens"]
elif {mode!r} == "read":
    n = sum(len(s["logp_train"]) for s in iter_model_tokens({run!r}))
dt = time.perf_counter() - t0
print(json.dumps({{"seconds": dt, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "baseline_rss_mib": base / 1024, "n_model_tokens": n}}))
"""


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
        t = pa.Table.from_arrays(
            [
                pa.array(sid),
                pa.array(np.repeat(np.array([f"p{i}" for i in range(sample, sample + len(lengths))]), lengths)),
                pa.array(turn),
                pa.array(pos.astype(np.int32)),
                pa.array(rng.integers(0, 150000, n).astype(np.int32)),
                pa.array(model),
                pa.array(li, mask=~model),
                pa.array(lt, mask=~model),
                pa.array(np.zeros(n, np.float32)),
                pa.nulls(n, pa.float32()),  # logp_prefill: no engine re-score
                *_experts(model, *moe, 0.002, rng),
                pa.nulls(n, pa.float32()),  # logp_trainer: not an imported run
            ],
            schema=TOKEN_SCHEMA,
        )
        write_table_atomic(t, run_dir / TOKENS_DIR / shard_name(shard))
        written += n
        sample += len(lengths)
        shard += 1
    return written


def child(run: str, mode: str, moe: tuple) -> dict:
    code = CHILD.format(root=str(ROOT), run=run, mode=mode, layers=moe[0], k=moe[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--shard-tokens", type=int, default=1_000_000)
    ap.add_argument("--moe-layers", type=int, default=0, help="add expert ids: MoE layers per token (0: dense)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--write-only", help=argparse.SUPPRESS)
    args = ap.parse_args()
    moe = (args.moe_layers, args.top_k if args.moe_layers else 0)
    if args.write_only:
        print(write_synthetic(Path(args.write_only), args.tokens, args.shard_tokens, moe=moe))
        return
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        t0 = time.perf_counter()
        # written by a child: Linux carries ru_maxrss across fork+exec, so the parent stays small
        writer = [
            sys.executable,
            __file__,
            "--write-only",
            str(run),
            "--tokens",
            str(args.tokens),
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
        idle = child(str(run), "idle", moe)
        read = child(str(run), "read", moe)
        res = child(str(run), "analyze", moe)
        print(
            f"analyze(): {res['seconds']:.2f} s for {res['n_model_tokens']:,} model tokens "
            f"({res['n_model_tokens'] / res['seconds'] / 1e6:.1f} M tok/s); peak RSS {res['peak_rss_mib']:.0f} MiB "
            f"(interpreter + imports alone: {idle['peak_rss_mib']:.0f} MiB)"
        )
        print(
            f"reading the same columns without computing: {read['seconds']:.2f} s, peak RSS "
            f"{read['peak_rss_mib']:.0f} MiB; metrics cost {res['seconds'] / read['seconds']:.1f}x the read"
        )


if __name__ == "__main__":
    main()

"""A timeline's analysis of one training step against deserializing that step's files alone.

    .venv/bin/python benchmarks/bench_timeline.py [--tokens 1000000] [--scale 4] [--repeat 3]
        [--formats generic-parquet,generic-jsonl,nemo-rl,slime,prime-rl,verl]

The bar: ``mismatch-probe timeline``'s import plus analysis of a step takes at most 2x the time of
deserializing that step's files alone, measured in the same run.

Writes one step of ``--tokens`` tokens (bench_import.py's synthetic step: prompts of 200 tokens,
responses of 300-900 with a tool call in every other one) in each format, with the writers of the
import tests (tests/dumps/training_run.py; verl only where ``verl_site()`` finds verl, its batch
saved with ``old_log_probs``, the trainer's side), and with ``--scale`` also a step that many times
larger. Then it measures, each in a fresh process whose libraries (NumPy, Arrow and its dataset
API, msgspec, torch, every reader, the runner, the importer) are imported before its clock starts,
best of ``--repeat`` with the measurements taking turns (a spell of load on the machine falls on
each):

(a) deserializing the step's files alone, the framework's own way: ``pyarrow.parquet.read_table``
    (Parquet); the standard library's ``json.loads`` per line and, beside it, msgspec's decoder per
    line (JSON Lines: NeMo-RL's log, the generic format, prime-rl's token export, whose rollouts
    ``rank_r.bin`` are ``msgspec.msgpack`` of ``list[MicroBatch]``, decoded so in both);
    ``torch.load(weights_only=True)`` of each .pt (slime's rollout and train dumps); the pickle load
    of verl's ``gen_batch.dp`` through ``dumps/safe_pickle.py`` (``load_data_proto``);
(b) ``timeline.runner.analyse_step`` on the step (read with the importers' checks, reduce with the
    bootstrap, write the step's Parquet file), its ``_Task`` built as ``runner._pass`` builds it
    (with ``--model``: token ids checked against the checkpoint's vocabulary): twice, compiled
    (analysis/kernels.py; its loops compiled or loaded from numba's cache before the clock, as the
    libraries are imported: steady state; the first call's cost is printed apart) and on the NumPy
    path (``MISMATCH_PROBE_NO_NUMBA=1``), the column ``(b) np``;
(c) ``importing.import_dump`` of the same step into a run directory (``mismatch-probe import``),
    the tokenizer loaded once before the clock starts, as benchmarks/bench_import.py does.

The ratio (b)/(a) of a JSON Lines format is against msgspec's parse: the faster of the two, the
parser the timeline's readers use, so the ratio is what reading, checking, reducing and writing
add to the parse itself rather than a credit for having changed parsers (against ``json.loads``,
printed beside it, each ratio is smaller). Tokens are the synthetic step's (the environment's 3
closing tokens NeMo-RL's rows add, and their padding, not counted); tokens/s divide them by the
wall time. Beside the ratio of wall times, the ratio of the two processes' CPU times (each
the best of ``--repeat``): other work on the machine inflates it less (Arrow's and torch's threads
count in it, so a multithreaded read counts more than its wall time).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "dumps")]

import smoke  # benchmarks/smoke.py: the --smoke flag
from bench_import import MODEL, synthetic_step
from bench_import import write as write_dump
from training_run import Step, verl_site, write_prime_rl, write_verl

FORMATS = ("generic-parquet", "generic-jsonl", "nemo-rl", "slime", "prime-rl", "verl")
JSONL = ("generic-jsonl", "nemo-rl", "prime-rl")
# one format: prime-rl's JSON Lines (both parsers) and msgpack rollouts; 4 fresh processes
SMOKE = {"tokens": 10_000, "repeat": 1, "formats": "prime-rl"}

# the libraries any measurement needs, imported before its clock starts
CHILD = """
import json, sys, time
from pathlib import Path
sys.path[:0] = [{root!r}, {tests!r}]
import numpy as np, msgspec, pyarrow as pa, pyarrow.parquet as pq, torch
import pyarrow.dataset  # what pq.read_table imports on its first call
from mismatch_probe.analysis import kernels, metrics
from mismatch_probe.dumps import FORMATS, reader_class
from mismatch_probe.dumps.safe_pickle import load_data_proto
from mismatch_probe.importing import ImportOptions, import_dump
from mismatch_probe.timeline import runner, store
from mismatch_probe.timeline.dump_steps import step_files
from training_run import PrimeMicroBatch
for fmt in FORMATS.values():
    reader_class(fmt)  # every reader's module

spec = json.loads({spec!r})
what, files = spec["what"], [Path(f) for f in spec["files"]]


def parse_lines(f, decode):
    with open(f, "rb") as fh:
        for line in fh:
            if line.strip():
                decode(line)


def deserialize(parser):
    decode = json.loads if parser == "json" else msgspec.json.Decoder().decode
    for f in files:
        if f.suffix == ".parquet":
            pq.read_table(f)
        elif f.suffix == ".jsonl":
            parse_lines(f, decode)
        elif f.suffix == ".bin":  # prime-rl's rollouts, as its trainer's receiver decodes them
            msgspec.msgpack.decode(f.read_bytes(), type=list[PrimeMicroBatch])
        elif f.suffix == ".pt":
            torch.load(f, map_location="cpu", weights_only=True)
        elif f.suffix == ".dp":
            load_data_proto(f.read_bytes())
        else:
            raise SystemExit(f"no deserializer for {{f}}")


if what == "import":
    from mismatch_probe.modeling.loading import load_tokenizer

    load_tokenizer(Path(spec["model"]))  # as bench_import.py: the tokenizer's libraries loaded
    options = ImportOptions(trust_pickle=spec["trust_pickle"])

    def run():
        import_dump(spec["format"], spec["path"], model=spec["model"], out=spec["out"], options=options)
elif what == "analyse":
    opts = runner.TimelineOptions(
        format=spec["format"], source=spec["path"], model=spec["model"], out=spec["out"],
        trust_pickle=spec["trust_pickle"],
    )
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    source = runner._source(opts)  # as runner._pass builds a step's task
    (step, step_paths), = step_files(source).items()
    task = runner._Task(
        source, step, store.source_fingerprint(step_paths, source.options), spec["out"], dict(opts.corrections),
        opts.n_boot,
    )

    metrics.warm_up()  # the compiled loops loaded (or, on the NumPy path, nothing)

    def run():
        runner.analyse_step(task)
elif what == "warm":
    def run():
        print(json.dumps({{"warm_up": metrics.warm_up()}}))
else:
    def run():
        deserialize(what.removeprefix("parse-"))
t0, cpu0 = time.perf_counter(), time.process_time()
run()
seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
print(json.dumps({{"seconds": seconds, "cpu": cpu}}))
"""


def write(fmt: str, step: Step, d: Path) -> tuple[str, Path]:
    """The step in ``fmt`` as its framework writes it: (the format's name, the path to import)."""
    if fmt == "prime-rl":
        return "prime-rl", write_prime_rl(step, d / "prime", 3)
    if fmt == "verl":
        return "verl", write_verl(step, d / "verl", gen_step=3, old_log_probs=True)
    return write_dump(fmt, step, d)


def measure(spec: dict, env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one measurement; ``what`` ``analyse-numpy`` is
    ``analyse`` on the NumPy path."""
    from mismatch_probe.analysis.kernels import DISABLE_ENV

    env = {**os.environ, **(env or {})}
    env.pop(DISABLE_ENV, None)
    if spec["what"] == "analyse-numpy":
        spec, env[DISABLE_ENV] = {**spec, "what": "analyse"}, "1"
    done = _child(spec, env)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return float(got["seconds"]), float(got["cpu"])


def _child(spec: dict, env: dict) -> subprocess.CompletedProcess:
    code = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests" / "dumps"), spec=json.dumps(spec))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{spec['what']} of {spec.get('format')} failed:\n{done.stderr[-3000:]}")
    return done


def first_call(compile_too: bool) -> dict:
    """Seconds of the compiled loops' first call in a process: compiled into an empty numba cache
    (with ``compile_too``), and loaded from the cache (what each of the timeline's workers pays once)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache} if compile_too else dict(os.environ)
        spec = {"what": "warm", "files": []}
        seconds = [json.loads(_child(spec, env).stdout.splitlines()[0])["warm_up"] for _ in range(1 + compile_too)]
        return {"compile": seconds[0] if compile_too else None, "load": seconds[-1]}


def bench(fmt: str, n_tokens: int, repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        step = synthetic_step(n_tokens)
        t0 = time.perf_counter()
        name, path = write(fmt, step, d / "dump")
        written = time.perf_counter() - t0
        from mismatch_probe.dumps import get_format, list_steps

        ((_, files),) = list_steps(get_format(name), path).items()
        common = {
            "format": name,
            "path": str(path),
            "model": str(MODEL),
            "trust_pickle": name == "verl",
            "files": [str(f) for f in files],
        }
        parses = ["parse-json", "parse-msgspec"] if fmt in JSONL else ["parse-own"]
        best: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for r in range(repeat):
            for what in (*parses, "analyse", "analyse-numpy", "import"):
                wall, used = measure({**common, "what": what, "out": str(d / f"{what}-{r}")})
                best[what] = min(best.get(what, float("inf")), wall)
                cpu[what] = min(cpu.get(what, float("inf")), used)
        return {
            "format": fmt,
            "tokens": sum(len(s.token_ids) for s in step.sequences),
            "dump_mib": sum(f.stat().st_size for f in files) / 2**20,
            "write_s": written,
            "a": best.get("parse-msgspec", best.get("parse-own")),
            "a_json": best.get("parse-json"),
            "b": best["analyse"],
            "b_numpy": best["analyse-numpy"],
            "c": best["import"],
            "cpu_ratio": cpu["analyse"] / cpu.get("parse-msgspec", cpu.get("parse-own", float("nan"))),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--scale", type=int, default=0, help="also a step this many times larger (0: not)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--formats", default=",".join(FORMATS))
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    formats = [f for f in args.formats.split(",") if f]
    if "verl" in formats and verl_site() is None:
        print("verl: not installed for the tests (bash tests/dumps/install-verl.sh .verl-site); left out")
        formats.remove("verl")
    sizes = [args.tokens] + ([args.tokens * args.scale] if args.scale else [])
    calls = first_call(compile_too=not args.smoke)
    compiling = "not measured at the smoke size" if calls["compile"] is None else f"{calls['compile']:.1f} s"
    print(
        f"the compiled loops' first call in a process: compiling them into an empty numba cache {compiling}; "
        f"loading them from the cache (once per timeline worker) {calls['load']:.2f} s"
    )
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)", flush=True)
    header = (
        f"{'format':16s} {'tokens':>10s} {'MiB':>6s} {'(a) s':>7s} {'(a) json':>8s} {'(b) s':>7s} "
        f"{'(b)/(a)':>7s} {'/json':>6s} {'cpu':>6s} {'(b) np':>7s} {'np/(a)':>7s} {'(b) Mtok/s':>10s} "
        f"{'(c) s':>7s} {'(c) Mtok/s':>10s}"
    )
    rows = []
    print(header, flush=True)
    for fmt in formats:
        for n in sizes:
            r = bench(fmt, n, args.repeat)
            rows.append(r)
            a_json = f"{r['a_json']:8.3f}" if r["a_json"] is not None else f"{'-':>8s}"
            over_json = f"{r['b'] / r['a_json']:5.2f}x" if r["a_json"] is not None else f"{'-':>6s}"
            print(
                f"{fmt:16s} {r['tokens']:>10,} {r['dump_mib']:6.1f} {r['a']:7.3f} {a_json} {r['b']:7.3f} "
                f"{r['b'] / r['a']:6.2f}x {over_json} {r['cpu_ratio']:5.2f}x {r['b_numpy']:7.3f} "
                f"{r['b_numpy'] / r['a']:6.2f}x {r['tokens'] / r['b'] / 1e6:10.2f} {r['c']:7.3f} "
                f"{r['tokens'] / r['c'] / 1e6:10.2f}",
                flush=True,
            )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        "(a): deserializing the step's files alone (JSON Lines: msgspec; '(a) json': json.loads, '/json' the "
        "ratio against it); (b): timeline analyse_step, compiled ('(b) np': on the NumPy path, 'np/(a)' its "
        "ratio); (c): import_dump; wall seconds, best of "
        f"{args.repeat}, each in a fresh process; 'cpu': (b)/(a) in the processes' CPU seconds (best of "
        f"{args.repeat} each), which other work on the machine inflates less"
    )
    worst = max(rows, key=lambda r: r["b"] / r["a"])
    verdict = "within" if worst["b"] / worst["a"] <= 2.0 else "ABOVE"
    print(f"largest (b)/(a): {worst['format']} {worst['b'] / worst['a']:.2f}x, {verdict} the 2x bar")


if __name__ == "__main__":
    main()

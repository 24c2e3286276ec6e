"""Rendering a timeline's page against analysing one step of the run.

    .venv/bin/python benchmarks/bench_timeline_render.py [--steps 1000] [--tokens 1000000] [--repeats 5]

The bar: a 1,000-step timeline page renders in under 1x the time of analysing one 1M-token step.

Builds a synthetic timeline directory of ``--steps`` steps: steps.parquet from the rows of 40 real
step analyses (``analysis.timeline.step_rows`` on synthetic tokens, the trainer's log-probs the
engine's plus Gaussian noise, 3x the variance in the second half of the templates), drawn at random
per step, K3's noise larger from 60% of the steps on; its drift tests and kept steps as the runner
makes them (``timeline.runner.drift_tests``, ``kept_steps``), and timeline.json. Then it measures,
each in a fresh process, best of ``--repeats`` with the two sides alternating (a spell of load on
the machine falls on both), the modules a process names up front imported before its clock starts
(matplotlib and Jinja2, imported on first use, count):

- analysing one step of ``--tokens`` model tokens as a timeline does (``runner.analyse_step``: read
  a generic Parquet dump, reduce it with its 400-replicate bootstrap, write the step's file);
- rendering the page (``report.pages.write_timeline_pages``: figures/*.svg, timeline.md, timeline.html)
  from the record and the table in memory, as the runner does;

and both again in this process, warm (a ``--follow`` pass renders the page again in a process that
has drawn it before). Prints the times, their ratio (target: under 1.0x), and the sizes of the
figures and the page.
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
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "dumps")]

import smoke  # benchmarks/smoke.py: the --smoke flag
from bench_import import synthetic_step
from training_run import write_generic

from mismatch_probe.analysis.timeline import StepTokens, rows_table, step_rows
from mismatch_probe.report.timeline_view import timeline_summary
from mismatch_probe.timeline.runner import _group, drift_tests, kept_steps
from mismatch_probe.timeline_record import STEPS_PARQUET, TimelineRecord
from mismatch_probe.version import __version__

TEMPLATES = 40
SMOKE = {"steps": 60, "tokens": 20_000, "repeats": 1}  # 60 steps: the 20-step baseline and a drift after it
CHILD_RENDER = """
import json, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from mismatch_probe.report.pages import write_timeline_pages
from mismatch_probe.timeline.store import read_steps
from mismatch_probe.timeline_record import read_timeline
out = Path({out!r})
record, table = read_timeline(out), read_steps(out)  # the runner hands the page the table it built
t0 = time.perf_counter()
write_timeline_pages(out, record, table)
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""
CHILD_ANALYSE = """
import json, sys, time
sys.path.insert(0, {root!r})
from mismatch_probe.timeline.dump_steps import DumpSource
from mismatch_probe.timeline.runner import _Task, analyse_step
task = _Task(DumpSource(format="generic", path={dump!r}), 0, "bench", {out!r}, {{}}, 400)
t0 = time.perf_counter()
done = analyse_step(task)
print(json.dumps({{"seconds": time.perf_counter() - t0, "tokens": done.n_tokens}}))
"""


def template_rows(seed: int = 0) -> list[list[dict]]:
    """The rows of ``TEMPLATES`` analysed steps of 3,000 model tokens (two turns), the second half
    with 3x the mismatch's variance."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(TEMPLATES):
        n = 3000
        position = np.arange(n) % 60
        sigma = 0.01 * np.exp(0.15 * rng.standard_normal()) * (np.sqrt(3) if k >= TEMPLATES // 2 else 1.0)
        li = np.log(rng.beta(5, 0.3, n))
        tokens = StepTokens(
            sample_id=np.arange(n) // 60,
            turn=(position >= 40).astype(np.int16),
            position=position,
            logp_infer=li,
            logp_train=(li + rng.normal(0, sigma, n)).clip(max=0),
            n_samples=n // 60,
        )
        out.append(step_rows(0, tokens, n_boot=100, seed=k))
    return out


def write_timeline(out: Path, n_steps: int, seed: int = 0) -> TimelineRecord:
    """A timeline directory of ``n_steps`` steps whose mismatch grows from 60% of them on."""
    templates = template_rows(seed)
    rng = np.random.default_rng(seed + 1)
    half = TEMPLATES // 2
    rows = []
    for step in range(n_steps):
        pick = int(rng.integers(half)) + (half if step >= 0.6 * n_steps else 0)
        rows += [r | {"step": step} for r in templates[pick]]
    table = rows_table(rows)
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / STEPS_PARQUET, compression="zstd")
    drift = drift_tests(table, baseline_steps=20, alpha=0.05)
    kept = kept_steps(_group(table, "all"), drift, keep="auto", worst=3)
    for k in kept[: len(kept) // 2]:
        k.run = f"runs/step-{k.step:08d}"
    for k in kept[len(kept) // 2 :]:
        k.reason = "no --model: a run directory needs the checkpoint the step sampled with"
    record = TimelineRecord(
        probe_version=__version__,
        status="complete",
        source={"format": "generic", "path": "/data/synthetic-run", "model": None},
        steps={
            "count": n_steps,
            "first": 0,
            "last": n_steps - 1,
            "model_tokens": int(np.nansum(_group(table, "all")["n_model_tokens"])),
            "failed": {},
        },
        options={"baseline_steps": 20, "alpha": 0.05, "keep": "auto", "worst": 3},
        drift=drift,
        kept=kept,
        notes=[],
    )
    record.write(out)
    return record


def write_step_dump(d: Path, n_model_tokens: int) -> tuple[Path, int]:
    """A generic Parquet dump of one step holding at least ``n_model_tokens`` model tokens."""
    n = n_model_tokens
    while True:
        step = synthetic_step(n)
        model = sum(int(s.model_mask.sum()) for s in step.sequences)
        if model >= n_model_tokens:
            return write_generic(step, d / "dump.parquet"), model
        n = int(n * n_model_tokens / model) + 1000


def child(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=1_000_000, help="model tokens of the analysed step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="write the timeline directory here (to look at the page)")
    smoke.add_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / "timeline"
        t0 = time.perf_counter()
        record = write_timeline(out, args.steps)
        print(
            f"synthetic timeline: {args.steps} steps, {record.steps['model_tokens']:,} model tokens "
            f"({time.perf_counter() - t0:.1f} s to build)"
        )
        for line in timeline_summary(record).splitlines():
            print(f"  {line}")
        dump, model = write_step_dump(Path(tmp), args.tokens)
        print(f"one step to analyse: {model:,} model tokens ({dump.stat().st_size / 2**20:.1f} MiB generic Parquet)")

        render = CHILD_RENDER.format(root=str(ROOT), out=str(out))
        analyse = CHILD_ANALYSE.format(root=str(ROOT), dump=str(dump), out=str(Path(tmp) / "analysed"))
        cold_render, cold_analyse = [], []
        for _ in range(args.repeats):
            cold_analyse.append(child(analyse)["seconds"])
            cold_render.append(child(render)["seconds"])

        from mismatch_probe.report.pages import write_timeline_pages
        from mismatch_probe.timeline.dump_steps import DumpSource
        from mismatch_probe.timeline.runner import _Task, analyse_step
        from mismatch_probe.timeline.store import read_steps

        table = read_steps(out)
        task = _Task(DumpSource(format="generic", path=str(dump)), 0, "bench", str(Path(tmp) / "warm"), {}, 400)
        warm_render, warm_analyse = [], []
        for _ in range(args.repeats + 1):  # the first of each warms the process
            t = time.perf_counter()
            analyse_step(task)
            warm_analyse.append(time.perf_counter() - t)
            t = time.perf_counter()
            figures = write_timeline_pages(out, record, table)
            warm_render.append(time.perf_counter() - t)
        sizes = {f: (out / f).stat().st_size for f in figures}
        page = (out / "timeline.html").stat().st_size

    print()
    print(f"{'':34s} {'analyse one step':>18s} {'render the page':>16s} {'ratio':>7s}")
    for name, a, r in (
        (f"fresh process (best of {args.repeats})", min(cold_analyse), min(cold_render)),
        (f"warm process (best of {args.repeats})", min(warm_analyse[1:]), min(warm_render[1:])),
    ):
        print(f"{name:34s} {a:16.3f} s {r:14.3f} s {r / a:6.2f}x")
    print()
    print(
        f"figures: {len(figures)}, {sum(sizes.values()) / 1024:.0f} KiB together, largest "
        f"{max(sizes.values()) / 1024:.0f} KiB; timeline.html {page / 1024:.0f} KiB"
    )
    for f, n in sizes.items():
        print(f"  {f:36s} {n / 1024:6.1f} KiB")


if __name__ == "__main__":
    main()

"""Size and render time of the reports for a large synthetic run, and of the committed examples'
comparison and sweep pages.

    python benchmarks/bench_report.py [--tokens 10000000]

Writes a synthetic run (the per-token table of bench_metrics.py: responses of 50-2000 tokens,
two turns, 30% prompt/tool tokens) plus its run.json, then measures, in one process:

- the analysis pass that ``compare`` makes (metrics and the report's distributions together),
  against the metrics alone, so the distributions' own cost shows;
- rendering report.html from the run directory;
- the same for a run without distributions.json (recomputed from the table);
- a comparison of two such runs;

and, each in a fresh process (so neither finds the other's lazy imports or caches warm; the
modules a process names up front are imported before its clock starts, matplotlib and Jinja2,
imported on first use, count), the best of 5 a side with the two sides alternating (a spell of
load on the machine falls on both), with their ratio (target, issue 36: at most 1.0x):

- the synthetic run's analysis pass against rendering everything ``mismatch-probe report RUN``
  renders from the finished directory (``pipeline.report``: the figures, figures/*.svg,
  report.md and report.html); ``--profile`` prints where that rendering's time goes (cProfile);
- re-analyzing the two synthetic runs, then the committed runs reports/example and
  reports/example-fp32, against their comparison page (``mismatch-probe report A B --out ...``);
- the statistics of reports/sweep-demo's summary (each finished point's bootstrap intervals and
  effects against the baseline, from its sequences.parquet, as ``sweeps/summary.py`` computes
  them) against its pages (``mismatch-probe report reports/sweep-demo``: sweep.md, sweep.html).

It prints the HTML sizes, which must stay under 5 MB whatever the token count. With
``--chromium PATH`` (and playwright installed) it also times loading each page in headless
Chromium, to the load event and to a full-page screenshot.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import smoke  # benchmarks/smoke.py: the --smoke flag
from bench_metrics import write_synthetic

from mismatch_probe.analysis.analyze import analyze
from mismatch_probe.analysis.distributions import DistributionAccumulator, save, worst_sequences
from mismatch_probe.analysis.sequences import SequenceCollector
from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.environment import fingerprint
from mismatch_probe.record import json_safe
from mismatch_probe.report.html import write_report
from mismatch_probe.table.tokens import write_sequences

LIMIT_BYTES = 5 * 10**6
SMOKE = {"tokens": 50_000, "repeats": 1}


CHILD = """
import cProfile, json, pstats, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from mismatch_probe.analysis.analyze import analyze
from mismatch_probe.analysis.distributions import DistributionAccumulator
from mismatch_probe.analysis.intervals import available, bootstrap_intervals
from mismatch_probe.analysis.sequences import SequenceCollector, group_columns
from mismatch_probe.analysis.sweep import effects
from mismatch_probe.pipeline import report as rerender
from mismatch_probe.record import SEQUENCES_PARQUET
from mismatch_probe.report.html import write_report
from mismatch_probe.report.pages import write_sweep_reports
from mismatch_probe.sweep_record import read_sweep
from mismatch_probe.table.tokens import read_parquet
paths = [Path(p) for p in {paths!r}]


def sweep_statistics(sweep_dir):
    record = read_sweep(sweep_dir)
    settings = record.spec["sweep"]
    columns = {{
        p.name: group_columns(read_parquet(sweep_dir / p.run / SEQUENCES_PARQUET), "all")
        for p in record.points
        if p.status == "ok"
    }}
    baseline = columns[record.points[0].name]
    repeats = [columns[name] for name in record.noise_floor["runs"][1:] if name in columns]
    for p in record.points:
        if p.name not in columns:
            continue
        cols = columns[p.name]
        bootstrap_intervals(cols, available(cols), n_boot=settings["n_boot"], level=record.level, seed=0)
        if p is not record.points[0]:
            paired = p.rollouts_from == record.points[0].name
            effects(baseline, cols, paired=paired, repeats=repeats, n_boot=settings["n_boot"], level=record.level, seed=0)


work = {{
    "analyze": lambda: [
        analyze(p, distributions=DistributionAccumulator(), sequences=SequenceCollector()) for p in paths
    ],
    "render": lambda: rerender(paths[0]),
    "compare": lambda: write_report(paths[1:], paths[0]),
    "sweep-statistics": lambda: sweep_statistics(paths[0]),
    "sweep-render": lambda: write_sweep_reports(paths[0], read_sweep(paths[0])),
}}[{mode!r}]
t0 = time.perf_counter()
if {profile!r}:
    profiler = cProfile.Profile()
    profiler.runcall(work)
    seconds = time.perf_counter() - t0
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
else:
    work()
    seconds = time.perf_counter() - t0
print(json.dumps({{"seconds": seconds}}))
"""


def fresh_process(mode: str, *paths: Path, profile: bool = False) -> tuple[float, float]:
    """(seconds of the work in a fresh process, seconds of the whole process: interpreter start
    and every import too)."""
    code = CHILD.format(root=str(ROOT), paths=[str(p) for p in paths], mode=mode, profile=profile)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    whole = time.perf_counter() - t0
    if profile:
        print(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"], whole


def ratio_line(what: str, analysis: tuple[str, list[Path]], render: tuple[str, list[Path]], n: int = 5) -> str:
    """The best of ``n`` fresh processes per side, the two sides alternating so that a spell of
    load on the machine falls on both."""
    runs: dict[str, list[tuple[float, float]]] = {"analysis": [], "render": []}
    for _ in range(n):
        for side, (mode, paths) in (("analysis", analysis), ("render", render)):
            runs[side].append(fresh_process(mode, *paths))
    a, r = ((min(t[0] for t in runs[s]), min(t[1] for t in runs[s])) for s in ("analysis", "render"))
    return _ratio_line(what, a, r)


def _ratio_line(what: str, analysis: tuple[float, float], render: tuple[float, float]) -> str:
    return (
        f"{what}: analysis {analysis[0]:.2f} s, rendering {render[0]:.2f} s: {render[0] / analysis[0]:.2f}x "
        f"(target <= 1.0x); whole processes {analysis[1]:.2f} s and {render[1]:.2f} s: "
        f"{render[1] / analysis[1]:.2f}x"
    )


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def make_run(run: Path, tokens: int, seed: int) -> dict:
    write_synthetic(run, tokens, 1_000_000, seed=seed)
    _, t_metrics = timed(lambda: analyze(run))
    acc, seqs = DistributionAccumulator(), SequenceCollector()
    sections, t_both = timed(lambda: analyze(run, distributions=acc, sequences=seqs))
    write_sequences(run, seqs.table)
    t_metrics = min(t_metrics, timed(lambda: analyze(run))[1])  # both orders, so the page cache favours neither
    dist = acc.result
    dist["worst_sequences"], t_worst = timed(lambda: worst_sequences(run, dist["worst"]))
    save(run, dist)
    spec = ProbeSpec()
    spec.name = f"synthetic-{seed}"
    record = {
        "status": "complete",
        "spec": spec.to_dict(),
        "environment": fingerprint(),
        "inputs": {"model": "synthetic", "prompts": "synthetic", "n_prompts": 0, "n_samples": 0},
        "engine": {"engine": "synthetic", "dtype": "bfloat16"},
        "reference": {"dtype": "float32"},
        **sections,
    }
    (run / "run.json").write_text(json.dumps(json_safe(record)))
    return {
        "metrics_s": t_metrics,
        "metrics_and_distributions_s": t_both,
        "worst_sequences_s": t_worst,
        "n_model_tokens": sections["metrics"]["n_model_tokens"],
        "distributions_json_bytes": (run / "distributions.json").stat().st_size,
    }


def browser_times(chromium: str, pages: list[Path]) -> list[tuple[float, float]]:
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        for page_path in pages:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            t0 = time.perf_counter()
            page.goto(page_path.as_uri(), wait_until="load")
            loaded = time.perf_counter() - t0
            page.screenshot(full_page=True)
            out.append((loaded, time.perf_counter() - t0))
            page.close()
        browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--chromium", help="time the pages in this Chromium too (needs playwright)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of rendering report.html")
    ap.add_argument("--repeats", type=int, default=5, help="fresh processes a side (the best is shown)")
    smoke.add_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        vars(args).update(SMOKE)
    n = args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        stats = make_run(a, args.tokens, 0)
        make_run(b, args.tokens, 1)
        print(f"synthetic run: {args.tokens:,} rows, {stats['n_model_tokens']:,} model tokens")
        print(
            f"analysis pass: metrics alone {stats['metrics_s']:.2f} s, metrics + distributions "
            f"{stats['metrics_and_distributions_s']:.2f} s ({stats['metrics_and_distributions_s'] / stats['metrics_s']:.2f}x); "
            f"worst sequences {stats['worst_sequences_s']:.2f} s; distributions.json "
            f"{stats['distributions_json_bytes'] / 1e3:.0f} kB"
        )
        print(f"fresh processes, best of {n} a side (the work alone; then the whole process):")
        print(ratio_line("- the synthetic run, report", ("analyze", [a]), ("render", [a]), n=n))
        if args.profile:
            fresh_process("render", a, profile=True)
        print(
            ratio_line(
                "- the two synthetic runs, comparison page",
                ("analyze", [a, b]),
                ("compare", [Path(tmp) / "synthetic-compare.html", a, b]),
                n=min(3, n),
            )
        )
        examples = [ROOT / "reports" / "example", ROOT / "reports" / "example-fp32"]
        print(
            ratio_line(
                "- reports/example vs example-fp32, comparison page",
                ("analyze", examples),
                ("compare", [Path(tmp) / "examples.html", *examples]),
                n=n,
            )
        )
        sweep = Path(tmp) / "sweep-demo"
        shutil.copytree(ROOT / "reports" / "sweep-demo", sweep)  # its pages are written beside sweep.json
        print(
            ratio_line(
                "- reports/sweep-demo, sweep pages",
                ("sweep-statistics", [sweep]),
                ("sweep-render", [sweep]),
                n=n,
            )
        )
        one = write_report([a], Path(tmp) / "one.html")
        print(f"report.html from the run directory: {one.n_bytes / 1e6:.2f} MB in {one.seconds:.2f} s")
        old = Path(tmp) / "old"
        shutil.copytree(a, old)
        (old / "distributions.json").unlink()
        again = write_report([old], Path(tmp) / "old.html")
        print(
            f"report.html of a run without distributions.json (recomputed from the table): "
            f"{again.n_bytes / 1e6:.2f} MB in {again.seconds:.2f} s"
        )
        both = write_report([a, b], Path(tmp) / "compare.html")
        print(f"comparison of two runs: {both.n_bytes / 1e6:.2f} MB in {both.seconds:.2f} s")
        print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
        if args.chromium:
            for name, (loaded, shot) in zip(
                ("report", "comparison"), browser_times(args.chromium, [one.path, both.path])
            ):
                print(
                    f"{name} in headless Chromium: load event {loaded:.2f} s, full-page screenshot done at {shot:.2f} s"
                )
        for name, r in (("report", one), ("comparison", both)):
            if r.n_bytes > LIMIT_BYTES:
                sys.exit(f"{name} is {r.n_bytes / 1e6:.2f} MB, over the 5 MB budget")


if __name__ == "__main__":
    main()

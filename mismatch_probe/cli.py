"""The ``mismatch-probe`` command line: a thin layer over the library API.

Errors the user can fix (:class:`ProbeError`) print one line and exit non-zero; a traceback only
with ``--debug`` or ``MISMATCH_PROBE_DEBUG=1``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from mismatch_probe.config.options import key_values, with_spec_options
from mismatch_probe.config.sweep import EXECUTORS
from mismatch_probe.dumps import FORMATS as _DUMP_FORMATS
from mismatch_probe.dumps import SAMPLED_SETTINGS as _DUMP_SAMPLED
from mismatch_probe.errors import ProbeError
from mismatch_probe.files import portable_path, write_atomic
from mismatch_probe.frameworks import FRAMEWORKS as _FRAMEWORKS

app = typer.Typer(
    name="mismatch-probe",
    help="Measure the probability mismatch between an inference engine and a training forward pass.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console()
DUMP_FORMATS = ", ".join(_DUMP_FORMATS)  # the formats `import` and `timeline` read (dumps/__init__.py)


def _debug() -> bool:
    return os.environ.get("MISMATCH_PROBE_DEBUG", "") not in ("", "0")


def friendly_errors(fn):
    """Turn library errors into one-line messages and exit codes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ProbeError as exc:
            if _debug():
                if getattr(exc, "remote_traceback", ""):  # a reference rank's own traceback
                    err.print(exc.remote_traceback, markup=False, highlight=False)
                raise
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted: completed shards are kept; run the same command again to resume")
            raise typer.Exit(130) from None

    return wrapper


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    if debug:
        os.environ["MISMATCH_PROBE_DEBUG"] = "1"


class RichProgress:
    """Rich progress bars for the pipeline's stages (on stderr, so --json output stays clean)."""

    def __init__(self, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.bars = Progress(
            TextColumn("{task.description:<10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("samples"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.tasks:  # the live display starts with the first stage, so early errors print alone
            self.bars.stop()

    def stage(self, name: str, total: int) -> None:
        if not self.tasks:
            self.bars.start()
        if name in self.tasks:  # the next run of a sweep: the same bar again, not one more
            self.bars.reset(self.tasks[name], total=total)
        else:
            self.tasks[name] = self.bars.add_task(name, total=total or None)  # 0: not known ahead

    def advance(self, name: str, amount: int) -> None:
        self.bars.advance(self.tasks[name], amount)

    def log(self, message: str) -> None:
        self.bars.console.log(message)


# the [reference] and [corrections] settings: what `score` and `import` may change about how the
# same tokens are scored (`timeline`: [corrections] alone, its steps' reference is the trainer)
SCORING = ("reference", "corrections")


@app.command()
@friendly_errors
@with_spec_options
def compare(
    spec_file: Annotated[Path | None, typer.Argument(help="Probe spec (TOML); flags override it.")] = None,
    *,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run in --out instead of resuming it.")] = False,
    rollouts_from: Annotated[
        Path | None,
        typer.Option(
            help="Score the rollouts of this run (same model, prompts, engine and sampling) instead of sampling; no engine starts."
        ),
    ] = None,
    gate_file: Annotated[
        Path | None,
        typer.Option("--gate", help="Thresholds file (TOML): gate the finished run on it; exit 1 if a check fails."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run record (run.json) to stdout.")] = False,
    overrides: dict[str, object],
) -> None:
    """Sample with an engine, score the same tokens with a training-style forward, report the mismatch."""
    from mismatch_probe import pipeline
    from mismatch_probe.report.run_view import run_view
    from mismatch_probe.report.terminal import print_run

    gate = None
    if gate_file is not None:  # a bad thresholds file fails now, not after the run
        from mismatch_probe.gate.checks import load_gate

        gate = load_gate(gate_file)
        if gate.needs_baseline:
            from mismatch_probe.errors import ConfigError

            raise ConfigError(
                f"{gate_file} has baseline-relative checks, and compare --gate takes no baseline",
                hint="run compare, then `mismatch-probe gate RUN --thresholds FILE --baseline BASE`",
            )
    spec = _spec(spec_file, overrides)
    if spec.variants:
        return _compare_variants(spec, overwrite, rollouts_from, gate_file, gate, as_json)
    with RichProgress(err) as progress:
        result = pipeline.compare(spec, progress=progress, overwrite=overwrite, rollouts_from=rollouts_from)
    if as_json:
        sys.stdout.write(json.dumps(result.record, indent=2) + "\n")
        if gate is not None:
            _gate_exit(_gate(result.run_dir, gate_file, None, gate, quiet=True))
        return
    print_run(out, run_view(result.run, result.run_dir))
    out.print(f"run directory: {escape(portable_path(result.run_dir))}")
    out.print(f"report: {escape(portable_path(result.run_dir / 'report.html'))} (also report.md)")
    if gate is not None:
        _gate_exit(_gate(result.run_dir, gate_file, None, gate))


def _spec(spec_file: Path | None, overrides: dict[str, object], settings: list[str] | None = None):
    """The spec a command runs: the file (or the defaults), then its flags, then ``--set`` settings."""
    from mismatch_probe.config.spec import ProbeSpec
    from mismatch_probe.config.spec_reading import apply_overrides, load_spec_file

    spec = load_spec_file(spec_file) if spec_file else ProbeSpec()
    spec = apply_overrides(spec, overrides)  # paths as typed: the spec resolves them and records them as given
    return apply_overrides(spec, parse_settings(settings), named_by="set") if settings else spec


def _compare_variants(spec, overwrite, rollouts_from, gate_file, gate, as_json) -> None:
    from mismatch_probe.pipeline import compare_variants
    from mismatch_probe.report.comparison_view import comparison_view, label_runs
    from mismatch_probe.report.data import RunData
    from mismatch_probe.report.terminal import print_comparison

    with RichProgress(err) as progress:
        result = compare_variants(spec, progress=progress, overwrite=overwrite, rollouts_from=rollouts_from)
    gated = (
        {name: _gate(r.run_dir, gate_file, None, gate, quiet=True) for name, r in result.runs.items()} if gate else {}
    )
    if as_json:
        sys.stdout.write(json.dumps({name: r.record for name, r in result.runs.items()}, indent=2) + "\n")
    else:
        runs = label_runs([RunData(r.run_dir, r.run, {}) for r in result.runs.values()])
        print_comparison(out, comparison_view(runs, "variants: the same rollouts, scored by each reference"))
        for name, r in result.runs.items():
            out.print(f"{name}: {escape(portable_path(r.run_dir / 'report.html'))}")
        out.print(f"comparison: {escape(portable_path(result.comparison))}")
        from mismatch_probe.gate.junit import rich_table

        for name, g in gated.items():
            out.print(f"gate on {name}:")
            out.print(rich_table(g))
    worst = max((g.exit_code for g in gated.values()), default=0)
    if worst:
        raise typer.Exit(worst)


def _gate(run_dir, thresholds, baseline, gate=None, *, quiet=False, junit=None, markdown=None):
    from mismatch_probe.gate.checks import run_gate
    from mismatch_probe.gate.junit import junit_xml, rich_table
    from mismatch_probe.gate.junit import markdown as render_markdown
    from mismatch_probe.timeline_record import is_timeline

    if is_timeline(run_dir):
        result = _gate_timeline(run_dir, thresholds, baseline, gate)
    else:
        result = run_gate(run_dir, thresholds, baseline, gate)
    if junit is not None:
        write_atomic(junit, junit_xml(result))
    if markdown is not None:
        write_atomic(markdown, render_markdown(result))
    if not quiet and is_timeline(run_dir):  # one result per check and step: a row per check
        from mismatch_probe.gate.junit import per_check_table

        counts = ", ".join(f"{n} {s}" for s, n in result.counts().items() if n)
        out.print(f"gate {result.status} over {escape(str(run_dir))}'s steps: {counts}")
        out.print(per_check_table(result))
    elif not quiet:
        out.print(rich_table(result))
    return result


def _gate_timeline(timeline_dir, thresholds, baseline, gate):
    """A timeline is gated step by step; its growth checks are against its own early steps."""
    from mismatch_probe.errors import ConfigError
    from mismatch_probe.gate.timeline import run_timeline_gate

    if baseline is not None:
        raise ConfigError(
            f"{timeline_dir} is a timeline: its baseline_factor checks compare each step with the timeline's own "
            "first steps, not with --baseline",
            hint="drop --baseline",
        )
    return run_timeline_gate(timeline_dir, thresholds, gate)


def _gate_exit(result) -> None:
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def parse_settings(pairs: list[str] | None) -> dict[str, object]:
    """``--set section.key=value`` flags as overrides; the value is read as TOML (2, 1e-3, true,
    "text"), or taken as a string when it is not TOML (bfloat16)."""
    return key_values(pairs or [], "--set", "reference.dtype=bfloat16")


SET_HELP = "A setting as section.key=value (repeatable), e.g. reference.dtype=bfloat16."


@app.command()
@friendly_errors
@with_spec_options
def sample(
    spec_file: Annotated[Path | None, typer.Argument(help="Probe spec (TOML); flags override it.")] = None,
    *,
    settings: Annotated[list[str] | None, typer.Option("--set", help=SET_HELP)] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run in --out.")] = False,
    overrides: dict[str, object],
) -> None:
    """Stage 1 alone: the engine samples (and re-scores with its prefill) into a run directory;
    `score` and `analyze` take it from there, later or on other machines. `compare` is exactly
    sample + score + analyze."""
    from mismatch_probe import pipeline

    spec = _spec(spec_file, overrides, settings)
    with RichProgress(err) as progress:
        ctx = pipeline.sample(spec, progress=progress, overwrite=overwrite)
    where = escape(portable_path(ctx.out))
    out.print(f"sampled {ctx.record.inputs.n_samples} samples into {where}; next: mismatch-probe score {where}")


@app.command()
@friendly_errors
@with_spec_options(sections=SCORING, unset="RUN_DIR's")
def score(
    run_dir: Annotated[Path, typer.Argument(help="A run directory with rollouts (from sample).", show_default=False)],
    *,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Score into a new run directory that links RUN_DIR's rollouts (with reference settings)."
        ),
    ] = None,
    settings: Annotated[
        list[str] | None, typer.Option("--set", help=SET_HELP + " Only \\[reference] and \\[corrections] settings.")
    ] = None,
    model: Annotated[Path | None, typer.Option(help="The checkpoint, when not where the run found it.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run in --out.")] = False,
    overrides: dict[str, object],
) -> None:
    """Stage 2 alone: the reference scores the sampled tokens (the missing shards; a re-run resumes).
    With --out and reference settings (flags or --set), another reference scores the same rollouts
    into a new run directory.
    Under torchrun (one node or several), the ranks score as data-parallel groups of
    reference.sequence_parallel_size x tensor_parallel_size; RUN_DIR must be on a shared filesystem."""
    from contextlib import nullcontext

    from mismatch_probe import pipeline
    from mismatch_probe.reference.launch import torchrun_launch

    launch = torchrun_launch()  # under torchrun, rank 0 alone shows progress and the result
    lead = launch is None or launch.is_lead
    with RichProgress(err) if lead else nullcontext(pipeline.Progress()) as progress:
        ctx = pipeline.score(
            run_dir,
            out=out_dir,
            overrides=overrides,
            settings=parse_settings(settings),
            model=model,
            progress=progress,
            overwrite=overwrite,
        )
    if not lead:
        return
    where = escape(portable_path(ctx.out))
    out.print(f"scored {ctx.out / 'tokens.parquet'}; next: mismatch-probe analyze {where}")


@app.command()
@friendly_errors
def analyze(
    run_dir: Annotated[Path, typer.Argument(help="A scored run directory (from score).", show_default=False)],
    model: Annotated[Path | None, typer.Option(help="The checkpoint, when not where the run found it.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print run.json instead of the tables.")] = False,
) -> None:
    """Stages 3 and 4 alone: metrics, per-sequence rows and the report of a scored run."""
    from mismatch_probe import pipeline
    from mismatch_probe.report.run_view import run_view
    from mismatch_probe.report.terminal import print_run

    with RichProgress(err) as progress:
        result = pipeline.analyze(run_dir, progress=progress, model=model)
    if as_json:
        sys.stdout.write(json.dumps(result.record, indent=2) + "\n")
        return
    print_run(out, run_view(result.run, result.run_dir))
    out.print(f"report: {escape(portable_path(result.run_dir / 'report.html'))} (also report.md)")


# --executor ray's cluster, for sweep and timeline alike
RayAddress = Annotated[
    str | None,
    typer.Option("--ray-address", help="With --executor ray: the cluster (default: RAY_ADDRESS, else a local one)."),
]


class RichSweepProgress(RichProgress):
    """The stages' bars plus one for the sweep: points done, engine starts, time left."""

    def __init__(self, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        super().__init__(console)
        self.points = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("runs · {task.fields[starts]} engine starts · left"),
            TimeRemainingColumn(),
            console=console,
        )
        self.points_task: int | None = None

    def point(self, name: str, done: int, total: int, engine_starts: int) -> None:
        if self.points_task is None:
            self.points_task = self.points.add_task("sweep", total=total, starts=engine_starts)
            self.points.start()
        self.points.update(self.points_task, completed=done, starts=engine_starts)
        self.log(f"sweep: {name} done ({done}/{total} runs, {engine_starts} engine starts)")

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self.points_task is not None:
            self.points.stop()


@app.command()
@friendly_errors
@with_spec_options
def sweep(
    spec_file: Annotated[
        Path,
        typer.Argument(
            help="Probe spec (TOML) with a \\[sweep] table, e.g. probes/sweep-demo.toml; flags change its baseline.",
            show_default=False,
        ),
    ],
    *,
    gate_file: Annotated[
        Path | None,
        typer.Option("--gate", help="Thresholds (TOML): check every point and name the cheapest change that passes."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume/--no-resume", help="Keep the finished points of an earlier sweep in --out.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print sweep.json instead of a summary.")] = False,
    shard: Annotated[
        str | None,
        typer.Option(
            "--shard",
            help="Run shard I of N (e.g. 1/4, from 1; a Slurm array task): a share of the engine "
            "configurations, into the shared --out. The last shard to finish writes the summary.",
        ),
    ] = None,
    summarize_only: Annotated[
        bool,
        typer.Option("--summarize", help="Write the summary of a sweep whose shards have all finished; runs nothing."),
    ] = False,
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            help=f"Where the engine configurations run: {' or '.join(EXECUTORS)} (each one a Ray task on a cluster).",
        ),
    ] = "local",
    ray_address: RayAddress = None,
    overrides: dict[str, object],
) -> None:
    """Vary engine, reference and sampling settings around a spec, one run per point (one engine
    start per engine configuration), and say which setting causes the mismatch, with intervals, the
    noise floor, determinism and each change's throughput cost. Exit 0 when the baseline or a
    recommended change passes --gate, 1 when none does, 2 on bad input."""
    from mismatch_probe.report.sweep_view import sweep_view
    from mismatch_probe.report.terminal import print_sweep
    from mismatch_probe.sweeps import sweep as run_sweep

    spec = _spec(spec_file, overrides)
    with RichSweepProgress(err) as progress:
        result = run_sweep(
            spec,
            gate=gate_file,
            resume=resume,
            progress=progress,
            shard=shard,
            summarize_only=summarize_only,
            executor=executor,
            ray_address=ray_address,
        )
    if result.record is None:  # a shard whose share is done; others' points are still to come
        out.print(
            f"sweep: shard {escape(str(shard))} done; {len(result.waiting)} point(s) of other shards to come. "
            "The last shard to finish writes the summary, or run: mismatch-probe sweep SPEC --summarize"
        )
        return
    if as_json:
        sys.stdout.write(json.dumps(result.record.to_dict(), indent=2) + "\n")
    else:
        print_sweep(out, sweep_view(result.record))
        out.print(f"sweep: {escape(portable_path(result.html))} (also sweep.md, sweep.json)")
    if result.exit_code:
        raise typer.Exit(result.exit_code)


@app.command()
@friendly_errors
def gate(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by compare.", show_default=False)],
    thresholds: Annotated[
        Path, typer.Option("--thresholds", help="Checks (TOML), e.g. probes/gate-default.toml.", show_default=False)
    ],
    baseline: Annotated[Path | None, typer.Option(help="Run to compare against, for baseline_factor checks.")] = None,
    junit: Annotated[Path | None, typer.Option(help="Also write JUnit XML here (one testcase per check).")] = None,
    markdown: Annotated[
        Path | None, typer.Option(help="Also write a Markdown summary here (e.g. $GITHUB_STEP_SUMMARY).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")] = False,
) -> None:
    """Check a run against thresholds: exit 0 when all pass (warnings allowed), 1 when a check fails,
    2 for a usage or configuration error (a missing, NaN or infinite value fails)."""
    result = _gate(run_dir, thresholds, baseline, quiet=as_json, junit=junit, markdown=markdown)
    if as_json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    _gate_exit(result)


@app.command()
@friendly_errors
def report(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            help="Run directories written by compare; two or more are compared side by side.", show_default=False
        ),
    ],
    out_file: Annotated[
        Path | None,
        typer.Option(
            "--out", help="HTML file to write (default: <run>/report.html for one run, compare.html for several)."
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print what the pages show (the report's view model) as JSON; write nothing."),
    ] = False,
    framework: Annotated[
        str | None,
        typer.Option(
            help="One run: show this RL framework's own metrics (Your dashboard), e.g. slime; recorded in its run.json."
        ),
    ] = None,
) -> None:
    """Render the report of a run again (figures, report.md, report.html), a sweep's pages from its
    sweep.json, or compare runs (grouped by GPU type); needs no engine and no GPU."""
    from mismatch_probe.report.html import write_report

    is_sweep = len(run_dirs) == 1 and out_file is None and (run_dirs[0] / "sweep.json").is_file()
    if as_json:
        sys.stdout.write(_report_json(run_dirs, is_sweep))
        return
    from mismatch_probe.timeline_record import is_timeline

    if len(run_dirs) == 1 and out_file is None and is_timeline(run_dirs[0]):
        from mismatch_probe.report.pages import render_timeline_again

        path = render_timeline_again(run_dirs[0])  # from timeline.json and steps.parquet
        out.print(f"timeline: {escape(str(path))}, timeline.md, figures/")
        return
    if is_sweep:
        from mismatch_probe.report.pages import write_sweep_reports
        from mismatch_probe.sweep_record import read_sweep

        path = write_sweep_reports(run_dirs[0], read_sweep(run_dirs[0]))  # sweep.json is the source of truth
        out.print(f"sweep: {escape(str(path))}, sweep.md (the points' own reports: mismatch-probe report POINT_DIR)")
        return
    if len(run_dirs) == 1 and out_file is None:  # the run's own report, as compare writes it
        from mismatch_probe import pipeline

        t0 = time.perf_counter()
        path = pipeline.report(run_dirs[0], framework=framework)
        size, seconds = path.stat().st_size, time.perf_counter() - t0
        out.print(
            f"report: {escape(str(path))} ({size / 1e6:.2f} MB, rendered in {seconds:.1f} s), report.md, figures/"
        )
        return
    written = write_report(run_dirs, out_file)
    what = f"comparison of {written.n_runs} runs" if written.n_runs > 1 else "report"
    out.print(
        f"{what}: {escape(str(written.path))} ({written.n_bytes / 1e6:.2f} MB, rendered in {written.seconds:.1f} s)"
    )


def _report_json(run_dirs: list[Path], is_sweep: bool) -> str:
    """The view of a run, a sweep or a comparison of runs, as ``report --json`` prints it."""
    from mismatch_probe.report.comparison_view import comparison_view, label_runs
    from mismatch_probe.report.data import load_run
    from mismatch_probe.report.run_view import run_view

    if is_sweep:
        from mismatch_probe.report.sweep_view import sweep_view
        from mismatch_probe.sweep_record import read_sweep

        return sweep_view(read_sweep(run_dirs[0])).to_json()
    if len(run_dirs) == 1:
        run = load_run(run_dirs[0])
        return run_view(run.record, run.path, run.dist).to_json()
    return comparison_view(label_runs([load_run(d) for d in run_dirs])).to_json()


IMPORT_LABELS = {"engine.name": "engine", "engine.logprobs_mode": "engine log-probs"}


# how `import` and `timeline` read a dump, declared once
TrustPickle = Annotated[
    bool,
    typer.Option(
        "--trust-pickle", help="Read a pickled dump (verl's rollout cache), through an allow-list of its classes."
    ),
]
TrainDump = Annotated[
    Path | None,
    typer.Option(help="slime: the train dump (--save-debug-train-data), when not train_data/ beside rollout_data/."),
]


@app.command("import")
@friendly_errors
@with_spec_options(
    sections=SCORING,
    keys=_DUMP_SAMPLED,
    from_dump=_DUMP_SAMPLED,
    aliases={"engine.logprobs_mode": ("--engine-logprobs",)},  # the spelling beside --trainer-logprobs
)
def import_(
    dump_format: Annotated[str, typer.Argument(metavar="FORMAT", help=DUMP_FORMATS + ".", show_default=False)],
    path: Annotated[Path, typer.Argument(help="The dump: a file, or the directory holding it.", show_default=False)],
    *,
    model: Annotated[Path, typer.Option(help="The checkpoint the run sampled with (local directory).")],
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default reports/<format>-step<N>-<time>).")
    ] = None,
    step: Annotated[
        int | None, typer.Option(help="The step (rollout id) to import, when the dump holds several.")
    ] = None,
    trainer_logprobs: Annotated[
        str | None,
        typer.Option(help="What the trainer's log-probs are: raw, temperature (logits / T) or processed."),
    ] = None,
    trust_pickle: TrustPickle = False,
    train_dump: TrainDump = None,
    no_trainer: Annotated[
        bool, typer.Option("--no-trainer", help="Import the engine side only, even when the dump has the trainer's.")
    ] = False,
    shard_size: Annotated[int, typer.Option(help="Samples per shard (the unit of resume).")] = 256,
    settings: Annotated[
        list[str] | None,
        typer.Option("--set", help=SET_HELP + " Only \\[reference] and \\[corrections]: how `score` will re-score."),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run in --out.")] = False,
    overrides: dict[str, object],
) -> None:
    """Turn a training run's own rollout dump into a run directory: `analyze` it when the dump has the
    trainer's log-probs (what your run saw), `score` it to re-score the same tokens with the reference."""
    from mismatch_probe.importing import ImportOptions, import_dump

    options = ImportOptions(
        flags={k: v for k, v in overrides.items() if v is not None},
        trainer_logprobs=trainer_logprobs,
        step=step,
        trust_pickle=trust_pickle,
        trainer_path=None if train_dump is None else str(train_dump),
        use_trainer=not no_trainer,
        shard_size=shard_size,
        overrides=parse_settings(settings),
    )
    with RichProgress(err) as progress:
        ctx = import_dump(dump_format, path, model=model, out=out_dir, options=options, progress=progress)
    info = ctx.record.import_info()
    where = escape(portable_path(ctx.out))
    step_text = f" step {info.step}" if info.step is not None else ""
    out.print(
        f"imported {info.samples} samples ({info.model_tokens} model tokens) of the "
        f"{info.format} dump{step_text} into {where}"
    )
    for note in info.notes:
        out.print(f"note: {escape(note)}")
    sampled = ", ".join(
        f"{IMPORT_LABELS.get(key, key.partition('.')[2])} {ctx.record.lookup('spec.' + key)} ({source})"
        for key, source in info.settings_from.items()
    )
    out.print(f"recorded as sampled with: {escape(sampled)}; flags set what the dump does not say")
    if info.trainer_logprobs:
        out.print(f"next: mismatch-probe analyze {where}   (the engine against your trainer's own log-probs)")
        out.print(
            f"then: mismatch-probe score {where} --out {where}-reference --set reference.dtype=float32 "
            "--set reference.logits_fp32=true   (the same tokens against mismatch-probe's reference)"
        )
    else:
        out.print(f"next: mismatch-probe score {where}, then mismatch-probe analyze {where}")


@app.command()
@friendly_errors
@with_spec_options(sections=("corrections",))
def timeline(
    source: Annotated[Path, typer.Argument(help="The run's dump directory (every step in it).", show_default=False)],
    *,
    dump_format: Annotated[str, typer.Option("--format", help=DUMP_FORMATS + ".", show_default=False)],
    model: Annotated[
        Path | None,
        typer.Option(
            help="The checkpoint (local directory): token ids checked against it; kept steps as run directories."
        ),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="Timeline directory (default reports/timeline-<format>-<time>).")
    ] = None,
    workers: Annotated[int, typer.Option(help="Processes reading and analysing steps.")] = 2,
    executor: Annotated[
        str,
        typer.Option(
            "--executor",
            help=f"Where steps are read and analysed: {' or '.join(EXECUTORS)} (each step a Ray task on a cluster).",
        ),
    ] = "local",
    ray_address: RayAddress = None,
    keep: Annotated[
        str,
        typer.Option(help="Steps kept as full run directories: auto (first, last, worst, change points), all, none."),
    ] = "auto",
    worst: Annotated[int, typer.Option(help="With --keep auto: how many steps of largest K3 to keep.")] = 3,
    baseline_steps: Annotated[int, typer.Option(help="The early steps each metric's drift is measured against.")] = 20,
    alpha: Annotated[
        float,
        typer.Option(
            help="The drift test's false-alarm rate per run: the chance that any metric alarms on a run without drift."
        ),
    ] = 0.05,
    follow: Annotated[
        bool, typer.Option("--follow", help="Keep watching the directory; update as steps appear.")
    ] = False,
    poll: Annotated[float, typer.Option(help="--follow: seconds between looks at the directory.")] = 10.0,
    settle: Annotated[
        float, typer.Option(help="--follow: a step is taken once its files are unchanged this many seconds.")
    ] = 5.0,
    idle_exit: Annotated[
        float | None, typer.Option(help="--follow: stop after this many seconds without a new step (default: never).")
    ] = None,
    trust_pickle: TrustPickle = False,
    train_dump: TrainDump = None,
    settings: Annotated[
        list[str] | None, typer.Option("--set", help="Correction thresholds: --set corrections.token_tis=3.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print timeline.json instead of a summary.")] = False,
    overrides: dict[str, object],
) -> None:
    """The mismatch across a run's training steps: import every step of its dumps (in parallel,
    resumable, only new steps on a re-run), test each metric for drift from its early steps, keep
    the steps worth opening as run directories, and write timeline.html. Exit 2 on bad input or
    when a step could not be read (the other steps are kept)."""
    from mismatch_probe.errors import ConfigError
    from mismatch_probe.record import json_safe
    from mismatch_probe.report.timeline_view import timeline_summary
    from mismatch_probe.timeline.runner import TimelineOptions, build_timeline

    given = parse_settings(settings)
    bad = [k for k in given if not k.startswith("corrections.")]
    if bad:
        raise ConfigError(f"timeline --set {', '.join(bad)}: only corrections.* settings")
    corrections = {k.partition(".")[2]: v for k, v in {**overrides, **given}.items() if v is not None}
    options = TimelineOptions(
        format=dump_format,
        source=str(source),
        model=None if model is None else str(model),
        out=None if out_dir is None else str(out_dir),
        workers=workers,
        executor=executor,
        ray_address=ray_address,
        keep=keep,
        worst=worst,
        baseline_steps=baseline_steps,
        alpha=alpha,
        trust_pickle=trust_pickle,
        train_dump=None if train_dump is None else str(train_dump),
        corrections=corrections,
        follow=follow,
        poll_s=poll,
        settle_s=settle,
        idle_exit_s=idle_exit,
    )
    with RichProgress(err) as progress:
        result = build_timeline(options, progress=progress)
    if as_json:
        sys.stdout.write(json.dumps(json_safe(result.record.model_dump()), indent=2) + "\n")
    else:
        out.print(escape(timeline_summary(result.record)))
        out.print(f"timeline: {escape(portable_path(result.out / 'timeline.html'))} (also timeline.md, steps.parquet)")
    for step, message in sorted(result.failed.items()):
        err.print(f"step {step} was not read: {escape(message)}")
    if result.failed:
        raise typer.Exit(2)


FRAMEWORK_NAMES = ", ".join(_FRAMEWORKS)  # the frameworks `init` reads (frameworks/__init__.py)


@app.command()
@friendly_errors
def init(
    framework_name: Annotated[str, typer.Argument(metavar="FRAMEWORK", help=f"One of {FRAMEWORK_NAMES}.")],
    config: Annotated[
        list[str],
        typer.Argument(
            metavar="CONFIG",
            help="The framework's config files or launch scripts, and key=value overrides, as you pass them to it.",
        ),
    ],
    *,
    spec_out: Annotated[Path, typer.Option("--out", help="The spec to write (its prompts go beside it).")] = Path(
        "probe.toml"
    ),
    dataset: Annotated[
        str | None, typer.Option(help="The dataset to sample prompts from (default: the one the config names).")
    ] = None,
    prompt_key: Annotated[
        str | None, typer.Option(help="The dataset's prompt column (default: the config's, else the framework's).")
    ] = None,
    num_prompts: Annotated[int, typer.Option(min=1, help="Prompts to sample, stratified by length.")] = 64,
    seed: Annotated[int, typer.Option(help="The prompt sample's seed.")] = 0,
    model: Annotated[
        str | None, typer.Option(help="A local checkpoint for this machine, instead of the config's model.")
    ] = None,
    settings: Annotated[
        list[str] | None,
        typer.Option("--set", help=SET_HELP + " For this machine; the config's value stays in a comment."),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing spec at --out.")] = False,
) -> None:
    """Write a probe spec that mirrors your RL framework's config: every value with where it came
    from, the settings the probe cannot mirror, prompts sampled from your dataset, and the known
    mismatch risks of the configuration (printed, in the spec, and in the report)."""
    from mismatch_probe.errors import ConfigError
    from mismatch_probe.frameworks.init import init_spec

    if spec_out.exists() and not overwrite:
        raise ConfigError(
            f"{portable_path(spec_out)} exists", hint="pass --overwrite to replace it, or --out another file"
        )
    result = init_spec(
        framework_name,
        config,
        out=spec_out,
        dataset=dataset,
        prompt_key=prompt_key,
        num_prompts=num_prompts,
        seed=seed,
        model=model,
        settings=parse_settings(settings),
        command=" ".join(["mismatch-probe init", framework_name, *config]),
    )
    stack = result.stack
    out.print(f"{escape(stack.framework)}: {len(stack.values)} settings mirrored, {len(stack.unmirrored)} not mirrored")
    for u in stack.unmirrored:
        out.print(f"  not mirrored: {escape(u.key)} = {escape(str(u.value))}: {escape(u.why)}")
    if result.prompts is not None:
        out.print(f"prompts: {escape(result.prompts.summary())}")
    if result.risks:
        out.print(f"[bold]{len(result.risks)} known risk(s) of this configuration:[/]")
        for r in result.risks:
            out.print(f"  [yellow]{escape(r.title)}[/]: {escape(r.detail)} [dim](evidence: {escape(r.evidence)})[/]")
    else:
        out.print("no known risk of this configuration")
    for note in result.notes:
        out.print(f"[yellow]note[/]: {escape(note)}")
    out.print(
        f"spec: {escape(portable_path(result.spec_path))}; run it: mismatch-probe compare {escape(portable_path(result.spec_path))}"
    )


@app.command()
@friendly_errors
def engines() -> None:
    """List the engines and whether each can run here."""
    from rich.table import Table

    from mismatch_probe.engines import registered_engines

    table = Table(title="engines")
    for col in ("name", "available", "description"):
        table.add_column(col)
    for name, entry in sorted(registered_engines().items()):
        missing = entry.missing()
        status = (
            "[green]yes[/]"
            if not missing
            else f"[red]no[/] (missing {', '.join(missing)}: {escape(entry.install_hint)})"
        )
        table.add_row(name, status, entry.description)
    out.print(table)
    from mismatch_probe.engines.api_uses import ENGINE_NAMES, SUPPORTED

    # the releases whose API has every name the adapter needs (engines/api_uses.py)
    ranges = ", ".join(f"{ENGINE_NAMES[e]} {lo}–{hi}" for e, (lo, hi) in SUPPORTED.items())
    out.print(f"supported engine versions: {escape(ranges)} (docs/concepts/engines.md, Supported engine versions)")


if __name__ == "__main__":
    app()

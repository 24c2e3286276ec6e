"""``mismatch-probe timeline``: every step of a run's dumps, its drift, and the steps worth opening.

One pass (:func:`build_timeline`):

1. list the steps the source holds (``dumps.list_steps``) and their files;
2. analyse each step whose fingerprint is new (``store.done_steps``) in worker processes (or, with
   ``executor="ray"``, as Ray tasks on a cluster that mounts the dumps and the output): read it
   (``dump_steps.read_step``: the importers' readers and checks), reduce it to its rows
   (``analysis/timeline.py: step_rows``) and write them atomically (``store.write_step``);
3. rebuild ``steps.parquet`` (``store.consolidate``) and test each metric of
   :data:`~mismatch_probe.analysis.timeline.DRIFT_METRICS` for drift (``analysis/drift.py``);
4. import the steps worth opening (first, last, the worst, each change point) as full run
   directories under ``runs/`` (``importing.import_dump`` + ``analyze``), with ``--model``;
5. write ``timeline.json`` and render the page.

A killed pass loses only the steps in flight: the next one keeps every finished step file and
analyses the rest. ``follow`` repeats the pass as a live run writes new steps, taking a step only
once its files have not changed for ``settle_s`` seconds.
"""

from __future__ import annotations

import multiprocessing
import shutil
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe.analysis.drift import detect_drift, metric_alpha
from mismatch_probe.analysis.metrics import CorrectionThresholds
from mismatch_probe.analysis.timeline import DRIFT_METRICS, N_BOOT, step_rows
from mismatch_probe.config.sweep import EXECUTORS
from mismatch_probe.errors import ConfigError
from mismatch_probe.files import portable_path
from mismatch_probe.pipeline.runs import Progress
from mismatch_probe.timeline import store
from mismatch_probe.timeline.dump_steps import NO_VOCABULARY, DumpSource, read_step, step_files
from mismatch_probe.timeline_record import KEPT_RUNS, KeptStep, TimelineRecord, read_timeline, step_name
from mismatch_probe.version import __version__

KEEP = ("auto", "all", "none")


@dataclass
class TimelineOptions:
    """How to read the run's steps and what to make of them."""

    format: str
    source: str
    model: str | None = None  # the checkpoint: token ids checked against it; kept steps as run directories
    out: str | None = None
    workers: int = 2
    executor: str = "local"  # local: worker processes here; ray: each step a Ray task (EXECUTORS)
    ray_address: str | None = None  # executor ray: the cluster (default: RAY_ADDRESS, else a local one)
    keep: str = "auto"  # auto: first, last, the worst, change points; all; none
    worst: int = 3  # the steps of largest K3 kept with --keep auto
    baseline_steps: int = 20  # the early steps each metric's drift is measured against
    alpha: float = 0.05  # the drift test's false-alarm rate per run: any metric, over the monitored steps
    trust_pickle: bool = False
    train_dump: str | None = None
    corrections: dict[str, Any] = field(default_factory=dict)  # correction thresholds ([corrections])
    n_boot: int = N_BOOT
    # follow a live run: a step is taken once its files are unchanged for settle_s
    follow: bool = False
    poll_s: float = 10.0
    settle_s: float = 5.0
    idle_exit_s: float | None = None  # stop following after this long without a new step (None: never)


@dataclass
class TimelineResult:
    out: Path
    record: TimelineRecord
    analysed: list[int]  # the steps this invocation analysed (the others were on disk)
    failed: dict[int, str]


@dataclass(frozen=True)
class _Task:
    source: DumpSource
    step: int
    fingerprint: str
    out: str
    thresholds: dict[str, Any]
    n_boot: int


@dataclass
class _Done:
    step: int
    n_tokens: int
    notes: list[str]
    seconds: float


def analyse_step(task: _Task) -> _Done:
    """Read, reduce and write one step (in a worker process; a module-level function, so it pickles)."""
    t0 = time.perf_counter()
    read = read_step(task.source, task.step)
    rows = step_rows(task.step, read.tokens, CorrectionThresholds(**task.thresholds), n_boot=task.n_boot)
    store.write_step(Path(task.out), task.step, rows, task.fingerprint)
    return _Done(task.step, len(read.tokens.logp_infer), read.notes, time.perf_counter() - t0)


def build_timeline(opts: TimelineOptions, *, progress: Progress | None = None) -> TimelineResult:
    """One pass over the source (or, with ``opts.follow``, passes until it stays idle); see the module."""
    progress = progress or Progress()
    _check(opts)
    out = Path(opts.out or Path("reports") / f"timeline-{opts.format}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    source = _source(opts)
    analysed: list[int] = []
    failed: dict[int, str] = {}
    notes: list[str] = []
    t0 = time.perf_counter()
    last_new = time.monotonic()
    while True:
        new, fails, step_notes = _pass(source, opts, out, progress)
        analysed += new
        failed.update(fails)
        notes += [n for n in step_notes if n not in notes]
        record = finish(
            out,
            opts,
            source,
            failed,
            notes,
            time.perf_counter() - t0,
            status="following" if opts.follow else "complete",
        )
        if not opts.follow:
            break
        if new:
            last_new = time.monotonic()
        elif opts.idle_exit_s is not None and time.monotonic() - last_new >= opts.idle_exit_s:
            break
        try:
            time.sleep(opts.poll_s)
        except KeyboardInterrupt:
            break
    if opts.follow:
        record.status = "complete"
        record.write(out)
    return TimelineResult(out, record, sorted(analysed), failed)


def _check(opts: TimelineOptions) -> None:
    if opts.keep not in KEEP:
        raise ConfigError(f"--keep {opts.keep!r}: choose one of {', '.join(KEEP)}")
    if opts.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {opts.workers}")
    if opts.executor not in EXECUTORS:
        raise ConfigError(f"--executor {opts.executor!r}: choose one of {', '.join(EXECUTORS)}")
    if opts.worst < 0:
        raise ConfigError(f"--worst must be >= 0, got {opts.worst}")
    if opts.baseline_steps < 2:
        raise ConfigError(f"--baseline-steps must be >= 2, got {opts.baseline_steps}")
    if not 0.0 < opts.alpha < 0.5:
        raise ConfigError(f"--alpha must be in (0, 0.5), got {opts.alpha}")
    try:
        CorrectionThresholds(**opts.corrections)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--set corrections.*: {exc}".splitlines()[0]) from None


def _source(opts: TimelineOptions) -> DumpSource:
    vocab = NO_VOCABULARY
    if opts.model is not None:
        from mismatch_probe.modeling.loading import check_model_dir, read_config, text_setting

        vocab = int(text_setting(read_config(check_model_dir(opts.model)), "vocab_size") or NO_VOCABULARY)
    return DumpSource(
        format=opts.format,
        path=str(Path(opts.source).resolve()),
        trust_pickle=opts.trust_pickle,
        trainer_path=opts.train_dump,
        vocab_size=vocab,
        options={"thresholds": opts.corrections, "n_boot": opts.n_boot, "vocab": vocab},
    )


def _settled(files: list[Path], settle_s: float) -> bool:
    """A live run's step is whole once none of its files changed for ``settle_s`` seconds."""
    now = time.time()
    try:
        return all(now - f.stat().st_mtime >= settle_s for f in files)
    except FileNotFoundError:
        return False


def _pass(
    source: DumpSource, opts: TimelineOptions, out: Path, progress: Progress
) -> tuple[list[int], dict[int, str], list[str]]:
    """Analyse every step that is new or changed; returns (analysed, failed, notes)."""
    steps = step_files(source)
    done = store.done_steps(out)
    tasks = []
    for step, files in sorted(steps.items()):
        if opts.follow and not _settled(files, opts.settle_s):
            continue
        fingerprint = store.source_fingerprint(files, source.options)
        if done.get(step) != fingerprint:
            tasks.append(_Task(source, step, fingerprint, str(out), dict(opts.corrections), opts.n_boot))
    analysed: list[int] = []
    failed: dict[int, str] = {}
    notes: list[str] = []
    if not tasks:
        return analysed, failed, notes
    progress.stage("steps", len(tasks))

    def take(step: int, result: _Done | BaseException) -> None:
        if isinstance(result, ConfigError):
            failed[step] = str(result)
        elif isinstance(result, BaseException):
            raise result
        else:
            analysed.append(step)
            notes.extend(f"step {step}: {n}" for n in result.notes)
        progress.advance("steps", 1)

    if opts.executor == "ray":
        for step, result in _on_ray(tasks, opts.ray_address, in_flight=2 * opts.workers):
            take(step, result)
        return analysed, failed, notes
    if opts.workers == 1 or len(tasks) == 1:
        for task in tasks:
            try:
                take(task.step, analyse_step(task))
            except ConfigError as exc:
                take(task.step, exc)
        return analysed, failed, notes
    # spawned, not forked: the parent may hold threads (Arrow's pool, torch's) a fork would copy mid-lock
    with ProcessPoolExecutor(max_workers=opts.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        running: dict[Future, int] = {}
        queue = list(tasks)
        while queue or running:
            while queue and len(running) < 2 * opts.workers:  # a bounded queue: a kill loses little
                task = queue.pop(0)
                running[pool.submit(analyse_step, task)] = task.step
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in finished:
                step = running.pop(fut)
                error = fut.exception()
                take(step, error if error is not None else fut.result())
    return analysed, failed, notes


def _on_ray(tasks: list[_Task], address: str | None, *, in_flight: int):
    """Each step's :func:`analyse_step` as a Ray task (one CPU each), with at most twice the cluster's
    CPUs (or ``in_flight``) submitted at once, so a killed driver loses few; yields (step, result or
    error) as they finish. A task whose worker dies is run again by Ray; a step's file is written
    whole or not at all, so a re-run analyses only the steps without one."""
    from mismatch_probe.ray_cluster import MAX_RETRIES, connected

    with connected(address) as ray:
        remote = ray.remote(analyse_step).options(num_cpus=1, max_retries=MAX_RETRIES)
        limit = max(in_flight, int(ray.cluster_resources().get("CPU", 1)) * 2)
        queue = list(tasks)
        running: dict[Any, int] = {}
        while queue or running:
            while queue and len(running) < limit:
                task = queue.pop(0)
                running[remote.remote(task)] = task.step
            ready, _ = ray.wait(list(running), num_returns=1)
            for ref in ready:
                step = running.pop(ref)
                try:
                    yield step, ray.get(ref)
                except ray.exceptions.RayTaskError as exc:  # a step that could not be read: its own error
                    yield step, exc.cause if isinstance(exc.cause, BaseException) else exc


def finish(
    out: Path,
    opts: TimelineOptions,
    source: DumpSource | None,
    failed: dict[int, str],
    notes: list[str],
    seconds: float,
    *,
    status: str,
) -> TimelineRecord:
    """steps.parquet, the drift tests, the kept steps, timeline.json and the page, from the step files."""
    table = store.consolidate(out)
    drift = drift_tests(table, baseline_steps=opts.baseline_steps, alpha=opts.alpha)
    all_rows = _group(table, "all")
    steps = all_rows["step"].astype(int) if len(all_rows["step"]) else np.zeros(0, int)
    kept = kept_steps(all_rows, drift, keep=opts.keep, worst=opts.worst)
    if source is not None:
        kept = _write_kept(out, opts, kept)
    else:  # a monitor's steps: their sampled sequences are in sequences/, not run directories
        for k in kept:
            k.reason = "logged by a Monitor: the step's sampled sequences are in sequences/"
    previous = read_timeline(out) if (out / "timeline.json").is_file() else None
    record = TimelineRecord(
        probe_version=__version__,
        status=status,
        source={
            "format": opts.format,
            "path": portable_path(Path(opts.source).resolve()) if source is not None else opts.source,
            "model": None if opts.model is None else portable_path(Path(opts.model).resolve()),
        },
        steps={
            "count": len(steps),
            "first": int(steps[0]) if len(steps) else None,
            "last": int(steps[-1]) if len(steps) else None,
            "model_tokens": int(np.nansum(all_rows["n_model_tokens"])) if len(steps) else 0,
            "failed": {str(k): v for k, v in sorted(failed.items())},
        },
        options={
            "baseline_steps": opts.baseline_steps,
            "alpha": opts.alpha,
            "alpha_scope": "run",  # alpha bounds the run's false alarms over every metric (drift_tests)
            "keep": opts.keep,
            "worst": opts.worst,
            "workers": opts.workers,
            "executor": opts.executor,
            "n_boot": opts.n_boot,
            "corrections": CorrectionThresholds(**opts.corrections).as_record(),
        },
        drift=drift,
        kept=kept,
        notes=notes or (previous.notes if previous else []),
        timings={"seconds": round(seconds, 3)},
    )
    record.write(out)
    from mismatch_probe.report.pages import write_timeline_pages

    record.figures = write_timeline_pages(out, record, table)
    record.write(out)
    return record


def _group(table: pa.Table, group: str) -> dict[str, np.ndarray]:
    import pyarrow.compute as pc

    rows = table.filter(pc.equal(table.column("group"), group))
    return {
        name: rows.column(name).to_numpy(zero_copy_only=False).astype(float)
        for name in rows.column_names
        if name != "group"
    }


def drift_tests(table: pa.Table, *, baseline_steps: int, alpha: float) -> dict[str, dict[str, Any]]:
    """The drift test of each metric of :data:`DRIFT_METRICS` over the steps (group ``all``), each at
    ``alpha`` split over the metrics tested (:func:`~mismatch_probe.analysis.drift.metric_alpha`), so
    that ``alpha`` is the run's false-alarm rate: the chance that any metric alarms without a drift."""
    rows = _group(table, "all")
    out: dict[str, dict[str, Any]] = {}
    if not len(rows.get("step", [])):
        return out
    steps = rows["step"].astype(np.int64)
    # a value this run never has (routing of a dense model) is not tested, and takes no share of alpha
    tested = {m: s for m, s in DRIFT_METRICS.items() if np.isfinite(rows[m]).any() or np.isinf(rows[m]).any()}
    for metric, scale in tested.items():
        low, high = rows.get(f"{metric}_low"), rows.get(f"{metric}_high")
        result = detect_drift(
            steps,
            rows[metric],
            low,
            high,
            metric=metric,
            baseline_steps=baseline_steps,
            alpha=metric_alpha(alpha, len(tested)),
            scale=scale,
        )
        out[metric] = result.to_dict()
    return out


def kept_steps(
    rows: dict[str, np.ndarray], drift: dict[str, dict[str, Any]], *, keep: str, worst: int
) -> list[KeptStep]:
    """The steps worth opening and why: the first, the last, the ``worst`` of largest K3 and each
    metric's change point (``keep="all"``: every step; ``"none"``: none)."""
    steps = rows.get("step", np.zeros(0)).astype(np.int64)
    if keep == "none" or not len(steps):
        return []
    why: dict[int, list[str]] = {}
    if keep == "all":
        why = {int(s): ["all"] for s in steps}
    why.setdefault(int(steps[0]), []).append("first")
    why.setdefault(int(steps[-1]), []).append("last")
    k3 = np.where(np.isnan(rows["k3_kl"]), -np.inf, rows["k3_kl"])
    for i in np.argsort(-k3, kind="stable")[:worst]:
        if np.isfinite(k3[i]) or k3[i] > 0:
            why.setdefault(int(steps[i]), []).append("worst k3_kl")
    for metric, result in drift.items():
        if result.get("detected") and result.get("change_step") is not None:
            why.setdefault(int(result["change_step"]), []).append(f"change {metric}")
    return [KeptStep(step=s, why=w) for s, w in sorted(why.items())]


def _write_kept(out: Path, opts: TimelineOptions, kept: list[KeptStep]) -> list[KeptStep]:
    """Each kept step as a full run directory (``import`` + ``analyze``), with ``--model``; run
    directories of steps no longer kept (a live run's former last step) are removed."""
    runs = out / KEPT_RUNS
    wanted = {step_name(k.step) for k in kept}
    if runs.is_dir():
        for d in runs.iterdir():
            if d.is_dir() and d.name not in wanted:
                shutil.rmtree(d)
    if opts.model is None:
        for k in kept:
            k.reason = "no --model: a run directory needs the checkpoint the step sampled with"
        return kept
    from mismatch_probe.importing import ImportOptions, import_dump
    from mismatch_probe.pipeline.commands import analyze
    from mismatch_probe.record import find_record

    for k in kept:
        run_dir = runs / step_name(k.step)
        try:
            record = find_record(run_dir) if run_dir.is_dir() else None
            if record is None or record.status != "complete":
                import_dump(
                    opts.format,
                    opts.source,
                    model=opts.model,
                    out=run_dir,
                    options=ImportOptions(
                        step=k.step,
                        trust_pickle=opts.trust_pickle,
                        trainer_path=opts.train_dump,
                        overrides={f"corrections.{key}": v for key, v in opts.corrections.items()},
                    ),
                )
                analyze(run_dir)
            k.run = f"{KEPT_RUNS}/{step_name(k.step)}"
        except ConfigError as exc:
            k.reason = str(exc)
    return kept

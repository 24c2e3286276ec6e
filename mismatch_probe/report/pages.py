"""The report files in a run's, a sweep's or a timeline's directory, written atomically from its one
view: a run's ``figures/<id>.svg``, ``report.md`` and ``report.html`` (the render stage writes them
once from the in-memory record; ``mismatch-probe report RUN`` again from the directory alone), a
sweep's ``sweep.md`` and ``sweep.html`` (from ``sweep.json`` alone), a timeline's
``figures/<id>.svg``, ``timeline.md`` and ``timeline.html`` (from ``timeline.json`` and
``steps.parquet``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mismatch_probe.config.sweep import sweep_of
from mismatch_probe.files import write_atomic
from mismatch_probe.record import RunRecord
from mismatch_probe.report import html, markdown
from mismatch_probe.report.data import load_run, step_columns
from mismatch_probe.report.figures import FIGURES_DIR, DrawnFigure, run_figures, sweep_figures, timeline_figures
from mismatch_probe.report.next_files import write_next_files
from mismatch_probe.report.run_view import run_view
from mismatch_probe.report.sweep_view import SWEEP_HTML, SWEEP_MD, sweep_view
from mismatch_probe.report.timeline_view import TIMELINE_HTML, TIMELINE_MD, view_of
from mismatch_probe.sweep_record import SweepRecord
from mismatch_probe.timeline_record import TimelineRecord

if TYPE_CHECKING:
    import pyarrow as pa

REPORT_MD = "report.md"


def write_figure_files(run_dir: Path, figures: list[DrawnFigure]) -> list[dict]:
    """The report's figures as SVG files too (``figures/<id>.svg``), for report.md and for slides;
    returns run.json's list of them."""
    d = run_dir / FIGURES_DIR
    d.mkdir(exist_ok=True)
    for stale in d.glob("*"):  # figures of an earlier version of the report
        if stale.is_file():
            stale.unlink()
    for f in figures:
        write_atomic(run_dir / f.info.path, f.svg)
    return [{"id": f.info.id, "title": f.info.title, "path": f.info.path} for f in figures]


def write_run_pages(run_dir: Path, record: RunRecord, dist: dict, figures: list[DrawnFigure]) -> None:
    """report.md and report.html, from the run's one view, and the files its "What to do next" names
    (next-sweep.toml, suggested-gate.toml)."""
    view = run_view(record, run_dir, dist)
    if sweep_of(run_dir) is None:  # a sweep's point: the sweep's page says what to do next
        write_next_files(run_dir, record)
    write_atomic(run_dir / REPORT_MD, markdown.render_run(view))
    write_atomic(run_dir / html.REPORT_HTML, html.render_run(view, figures))


def render_again(run_dir: str | Path) -> Path:
    """A finished run's figures, report.md and report.html rendered again from its directory (after
    an upgrade, or a rendering that failed); returns report.html's path. run.json is rewritten only
    when its list of figures changes."""
    data = load_run(run_dir)
    figures = run_figures(data.record, data.dist)
    listed = write_figure_files(data.path, figures)
    if [f.to_dict() for f in data.record.figures or []] != listed:
        data.record.update_sections({"figures": listed})
        data.record.write(data.path)
    write_run_pages(data.path, data.record, data.dist, figures)
    return data.path / html.REPORT_HTML


def write_sweep_reports(sweep_dir: Path, record: SweepRecord) -> Path:
    """Write sweep.md and sweep.html beside sweep.json; returns sweep.html's path."""
    view = sweep_view(record)
    write_atomic(sweep_dir / SWEEP_MD, markdown.render_sweep(view))
    return write_atomic(sweep_dir / SWEEP_HTML, html.render_sweep(view, sweep_figures(record)))


def write_timeline_pages(out: Path, record: TimelineRecord, table: pa.Table) -> list[str]:
    """``figures/*.svg``, ``timeline.md`` and ``timeline.html`` in the timeline directory ``out``;
    returns the figures' paths (relative to ``out``), for the record."""
    columns = step_columns(table)
    view = view_of(record, columns)
    figures = timeline_figures(record, columns)
    listed = write_figure_files(Path(out), figures)
    write_atomic(Path(out) / TIMELINE_MD, markdown.render_timeline(view))
    write_atomic(Path(out) / TIMELINE_HTML, html.render_timeline(view, figures))
    return [f["path"] for f in listed]


def render_timeline_again(out: str | Path) -> Path:
    """A timeline's page rendered again from its timeline.json and steps.parquet (``mismatch-probe
    report DIR``); returns timeline.html's path."""
    import pyarrow.parquet as pq

    from mismatch_probe.timeline_record import STEPS_PARQUET, read_timeline

    out = Path(out)
    record = read_timeline(out)
    record.figures = write_timeline_pages(out, record, pq.read_table(out / STEPS_PARQUET))
    record.write(out)
    return out / TIMELINE_HTML

"""The HTML pages of the views (Jinja2 templates, autoescape on): a run's ``report.html``, several
runs side by side, a sweep's ``sweep.html``, a timeline's ``timeline.html``.

Each page is self-contained and inert: figures are embedded SVG data URIs, styles are inline,
there is no script at all, and a Content-Security-Policy forbids scripts and network loads
anyway, so a prompt or a model output that smuggled markup past escaping still could not run.
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.errors import ConfigError
from mismatch_probe.files import write_atomic
from mismatch_probe.report.comparison_view import ComparisonView
from mismatch_probe.report.data import load_run
from mismatch_probe.report.figures import DrawnFigure
from mismatch_probe.report.run_view import RunView, gap_legend
from mismatch_probe.report.sweep_view import SweepView
from mismatch_probe.report.timeline_view import TimelineView
from mismatch_probe.report.view import Page
from mismatch_probe.version import __version__

REPORT_HTML = "report.html"


@functools.cache
def _templates():
    from jinja2 import Environment, PackageLoader, StrictUndefined

    return Environment(
        loader=PackageLoader("mismatch_probe.report", "templates"),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _page(template: str, view: Page, figures: Sequence[DrawnFigure], **extra) -> str:
    """The page of ``template`` over ``view`` (``v`` in the template), in the frame every page
    shares (``base.html.j2``), the drawn figures it lists embedded."""
    srcs = {f.info.id: "data:image/svg+xml;base64," + base64.b64encode(f.svg).decode("ascii") for f in figures}
    missing = [f.id for f in view.figures if f.id not in srcs]
    if missing:  # a page shows the figures its view lists, drawn
        raise ValueError(f"figures not drawn: {', '.join(missing)}")
    return (
        _templates()
        .get_template(template)
        .render(v=view, title=view.title, srcs=srcs, version=__version__, generated_at=_now(), **extra)
    )


def render_run(view: RunView, figures: Sequence[DrawnFigure]) -> str:
    """A run's report.html."""
    return _page("run.html.j2", view, figures, gap_classes=gap_legend())


def render_comparison(view: ComparisonView, figures: Sequence[DrawnFigure]) -> str:
    """Several runs side by side."""
    return _page("compare.html.j2", view, figures)


def render_sweep(view: SweepView, figures: Sequence[DrawnFigure]) -> str:
    """A sweep's sweep.html."""
    return _page("sweep.html.j2", view, figures)


def render_timeline(view: TimelineView, figures: Sequence[DrawnFigure]) -> str:
    """A timeline's timeline.html."""
    return _page("timeline.html.j2", view, figures)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


@dataclass
class WrittenReport:
    path: Path
    n_bytes: int
    seconds: float
    n_runs: int


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> WrittenReport:
    """Render the report of one run (default ``<run>/report.html``) or the comparison of several
    (default ``compare.html``) and write it atomically."""
    from mismatch_probe.report.comparison_view import comparison_view, label_runs
    from mismatch_probe.report.figures import comparison_figures, run_figures
    from mismatch_probe.report.run_view import run_view

    if not run_dirs:
        raise ConfigError("no run directories given", hint="mismatch-probe report RUN_DIR [RUN_DIR ...]")
    t0 = time.perf_counter()
    runs = [load_run(d) for d in run_dirs]
    target = Path(out) if out else (runs[0].path / REPORT_HTML if len(runs) == 1 else Path("compare.html"))
    if target.is_dir():
        raise ConfigError(f"--out {target} is a directory", hint="give a file name, e.g. --out compare.html")
    if len(runs) == 1:
        run = runs[0]
        html = render_run(run_view(run.record, run.path, run.dist), run_figures(run.record, run.dist))
    else:
        runs = label_runs(runs)
        html = render_comparison(comparison_view(runs), comparison_figures(runs))
    write_atomic(target, html)
    return WrittenReport(target, len(html.encode("utf-8")), time.perf_counter() - t0, len(runs))

"""What every figure shares: a :class:`matplotlib.figure.Figure` with fixed margins, the style,
log axes with plain tick labels, and the inert, reproducible SVG it is written as.

Figures are built on ``Figure`` directly, never pyplot, so no global figure registry, GUI backend
or display is involved; matplotlib is imported on the first figure, not with the package.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mismatch_probe.numbers import tick

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

BLUE, RED, GREEN, GREY = "#1f77b4", "#d62728", "#2ca02c", "#999999"
RUN_COLORS = (BLUE, RED, GREEN, "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
FLOOR = 1e-9  # where a log axis shows zero
DPI = 100  # of the rasterized parts (density images, dense scatters) inside an SVG

STYLE: dict[Any, Any] = {
    "font.size": 9.0,
    "axes.labelsize": 9.5,
    "axes.titlesize": 9.5,
    "legend.fontsize": 8.0,
    "legend.frameon": False,
    "xtick.labelsize": 8.5,
    "ytick.labelsize": 8.5,
    "axes.grid": True,
    "grid.color": "#e6e6e6",
    "grid.linewidth": 0.8,
    "axes.axisbelow": True,
    "axes.formatter.use_mathtext": False,
    "text.parse_math": False,  # a run's or a setting's name with "$" in it is text, not TeX
    # an SVG file is the same bytes each time it is rendered: no date, ids from a fixed salt
    "svg.hashsalt": "mismatch-probe",
    "svg.fonttype": "none",  # text as text (drawing every glyph as a path took a third of the time)
    "svg.image_inline": True,
}

# Margins in inches, so every figure width keeps room for tick and axis labels. A fixed layout
# instead of matplotlib's constrained layout: measured with cProfile on a 10M-token run's figures,
# the layout solver (which draws every tick label to size it) was ~40% of rendering.
MARGINS = {"left": 0.8, "right": 0.2, "bottom": 0.55, "top": 0.3}


@contextlib.contextmanager
def style() -> Iterator[None]:
    """The report's style while figures are built and written (a scoped rc, restored after)."""
    import matplotlib

    with matplotlib.rc_context(STYLE):
        yield


def new_figure(
    width: float, height: float, ncols: int = 1, wspace: float = 0.28, **margins: float
) -> tuple[Figure, list[Axes]]:
    """A figure of ``width`` x ``height`` inches with ``ncols`` axes side by side; ``margins``
    (inches) override :data:`MARGINS`."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    m = MARGINS | margins
    fig.subplots_adjust(
        left=m["left"] / width,
        right=1 - m["right"] / width,
        bottom=m["bottom"] / height,
        top=1 - m["top"] / height,
        wspace=wspace,
    )
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def finish(fig: Figure) -> Figure:
    """Log and symlog axes get plain tick labels ("0.001", "1e-05") and no minor ticks: the default
    mathtext labels (10^k parsed by pyparsing) and a dozen minor ticks per decade were, measured
    with cProfile, half of the time drawing a report's figures. A log axis left to the default
    locator that spans under three decades is ticked at 1, 2 and 5 per decade instead."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    for ax in fig.axes:
        for axis, limits in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            scale = axis.get_scale()
            if scale not in ("log", "symlog"):
                continue
            axis.set_minor_locator(NullLocator())
            if axis.isDefault_majfmt:
                axis.set_major_formatter(FuncFormatter(tick))
            lo, hi = sorted(abs(v) for v in limits)
            if scale == "log" and axis.isDefault_majloc and lo > 0:
                decades = math.log10(hi / lo)
                if decades < 3:
                    axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
                elif decades > 9:  # a tick every other decade or more, not a wall of labels
                    axis.set_major_locator(LogLocator(base=10, numticks=8))
    return fig


def colorbar(fig: Figure, mappable: Any, ax: Any, label: str) -> None:
    """A log colour scale beside ``ax`` with plain tick labels (see :func:`finish`)."""
    from matplotlib.ticker import FuncFormatter

    bar = fig.colorbar(mappable, ax=ax, fraction=0.05, pad=0.03, label=label, format=FuncFormatter(tick))
    bar.minorticks_off()


def to_svg(fig: Figure) -> bytes:
    """The figure as SVG bytes: no script, no reference outside the file (raster parts are inline
    PNG data), no date, so re-rendering a run gives the same file."""
    buf = io.BytesIO()
    with style():
        # no metadata block at all: it held the date, and URIs nothing needs
        fig.savefig(buf, format="svg", dpi=DPI, metadata=dict.fromkeys(("Date", "Type", "Format", "Creator")))
    svg = buf.getvalue()
    return svg[svg.index(b"<svg") :]  # without the XML prolog and DOCTYPE: an <img> needs neither


def histogram(ax: Axes, counts, edges, color: str, *, fill_from: float | None = None, **kw) -> None:
    """``counts[i]`` over ``[edges[i], edges[i+1])`` as steps, filled down to ``fill_from`` when given.
    Drawn as a step line and polygon rather than ``Axes.stairs``, whose patch has its data limits
    computed curve by curve (measured: the costliest call of an overlay figure)."""
    import numpy as np

    heights = np.append(counts, counts[-1])  # the last bin's step runs to the last edge
    if fill_from is None:
        ax.step(edges, heights, where="post", color=color, **kw)
    else:
        ax.fill_between(edges, heights, fill_from, step="post", color=color, lw=0, **kw)


def log_y(ax: Axes) -> None:
    """A log y axis where a series was drawn (each has a label); an axis with none (no model
    tokens) says so instead."""
    if ax.get_legend_handles_labels()[0]:
        ax.set_yscale("log")
    else:
        empty(ax)


def empty(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no model tokens", transform=ax.transAxes, ha="center", color="#888")


def legend(ax: Axes, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)

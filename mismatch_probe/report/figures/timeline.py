"""A timeline's figures: each metric against the step (``steps.parquet``'s columns,
:func:`mismatch_probe.report.data.step_columns`), drawn with the run figures' helpers: the step's
bootstrap band, the baseline window shaded, its median as a line, the change point and its
interval, and the published ranges where the project has them. A long timeline is drawn as the
range of each run of steps (:func:`envelope`), so a figure's size stays bounded. The page's list of
them is :func:`mismatch_probe.report.figures.timeline_figure_list`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mismatch_probe.analysis.metric_docs import (
    K3_BY_GPU,
    NEMO_RL_MULT_ERROR_THRESHOLD,
    PUBLISHED_K3,
    VERL_PROB_DIFF_EXPECTED,
    VERL_PROB_DIFF_ISSUE,
)
from mismatch_probe.report.data import Columns
from mismatch_probe.report.figures.drawing import BLUE, FLOOR, GREEN, GREY, RED, RUN_COLORS, new_figure
from mismatch_probe.report.labels import SHARES, metric_label
from mismatch_probe.timeline_record import TimelineRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MARKERS_UP_TO = 60  # a line of fewer steps marks each one (one step alone is a point, not a line)
ENVELOPE_BINS = 150  # a longer series is drawn as the range of each of this many runs of steps
BAND_ALPHA = 0.22


def _positive(values: np.ndarray) -> np.ndarray:
    """Values on a log axis: 0 and below at the floor (NaN stays a gap)."""
    return np.where(np.isnan(values), np.nan, np.maximum(values, FLOOR))


def _runs(x: np.ndarray, y: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """``y`` cut into at most ``bins`` runs of consecutive steps (a row each, NaN-padded), and the
    first and last step of each run, interleaved."""
    n = len(y)
    size = -(-n // bins)
    k = -(-n // size)
    block = np.full(k * size, np.nan)
    block[:n] = y
    starts = np.arange(k) * size
    return block.reshape(k, size), np.column_stack([x[starts], x[np.minimum(starts + size - 1, n - 1)]]).ravel()


def envelope(x: np.ndarray, y: np.ndarray, bins: int = ENVELOPE_BINS) -> tuple[np.ndarray, np.ndarray]:
    """A long series drawn as ``bins`` runs of steps, each as its smallest and largest value in the
    order they occur, so a figure's size stays bounded however many steps there are and no spike
    is smoothed away; a run with no value is a gap (NaN)."""
    if len(y) <= 2 * bins:
        return x, y
    block, xs = _runs(x, y, bins)
    lo, hi = np.fmin.reduce(block, axis=1), np.fmax.reduce(block, axis=1)  # NaN only where all are
    first = np.argmin(np.where(np.isnan(block), np.inf, block), axis=1) <= np.argmax(
        np.where(np.isnan(block), -np.inf, block), axis=1
    )
    return xs, np.column_stack([np.where(first, lo, hi), np.where(first, hi, lo)]).ravel()


def _line(ax: Axes, x: np.ndarray, y: np.ndarray, color: str, label: str, *, log: bool, lw: float = 1.2) -> bool:
    """A metric against the step; False (nothing drawn) when it has no value."""
    if not len(y) or not np.isfinite(y).any():
        return False
    xs, ys = envelope(x, _positive(y) if log else y, ENVELOPE_BINS)
    marker = "o" if len(x) <= MARKERS_UP_TO else None
    ax.plot(xs, ys, color=color, lw=lw, label=label, marker=marker, ms=2.5)
    return True


def _band(ax: Axes, x: np.ndarray, cols: dict[str, np.ndarray], key: str, color: str, *, log: bool) -> None:
    """A metric's per-step interval, shaded (over a run of steps: its lowest low to its highest high)."""
    low, high = cols.get(f"{key}_low"), cols.get(f"{key}_high")
    if low is None or high is None or not np.isfinite(low).any():
        return
    if log:
        low, high = _positive(low), _positive(high)
    if len(x) > 2 * ENVELOPE_BINS:
        lows, xs = _runs(x, low, ENVELOPE_BINS)
        highs, _ = _runs(x, high, ENVELOPE_BINS)
        x, low, high = (xs[0::2] + xs[1::2]) / 2, np.fmin.reduce(lows, axis=1), np.fmax.reduce(highs, axis=1)
    ax.fill_between(x, low, high, color=color, alpha=BAND_ALPHA, lw=0)


def _window(ax: Axes, record: TimelineRecord, metrics: tuple[str, ...]) -> None:
    """The baseline window of the first of ``metrics`` that was tested, shaded."""
    for metric in metrics:
        span = record.drift_of(metric).get("baseline_steps")
        if span and not record.drift[metric].get("reason"):
            ax.axvspan(span[0], span[-1], color=GREY, alpha=0.18, lw=0, label="baseline window")
            return


def _number(value: Any) -> float | None:
    """A finite number of a drift result (which writes infinities as "inf"), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value):
        return float(value)
    return None


def _drift(ax: Axes, record: TimelineRecord, metric: str, last: float, color: str = RED, *, log: bool) -> None:
    """A metric's baseline median, and its change point (a line and its interval shaded) with the
    median from it to the alarm, when one was detected. A level a log axis cannot show is left out."""
    r = record.drift.get(metric) or {}
    if not r or r.get("reason"):
        return

    def level(value: Any) -> float | None:
        v = _number(value)
        return None if v is None or (log and v <= 0) else v

    if (baseline := level(r.get("baseline"))) is not None:
        ax.axhline(baseline, color="#5b6473", ls=(0, (4, 3)), lw=0.9)
    change = _number(r.get("change_step"))
    if not r.get("detected") or change is None:
        return
    lo, hi = (_number(v) for v in (r.get("interval") or (None, None))[:2])
    if lo is not None and hi is not None and hi > lo:
        ax.axvspan(lo, hi, color=color, alpha=0.12, lw=0)
    ax.axvline(change, color=color, lw=1.0, label=f"{metric_label(metric)}: change at step {int(change)}")
    if (after := level(r.get("after"))) is not None:
        end = _number(r.get("alarm_step"))
        ax.hlines(after, change, max(end if end is not None else last, change), color=color, ls=(0, (4, 3)), lw=0.9)


def _frame(ax: Axes, x: np.ndarray, ylabel: str, *, log: bool, drawn: bool) -> None:
    """The axes of a metric against the step: the steps' span, integer step ticks (a few: each tick
    is a costly artist), a log y axis for a metric that grows by factors."""
    from matplotlib.ticker import MaxNLocator

    if not drawn:
        ax.text(0.5, 0.5, "no steps", transform=ax.transAxes, ha="center", color="#888")
        ax.set_yticks([])
        return
    if log:
        ax.set_yscale("log")
    lo, hi = float(x[0]), float(x[-1])
    pad = max((hi - lo) * 0.01, 0.5)
    ax.set_xlim(lo - pad, hi + pad)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.set(xlabel="step", ylabel=ylabel)


def _legend_above(fig: Figure, ax: Axes, height: float) -> None:
    """The legend in a band above the axes (no search for a free corner, nothing drawn over the
    data), the figure's top margin grown to hold its rows."""
    handles, _ = ax.get_legend_handles_labels()
    if not handles:
        return
    ncols = min(len(handles), 3)
    rows = -(-len(handles) // ncols)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.01), ncols=ncols, fontsize=7.5, borderaxespad=0.2)
    fig.subplots_adjust(top=1 - (0.12 + 0.19 * rows) / height)


def _x(cols: dict[str, np.ndarray]) -> np.ndarray:
    return cols.get("step", np.zeros(0))


def _last(x: np.ndarray) -> float:
    return float(x[-1]) if len(x) else 0.0


HEIGHT = 3.9  # inches, legend band included
WIDE, NARROW = 11.0, 7.0


def k3_figure(record: TimelineRecord, columns: Columns) -> Figure:
    """K3 with its band and drift marks; the published K3 ranges (``PUBLISHED_K3``) that fall near
    the data, shaded (a band decades away would flatten the data)."""
    cols = columns["all"]
    x = _x(cols)
    fig, (ax,) = new_figure(WIDE, HEIGHT)
    _window(ax, record, ("k3_kl",))
    _band(ax, x, cols, "k3_kl", BLUE, log=True)
    drawn = _line(ax, x, cols.get("k3_kl", np.zeros(0)), BLUE, metric_label("k3_kl"), log=True)
    _drift(ax, record, "k3_kl", _last(x), log=True)
    if drawn:
        y = _positive(np.concatenate([cols[k] for k in ("k3_kl", "k3_kl_low", "k3_kl_high")]))
        y = y[np.isfinite(y)]  # (an infinite K3, a token the trainer gives probability 0, is not drawn)
        lo, hi = float(y.min()) / 1.5, float(y.max()) * 1.5
        for f, color in zip(PUBLISHED_K3, (RUN_COLORS[3], RUN_COLORS[4])):
            if f.high >= lo and f.low <= hi:
                source = f.source.split(",")[0].split(" (")[0]
                ax.axhspan(f.low, f.high, color=color, alpha=0.12, lw=0, label=f"published {f.precision} K3: {source}")
        for (where, low, high), color in zip(K3_BY_GPU, ("#cfe8cf", "#f3dfb8", "#f2c4c4")):
            if high >= lo and low <= hi:
                ax.axhspan(low, high, color=color, alpha=0.35, lw=0, label=f"published bf16 K3, {where}")
        ax.set_ylim(lo, hi)
    _frame(ax, x, "K3 KL", log=True, drawn=drawn)
    _legend_above(fig, ax, HEIGHT)
    return fig


def prob_diff_figure(record: TimelineRecord, columns: Columns) -> Figure:
    cols = columns["all"]
    x = _x(cols)
    fig, (ax,) = new_figure(NARROW, HEIGHT)
    _window(ax, record, ("prob_diff_max", "prob_diff_mean"))
    drawn = False
    for key, color in (("prob_diff_max", RED), ("prob_diff_mean", BLUE)):
        _band(ax, x, cols, key, color, log=True)
        drawn |= _line(ax, x, cols.get(key, np.zeros(0)), color, metric_label(key), log=True)
        _drift(ax, record, key, _last(x), color, log=True)
    if drawn:  # verl's FAQ reads the mean: below 0.005 expected, above 0.01 a precision issue
        ax.axhline(
            VERL_PROB_DIFF_EXPECTED,
            color=GREEN,
            lw=0.8,
            ls=":",
            label=f"verl: mean expected < {VERL_PROB_DIFF_EXPECTED:g}",
        )
        ax.axhline(
            VERL_PROB_DIFF_ISSUE,
            color=RED,
            lw=0.8,
            ls=":",
            label=f"verl: mean > {VERL_PROB_DIFF_ISSUE:g} a precision issue",
        )
    _frame(ax, x, "|p_train − p_infer|", log=True, drawn=drawn)
    _legend_above(fig, ax, HEIGHT)
    return fig


def single_figure(record: TimelineRecord, columns: Columns, key: str, *, log: bool) -> Figure:
    """One metric with its interval (when it has one) and its drift marks."""
    cols = columns["all"]
    x = _x(cols)
    fig, (ax,) = new_figure(NARROW, HEIGHT)
    _window(ax, record, (key,))
    _band(ax, x, cols, key, BLUE, log=log)
    drawn = _line(ax, x, cols.get(key, np.zeros(0)), BLUE, metric_label(key), log=log)
    _drift(ax, record, key, _last(x), log=log)
    if (
        key == "mult_prob_error"
        and drawn
        and np.nanmax(cols.get(key, np.zeros(1))) > 1 + (NEMO_RL_MULT_ERROR_THRESHOLD - 1) / 4
    ):
        # NeMo-RL's threshold, drawn when the data comes near it (else it would flatten the data)
        ax.axhline(
            NEMO_RL_MULT_ERROR_THRESHOLD,
            color=RED,
            lw=0.8,
            ls=":",
            label=f"NeMo-RL threshold {NEMO_RL_MULT_ERROR_THRESHOLD:g}",
        )
    _frame(ax, x, metric_label(key), log=log, drawn=drawn)
    if key in SHARES and drawn:
        _percent(ax)
    _legend_above(fig, ax, HEIGHT)
    return fig


def _percent(ax: Axes) -> None:
    from matplotlib.ticker import PercentFormatter

    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=None))


# χ² on a linear axis: verl's estimate dips below 0 when the true value is near 0 (metric_docs)
RATIO_TAILS = (("chi2_token", BLUE, False), ("ess", GREEN, False), ("abs_delta_p99", RED, True))


def ratio_tails_figure(record: TimelineRecord, columns: Columns) -> Figure:
    """χ² of the token ratios, their ESS and the p99 of |δ|, a panel each (named on its y axis; no legend)."""
    cols = columns["all"]
    x = _x(cols)
    fig, axes = new_figure(WIDE, 3.5, ncols=3, wspace=0.32)
    for ax, (key, color, log) in zip(axes, RATIO_TAILS, strict=True):
        _window(ax, record, (key,))
        drawn = _line(ax, x, cols.get(key, np.zeros(0)), color, metric_label(key), log=log)
        _drift(ax, record, key, _last(x), log=log)
        _frame(ax, x, metric_label(key), log=log, drawn=drawn)  # (a title would cost a layout pass)
    return fig


CORRECTION_LINES = ("token_tis_clipped_share", "token_mask_share", "seq_tis_clipped_share", "geo_rejected_share")


def corrections_figure(record: TimelineRecord, columns: Columns) -> Figure:
    cols = columns["all"]
    x = _x(cols)
    fig, (ax,) = new_figure(NARROW, HEIGHT)
    _window(ax, record, CORRECTION_LINES)
    drawn = False
    for key, color in zip(CORRECTION_LINES, (BLUE, RED, GREEN, RUN_COLORS[3])):
        drawn |= _line(ax, x, cols.get(key, np.zeros(0)), color, metric_label(key), log=False)
        _drift(ax, record, key, _last(x), color, log=False)
    _frame(ax, x, "share clipped or dropped", log=False, drawn=drawn)
    if drawn:
        _percent(ax)
    _legend_above(fig, ax, HEIGHT)
    return fig


def turns_figure(record: TimelineRecord, columns: Columns) -> Figure:
    """K3 of the first turn and of the later ones, each with its band."""
    fig, (ax,) = new_figure(NARROW, HEIGHT)
    _window(ax, record, ("k3_kl",))
    drawn = False
    for group, color, label in (("first", BLUE, "first turn"), ("later", RED, "later turns (after tool output)")):
        cols = columns[group]
        gx = _x(cols)
        _band(ax, gx, cols, "k3_kl", color, log=True)
        drawn |= _line(ax, gx, cols.get("k3_kl", np.zeros(0)), color, label, log=True)
    _frame(ax, _x(columns["all"]), "K3 KL", log=True, drawn=drawn)
    _legend_above(fig, ax, HEIGHT)
    return fig

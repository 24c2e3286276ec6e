"""The comparison and sweep pages' figures, drawn with matplotlib from run records and their stored
distributions (a single run's report draws SVG: :mod:`.figures`).

Rendering only: every number drawn here was computed by the analysis (run.json's breakdowns and
distributions.json's histograms). Figures are built on :class:`matplotlib.figure.Figure`
directly, without pyplot, so no global state, GUI backend or display is involved, and returned as
PNG bytes (a histogram image stays the same size for a 1k- or a 10M-token run).
"""

from __future__ import annotations

import io
import math
from typing import Literal

import numpy as np

from mismatch_probe.analysis.distributions import dense
from mismatch_probe.record import RunRecord

DPI = 100
RUN_COLORS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
FLOOR = 1e-9  # where a log axis shows zero


# Margins in inches, so every figure width keeps room for tick and axis labels. A fixed layout
# instead of matplotlib's constrained layout: measured with cProfile on a 10M-token run's figures,
# the layout solver (which draws every tick label to size it) was ~40% of rendering.
MARGINS = {"left": 0.85, "right": 0.25, "bottom": 0.6, "top": 0.45}


def _figure(
    width: float = 6.4,
    height: float = 4.2,
    ncols: int = 1,
    layout: Literal["constrained"] | None = None,
    **margins: float,
):
    """A figure with ``ncols`` axes, ``margins`` (inches) overriding :data:`MARGINS`;
    ``layout="constrained"`` for labels of unknown length."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout=layout)
    if layout is None:
        m = MARGINS | margins
        fig.subplots_adjust(
            left=m["left"] / width,
            right=1 - m["right"] / width,
            bottom=m["bottom"] / height,
            top=1 - m["top"] / height,
            wspace=0.28,
        )
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def to_png(fig) -> bytes:
    _plain_log_ticks(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _plain_log_ticks(fig) -> None:
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
                axis.set_major_formatter(FuncFormatter(_plain))
            lo, hi = sorted(abs(v) for v in limits)
            if scale == "log" and axis.isDefault_majloc and lo > 0 and math.log10(hi / lo) < 3:
                axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))


def _plain(value: float, _pos=None) -> str:
    return f"{value:g}"


# ---- shared with a run's figures (figures.py) -------------------------------------------------


def bucket_labels(rows: list[dict]) -> list[str]:
    return [f"{_edge(r['p_infer_lo'])}–{_edge(r['p_infer_hi'])}" for r in rows]


def _edge(v: float) -> str:
    return "0" if v == 0 else "1" if v == 1 else f"{v:g}"


def buckets(record: RunRecord, name: str) -> list[dict]:
    """A breakdown of the run (``p_infer_buckets``, ``response_length_buckets``, ``position_buckets``)."""
    return (record.breakdowns or {}).get(name) or []


def _seq_max_log_hist(dist: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence max mismatch over logarithmic bins: the length x mismatch density summed over
    lengths. Its first bin [0, 1e-8) is drawn just below 1e-8."""
    edges = np.array(dist["edges"]["mismatch_log"], float)
    edges[0] = 10 ** (math.log10(edges[1]) - 0.2)
    return dense(dist["sequences"]["length_vs_max_mismatch"]).sum(axis=0).astype(float), edges


def _ratio_axis(ax, edges: np.ndarray) -> np.ndarray:
    """Draw a log-ratio histogram on a symmetric-log x axis; returns the drawable edges."""
    finite = edges.copy()
    finite[0], finite[-1] = -1e3, 1e3  # the open ends, drawn as the outermost bins
    ax.set_xscale("symlog", linthresh=1e-7, linscale=0.6)
    ax.set_xlim(finite[0], finite[-1])
    ax.set_xticks([-100, -1, -1e-2, -1e-4, -1e-6, 0, 1e-6, 1e-4, 1e-2, 1, 100])
    ax.tick_params(axis="x", labelsize=7.5)
    return finite


# ---- several runs ---------------------------------------------------------------------------


def overlay_log_ratio(runs: list[dict]):
    fig, axes = _figure(11.0, 3.9, 2)
    for k, run in enumerate(runs):
        dist = run["dist"]
        edges = np.array(dist["edges"]["log_ratio"], float)
        token = np.sum([np.array(dist["groups"][g]["log_ratio_hist"], float) for g in ("first", "later")], axis=0)
        seq = np.array(dist["sequences"]["log_ratio_hist"], float)
        for ax, counts in ((axes[0], token), (axes[1], seq)):
            finite = _ratio_axis(ax, edges)
            if counts.sum():
                ax.stairs(counts / counts.sum(), finite, color=run["color"], lw=1.4, label=run["label"])
    for ax, what in ((axes[0], "token log-ratio δ"), (axes[1], "sequence log-ratio Σδ")):
        _log_y(ax)
        ax.set_xlabel(what + " (symlog)")
        ax.set_ylabel("share")
    _legend(axes[0], loc="upper left")
    return fig


def overlay_seq_max_mismatch(runs: list[dict]):
    fig, (ax,) = _figure(6.4, 3.8)
    lo = 1e-8
    for run in runs:
        counts, edges = _seq_max_log_hist(run["dist"])
        lo = edges[0]
        if counts.sum():
            ax.stairs(counts / counts.sum(), edges, color=run["color"], lw=1.4, label=run["label"])
    _log_y(ax)
    ax.axvline(0.5, color="#d62728", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlim(lo, 1.0)
    ax.set_xlabel("max |p_train − p_infer| in the sequence (log)")
    ax.set_ylabel("share of sequences")
    _legend(ax)
    return fig


def overlay_abs_delta_by_p_infer(runs: list[dict]):
    fig, (ax,) = _figure(6.8, 4.4, bottom=1.15)  # rotated bucket labels
    labels: list[str] = []
    for run in runs:
        rows = buckets(run["record"], "p_infer_buckets")
        labels = labels or bucket_labels(rows)
        idx = [i for i, r in enumerate(rows) if r.get("count")]
        if not idx:
            continue
        ax.plot(
            idx,
            [max(rows[i]["abs_delta_p99"], FLOOR) for i in idx],
            color=run["color"],
            marker="o",
            ms=3,
            label=f"{run['label']} p99",
        )
        ax.plot(idx, [max(rows[i]["abs_delta_mean"], FLOOR) for i in idx], color=run["color"], ls=":", lw=1)
    _log_y(ax)
    ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=8)
    ax.set_xlabel("p_infer bucket")
    ax.set_ylabel("|delta|  (solid p99, dotted mean)")
    _legend(ax)
    return fig


def overlay_position(runs: list[dict]):
    fig, (ax,) = _figure(6.8, 4.0)
    for run in runs:
        rows = buckets(run["record"], "position_buckets")
        if not rows:
            continue
        centers = [
            math.sqrt(max(r["position_lo"], 1) * (r["position_hi"] or max(r["position_lo"], 1) * 2)) for r in rows
        ]
        ax.plot(
            centers,
            [max(r["prob_diff_mean"], FLOOR) for r in rows],
            color=run["color"],
            marker="o",
            ms=3,
            label=f"{run['label']} mean",
        )
        ax.plot(centers, [max(r["prob_diff_max"], FLOOR) for r in rows], color=run["color"], ls=":", lw=1)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    _log_y(ax)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("token position")
    ax.set_ylabel("|Δp|  (solid mean, dotted max)")
    _legend(ax)
    return fig


def _log_y(ax) -> None:
    """A log y axis where a run's series was drawn (each has a label); an axis with none (no model
    tokens in any run) says so instead."""
    if ax.get_legend_handles_labels()[0]:
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no model tokens", transform=ax.transAxes, ha="center", color="#888")


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7.5, frameon=False, **kw)


def comparison_figures(runs: list[dict]) -> list[dict]:
    """Overlaid distributions; each run dict has ``label``, ``color``, ``record`` (a
    :class:`~mismatch_probe.record.RunRecord`) and ``dist``."""
    figures = [
        (
            "overlay_abs_delta_by_p_infer",
            "|delta| by engine probability",
            "p99 (solid) and mean (dotted) of |delta| per p_infer bucket.",
            overlay_abs_delta_by_p_infer,
        ),
        (
            "overlay_seq_max_mismatch",
            "Per-sequence max mismatch",
            "Share of sequences per (logarithmic) bin of their largest token probability gap; dashed: 0.5.",
            overlay_seq_max_mismatch,
        ),
        ("overlay_log_ratio", "Importance ratios", "Token and sequence log-ratio distributions.", overlay_log_ratio),
        (
            "overlay_position",
            "Mismatch vs token position",
            "Mean (solid) and max (dotted) |Δp| by position bucket.",
            overlay_position,
        ),
    ]
    return [
        {"id": fid, "title": title, "caption": caption, "png": to_png(draw(runs))}
        for fid, title, caption, draw in figures
    ]

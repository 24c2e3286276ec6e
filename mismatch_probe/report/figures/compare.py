"""Several runs' distributions overlaid, one colour a run (the comparison page), each a
:class:`~mismatch_probe.report.data.RunData` with its label and colour set."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.numbers import tick
from mismatch_probe.report.data import RunData
from mismatch_probe.report.figures.drawing import FLOOR, RED, histogram, legend, log_y, new_figure
from mismatch_probe.report.figures.run import bucket_labels, buckets, log_mismatch_edges, ratio_axis, seq_max_log_hist

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def overlay_abs_delta_by_p_infer(runs: Sequence[RunData]) -> Figure:
    fig, (ax,) = new_figure(6.8, 4.4, bottom=1.0)  # rotated bucket labels
    labels: list[str] = []
    for run in runs:
        rows = buckets(run.record, "p_infer_buckets")
        labels = labels or bucket_labels(rows)
        idx = [i for i, r in enumerate(rows) if r.get("count")]
        if not idx:
            continue
        p99 = [max(rows[i]["abs_delta_p99"], FLOOR) for i in idx]
        ax.plot(idx, p99, color=run.color, marker="o", ms=3, label=f"{run.label} p99")
        ax.plot(idx, [max(rows[i]["abs_delta_mean"], FLOOR) for i in idx], color=run.color, ls=":", lw=1)
    log_y(ax)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set(xlabel="p_infer bucket", ylabel="|δ|: p99 solid, mean dotted")
    legend(ax)
    return fig


def overlay_seq_max_mismatch(runs: Sequence[RunData]) -> Figure:
    fig, (ax,) = new_figure(6.4, 3.8)
    lo = 1e-8
    for run in runs:
        counts, edges = seq_max_log_hist(run.dist), log_mismatch_edges(run.dist)
        lo = edges[0]
        if counts.sum():
            histogram(ax, counts / counts.sum(), edges, run.color, lw=1.4, label=run.label)
    log_y(ax)
    ax.axvline(0.5, color=RED, ls="--", lw=1)
    ax.set(xscale="log", xlim=(lo, 1.0))
    ax.set(xlabel="max |p_train − p_infer| in the sequence (log)", ylabel="share of sequences")
    legend(ax)
    return fig


def overlay_log_ratio(runs: Sequence[RunData]) -> Figure:
    fig, axes = new_figure(11.0, 3.9, 2, wspace=0.22)
    for run in runs:
        dist = run.dist
        token = np.sum([np.array(dist["groups"][g]["log_ratio_hist"], float) for g in ("first", "later")], axis=0)
        seq = np.array(dist["sequences"]["log_ratio_hist"], float)
        for ax, counts in ((axes[0], token), (axes[1], seq)):
            edges = ratio_axis(ax, dist["edges"]["log_ratio"])
            if counts.sum():
                histogram(ax, counts / counts.sum(), edges, run.color, lw=1.4, label=run.label)
    for ax, what in ((axes[0], "token log-ratio δ"), (axes[1], "sequence log-ratio Σδ")):
        log_y(ax)
        ax.tick_params(axis="x", labelsize=7.5)
        ax.set(xlabel=what + " (symlog)", ylabel="share")
    legend(axes[0], loc="upper left")
    return fig


def overlay_position(runs: Sequence[RunData]) -> Figure:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, (ax,) = new_figure(6.8, 4.0)
    for run in runs:
        rows = buckets(run.record, "position_buckets")
        if not rows:
            continue
        starts = [max(r["position_lo"], 1) for r in rows]
        centers = [math.sqrt(s * (r["position_hi"] or s * 2)) for s, r in zip(starts, rows)]
        means = [max(r["prob_diff_mean"], FLOOR) for r in rows]
        ax.plot(centers, means, color=run.color, marker="o", ms=3, label=f"{run.label} mean")
        ax.plot(centers, [max(r["prob_diff_max"], FLOOR) for r in rows], color=run.color, ls=":", lw=1)
    log_y(ax)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(FuncFormatter(tick))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel="token position", ylabel="|Δp|: mean solid, max dotted")
    legend(ax)
    return fig

"""A sweep's figures, from its record (sweep.json): the effects of every point on the headline
metrics (a forest plot, a panel per metric), the K3 each correction leaves per point, and cost
against K3."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeGuard

from mismatch_probe.numbers import pct, tick
from mismatch_probe.report.figures.drawing import BLUE, GREEN, RED, RUN_COLORS, legend, new_figure
from mismatch_probe.sweep_record import SweepRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GATE_COLORS = {"PASS": GREEN, "WARN": "#c98a00", "FAIL": RED}


def _nothing(what: str) -> Figure:
    fig, (ax,) = new_figure(7.0, 1.6)
    ax.set_axis_off()
    ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center", va="center", color="#888")
    return fig


def forest_plot(record: SweepRecord, metrics: dict[str, str]) -> Figure:
    """Each point's x-fold change against the baseline with its interval, one panel per metric
    (``{key: label}``) and one row per point, so a point reads across the metrics; the band is the
    baseline's repeat spread (largest / smallest repeat, around 1x)."""

    def usable(e: dict | None) -> bool:
        return e is not None and all(isinstance(v, int | float) and v > 0 and math.isfinite(v) for v in e["ratio"])

    rows = [
        p for p in record.points[1:] if p.status == "ok" and any(usable(p.delta_vs_baseline.get(m)) for m in metrics)
    ]
    if not rows:
        return _nothing("no finished point has an interval against the baseline")
    names = [p.name.replace("+", "\n+ ") for p in rows]
    # room for the longest setting name left of the first panel (a fixed layout; see drawing.MARGINS)
    widest = max(len(line) for n in names for line in n.split("\n"))
    height = 0.45 * len(rows) + 1.3
    fig, axes = new_figure(
        3.3 * len(metrics) + 0.065 * widest, height, ncols=len(metrics), left=0.3 + 0.065 * widest, top=0.3, wspace=0.08
    )
    for ax, (metric, label) in zip(axes, metrics.items()):
        floor = record.floor(metric)
        if floor.get("max_over_min"):
            spread = floor["max_over_min"]
            ax.axvspan(1 / spread, spread, color="#dde2ea", alpha=0.7, label="baseline repeats' spread")
        ax.axvline(1.0, color="#5b6473", lw=1)
        values = []
        for i, p in enumerate(rows):
            e = p.delta_vs_baseline.get(metric)
            if e is None or not usable(e):
                continue
            est, lo, hi = e["ratio"]
            values += [est, lo, hi]
            color = "#9aa3b2" if e["within_noise"] else BLUE
            ax.errorbar([est], [i], xerr=[[est - lo], [hi - est]], fmt="o", color=color, capsize=3)
        ax.set_yticks(range(len(rows)), names if ax is axes[0] else [])
        ax.set_ylim(len(rows) - 0.5, -0.5)
        if values and max(values) / min(values) > 10:  # orders of magnitude: a log axis; a few percent: linear
            ax.set_xscale("log")
        ax.set_title(label)
    axes[0].set_xlabel(f"x-fold vs baseline ({pct(record.level)} interval; grey: within noise)", loc="left")
    legend(axes[0], loc="best")
    return fig


def cost_plot(record: SweepRecord) -> Figure:
    """Each point's cost (throughput lost, %) against its K3, with the gate's K3 line when it has one."""
    thresholds = record.gate_bounds()
    pts: list[tuple[str, float, float, str | None]] = []
    for p in record.points:
        c, k3 = p.cost.get("cost"), p.metrics.get("k3_kl")
        if p.status == "ok" and isinstance(c, int | float) and isinstance(k3, int | float) and k3 > 0:
            pts.append((p.name, float(c), float(k3), p.gate))
    if not pts:
        return _nothing("no finished point with a measured cost")
    fig, (ax,) = new_figure(7.0, 4.2)
    placed: dict[tuple[float, float], int] = {}  # names of points that coincide go one under another
    for name, c, k3, gate in pts:
        ax.scatter([100 * c], [k3], color=GATE_COLORS.get(gate or "", BLUE), s=30, zorder=3)
        spot = (round(100 * c), round(math.log10(k3), 1))
        placed[spot] = placed.get(spot, -1) + 1
        ax.annotate(name, (100 * c, k3), fontsize=7, xytext=(5, 3 - 9 * placed[spot]), textcoords="offset points")
    if "k3_kl" in thresholds:
        ax.axhline(thresholds["k3_kl"], color=RED, ls="--", lw=1, label=f"gate: k3_kl <= {tick(thresholds['k3_kl'])}")
    ax.set_yscale("log")
    ax.set(xlabel="throughput cost vs baseline (%; slower side of engine and reference)", ylabel="K3 KL")
    costs = [100 * c for _, c, _, _ in pts]
    span = max(max(costs) - min(costs), 10.0)
    ax.set_xlim(min(-2.0, min(costs) - 0.05 * span), max(costs) + 0.4 * span)  # room for the names on the right
    legend(ax, loc="best")
    return fig


CORRECTION_MARKERS = ("v", "^", "s", "D", "P", "X")


def rescue_plot(record: SweepRecord) -> Figure:
    """Per point (a row), its K3 over every token (black) and the K3 of what each correction keeps
    (a marker each), on one log axis; the band is the baseline repeats' K3 span. A correction that
    brings a point into the band rescues it, at the share it drops (the corrections table)."""
    from mismatch_probe.analysis.metric_docs import CORRECTION_DOCS
    from mismatch_probe.analysis.metrics import KEPT_K3

    def positive(v: Any) -> TypeGuard[float]:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0

    rows = [p for p in record.points if p.status == "ok" and positive(p.metrics.get("k3_kl"))]
    if not rows:
        return _nothing("no finished point has a K3")
    if not any(p.corrections for p in rows):
        return _nothing("this sweep's record holds no correction what-ifs (summarized before they were recorded)")
    names = [p.name.replace("+", "\n+ ") for p in rows]
    widest = max(len(line) for n in names for line in n.split("\n"))
    fig, (ax,) = new_figure(7.0 + 0.065 * widest, 0.42 * len(rows) + 1.6, left=0.3 + 0.065 * widest, top=0.3)
    floor = [v for v in record.repeat_values("k3_kl") if v > 0]  # on a log axis
    if floor:
        ax.axvspan(min(floor), max(floor), color="#dde2ea", alpha=0.7, label="baseline repeats' K3")
    ax.scatter([p.metrics["k3_kl"] for p in rows], range(len(rows)), color="black", s=36, zorder=3, label="every token")
    for (key, doc), color, marker in zip(CORRECTION_DOCS.items(), RUN_COLORS[1:], CORRECTION_MARKERS):
        kept = [(i, float(v)) for i, p in enumerate(rows) if positive(v := p.corrections.get(KEPT_K3[key]))]
        if kept:
            ax.scatter([v for _, v in kept], [i for i, _ in kept], color=color, marker=marker, s=22, label=doc.label)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), names)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("K3 KL: of every token, and of what each correction keeps", loc="left")
    legend(ax, loc="best", fontsize=7)
    return fig

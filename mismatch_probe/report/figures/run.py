"""A run's seven figures, from its record (run.json's breakdowns) and its stored distributions
(distributions.json's histograms, sequences.parquet's points). Each is a fixed-size drawing
whatever the token count: histograms are images, and a scatter of many points is rasterized."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from mismatch_probe.analysis.distributions import dense
from mismatch_probe.numbers import fmt, pct, short, tick
from mismatch_probe.record import RunRecord
from mismatch_probe.report.figures.drawing import (
    BLUE,
    FLOOR,
    GREEN,
    GREY,
    RED,
    colorbar,
    histogram,
    legend,
    new_figure,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIRST, LATER = BLUE, RED
RASTER_POINTS = 300  # a scatter with more points is drawn as an image inside the SVG (smaller, faster)
RATIO_TICKS = [-100, -1, -1e-3, -1e-6, 0, 1e-6, 1e-3, 1, 100]


def _group_label(group: str) -> str:
    return {"first": "first turn", "later": "later turns (after tool output)"}[group]


def _present_groups(dist: dict) -> list[str]:
    return [g for g in ("first", "later") if dist["groups"][g]["n_tokens"]]


def buckets(record: RunRecord, name: str) -> list[dict]:
    """A breakdown of the run (``p_infer_buckets``, ``response_length_buckets``, ``position_buckets``)."""
    return record.breakdown(name)


def bucket_labels(rows: list[dict]) -> list[str]:
    return [f"{tick(r['p_infer_lo'])}–{tick(r['p_infer_hi'])}" for r in rows]


def log_mismatch_edges(dist: dict) -> np.ndarray:
    """The per-sequence max mismatch's logarithmic bin edges, the first bin [0, 1e-8) drawn just
    below 1e-8."""
    edges = np.array(dist["edges"]["mismatch_log"], float)
    edges[0] = 10 ** (math.log10(edges[1]) - 0.2)
    return edges


def seq_max_log_hist(dist: dict) -> np.ndarray:
    """Sequences per logarithmic max-mismatch bin: the length x mismatch density summed over lengths."""
    return dense(dist["sequences"]["length_vs_max_mismatch"]).sum(axis=0).astype(float)


def ratio_axis(ax: Axes, edges: np.ndarray) -> np.ndarray:
    """A log-ratio histogram's symmetric-log x axis; returns the drawable edges (the open ends as
    the outermost bins)."""
    finite = np.array(edges, float)
    finite[0], finite[-1] = -1e3, 1e3
    ax.set_xscale("symlog", linthresh=1e-7, linscale=0.6)
    ax.set_xlim(finite[0], finite[-1])
    ax.set_xticks(RATIO_TICKS, [tick(t) for t in RATIO_TICKS])
    return finite


def _density(ax: Axes, counts: np.ndarray, x_edges, y_edges, vmax: float, *, log_axes: bool = False):
    """A 2-D count histogram ``counts[x, y]`` as a log-coloured image, empty cells left blank: on
    linear axes one image of a pixel per bin, embedded as it is; on log axes (where matplotlib would
    place such an image in linear coordinates) a mesh rasterized inside the SVG."""
    from matplotlib.colors import LogNorm

    shown = np.ma.masked_equal(np.asarray(counts, float).T, 0)
    norm = LogNorm(1, max(vmax, 2.0))
    if log_axes:
        return ax.pcolormesh(x_edges, y_edges, shown, norm=norm, cmap="viridis", rasterized=True, shading="flat")
    extent = (x_edges[0], x_edges[-1], y_edges[0], y_edges[-1])
    return ax.imshow(
        shown, norm=norm, cmap="viridis", origin="lower", extent=extent, interpolation="nearest", aspect="auto"
    )


def prob_density(record: RunRecord, dist: dict) -> Figure:
    """p_train against p_infer as a 2-D histogram (log colour), one panel per turn group."""
    groups = _present_groups(dist) or ["first"]
    fig, axes = new_figure(2.2 + 4.2 * len(groups), 4.6, len(groups), right=1.0, wspace=0.3)
    hists = {g: dense(dist["groups"][g]["prob_hist"]) for g in groups}
    vmax = max(1, max(int(h.max(initial=0)) for h in hists.values()))
    edges = np.linspace(0.0, 1.0, next(iter(hists.values())).shape[0] + 1)
    images = []
    for ax, g in zip(axes, groups):
        images.append(_density(ax, hists[g], edges, edges, vmax))
        ax.plot([0, 1], [0, 1], color=GREY, lw=1, ls=(0, (4, 3)))
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="p_infer (engine)", ylabel="p_train (reference)")
        ax.set_title(f"{_group_label(g)}: {fmt(dist['groups'][g]['n_tokens'])} tokens")
        ax.set_aspect("equal")
        ax.grid(False)
    colorbar(fig, images[0], axes, "tokens per cell")
    return fig


def log_ppl_by_turn(record: RunRecord, dist: dict) -> Figure:
    """One point per sample-turn: log-ppl under the engine against the reference."""
    by_turn = record.metrics_by_turn or {}
    fig, (ax,) = new_figure(5.6, 5.3)
    values = []
    for g, color in (("first", FIRST), ("later", LATER)):
        data = dist["groups"][g]
        x, y = np.asarray(data["log_ppl_infer"], float), np.asarray(data["log_ppl_train"], float)
        if not len(x):
            continue
        m = by_turn.get(g) or {}
        label = (
            f"{_group_label(g)}: {fmt(m.get('n_sequences', len(x)))} sample-turns, r = {short(m.get('pearson_log_ppl'))}, "
            f"mean |Δ| = {short(m.get('log_ppl_abs_diff_mean'))}"
        )
        ax.scatter(x, y, s=5, color=color, alpha=0.5, lw=0, label=label, rasterized=len(x) > RASTER_POINTS)
        values += [x[np.isfinite(x)], y[np.isfinite(y)]]
    v = np.concatenate(values) if values else np.zeros(0)
    lo, hi = (float(v.min()), float(v.max())) if len(v) else (0.0, 1.0)
    pad = (hi - lo) * 0.05 or 0.5
    ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color=GREY, lw=1, ls=(0, (4, 3)))
    ax.set(xlim=(lo - pad, hi + pad), ylim=(lo - pad, hi + pad))
    ax.set(xlabel="log-ppl under the engine", ylabel="log-ppl under the reference")
    legend(ax, loc="upper left", markerscale=2)
    return fig


def abs_delta_by_p_infer(record: RunRecord, dist: dict) -> Figure:
    """|delta| quantile bands per p_infer bucket (log scale): where the mismatch lives."""
    rows = buckets(record, "p_infer_buckets")
    filled = [i for i, r in enumerate(rows) if r.get("count")]
    fig, (ax,) = new_figure(7.0, 4.6, bottom=1.0, top=0.35)

    def col(key: str) -> np.ndarray:
        return np.array([max(rows[i].get(key) or 0.0, FLOOR) for i in filled])

    if filled:
        xs = np.array(filled, float)
        ax.fill_between(xs, col("abs_delta_p50"), col("abs_delta_p90"), color=BLUE, alpha=0.35, lw=0, label="p50–p90")
        ax.fill_between(xs, col("abs_delta_p90"), col("abs_delta_p99"), color=BLUE, alpha=0.15, lw=0, label="p90–p99")
        ax.plot(xs, col("abs_delta_mean"), color=BLUE, lw=1.5, marker="o", ms=4, label="mean")
        ax.plot(xs, col("abs_delta_max"), color=RED, lw=0, marker="v", ms=5, label="max")
        ax.set_yscale("log")
        for i in filled:  # tokens per bucket, above the axes
            ax.annotate(
                fmt(rows[i]["count"]),
                (i, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=7.5,
                color="#555",
            )
    ax.set_xlim(-0.5, max(len(rows), 1) - 0.5)
    ax.set_xticks(range(len(rows)), bucket_labels(rows), rotation=30, ha="right")
    ax.set(xlabel="p_infer bucket (numbers on top: tokens)", ylabel="|logp_train − logp_infer|")
    legend(ax, loc="lower left")
    return fig


def seq_max_mismatch_hist(record: RunRecord, dist: dict) -> Figure:
    """Histogram of the per-sequence max |p_train - p_infer|: on [0, 1] with the 0.5 line of the
    parallelism study, and on a log axis, where a well-matched run's mass actually is."""
    m = record.metrics or {}
    panels = (
        (np.array(dist["sequences"]["max_mismatch_hist"], float), np.array(dist["edges"]["seq_max_mismatch"], float)),
        (seq_max_log_hist(dist), log_mismatch_edges(dist)),
    )
    fig, axes = new_figure(11.0, 3.9, 2, wspace=0.22)
    for i, (ax, (counts, edges)) in enumerate(zip(axes, panels)):
        if counts.sum():
            histogram(ax, counts, edges, BLUE, fill_from=0.7, alpha=0.7)
            ax.set_yscale("log")
            ax.set_ylim(0.7, counts.max() * 1.6)
        ax.axvline(0.5, color=RED, ls=(0, (4, 3)), lw=1)
        if i:
            ax.set_xscale("log")
        ax.set_xlim(edges[0], edges[-1] if i else 1.0)
        ax.set(xlabel="max |p_train − p_infer| in the sequence" + (" (log)" if i else ""), ylabel="sequences")
    count, total = m.get("seq_max_mismatch_gt_0_5_count", 0), m.get("n_sequences", 0)
    axes[0].text(
        0.51,
        0.93,
        f"> 0.5: {fmt(count)} of {fmt(total)} sequences ({pct(m.get('seq_max_mismatch_gt_0_5_share'))})",
        transform=axes[0].get_xaxis_transform(),
        color=RED,
        fontsize=8.5,
    )
    return fig


def max_mismatch_vs_length(record: RunRecord, dist: dict) -> Figure:
    """Per-sequence max |p_train - p_infer| against response length (density), with the mean per
    length bucket and the 0.5 line."""
    hist = dense(dist["sequences"]["length_vs_max_mismatch"])
    x_edges, y_edges = np.array(dist["edges"]["length"], float), log_mismatch_edges(dist)
    fig, (ax,) = new_figure(7.2, 4.6, right=1.1)
    if hist.sum():
        image = _density(ax, hist, x_edges, y_edges, float(hist.max()), log_axes=True)
        colorbar(fig, image, ax, "sequences")
    rows = buckets(record, "response_length_buckets")
    if rows:
        centers = [math.sqrt(r["length_lo"] * (r["length_hi"] or r["length_lo"] * 2)) for r in rows]
        means = [max(r["seq_max_mismatch_mean"], FLOOR) for r in rows]
        ax.plot(centers, means, color=RED, lw=1.5, marker="o", ms=4, label="mean per length bucket")
    ax.axhline(0.5, color=RED, ls=(0, (4, 3)), lw=1)
    ax.set(xscale="log", yscale="log", xlim=(x_edges[0], x_edges[-1]), ylim=(y_edges[0], 1.0))
    ax.set(xlabel="response length (model tokens)", ylabel="max |p_train − p_infer| in the sequence")
    legend(ax, loc="lower right")
    return fig


def mismatch_by_position(record: RunRecord, dist: dict) -> Figure:
    """Token mismatch against position in the sequence (position buckets)."""
    rows = buckets(record, "position_buckets")
    fig, (ax,) = new_figure(7.0, 4.4, bottom=0.75)
    x = np.arange(len(rows))
    for key, color, marker, label in (
        ("prob_diff_max", RED, "v", "max |Δp|"),
        ("abs_delta_mean", GREEN, "s", "mean |delta|"),
        ("prob_diff_mean", BLUE, "o", "mean |Δp|"),
    ):
        if rows:
            ax.plot(x, [max(r[key], FLOOR) for r in rows], color=color, lw=1.5, marker=marker, ms=4, label=label)
    if rows:
        ax.set_yscale("log")
    ax.set_xlim(-0.5, max(len(rows), 1) - 0.5)
    ax.set_xticks(x, [f"{r['position_lo']}–{r['position_hi'] or '∞'}\n{fmt(r['count'])}" for r in rows], fontsize=7.5)
    ax.set(xlabel="token position in the sequence (second line: tokens)", ylabel="mismatch")
    legend(ax, loc="lower right")
    return fig


def importance_ratio(record: RunRecord, dist: dict) -> Figure:
    """Distribution of the token log-ratio and of the sequence log-ratio (log IS weights), with
    the thresholds of the correction what-ifs."""
    th = record.correction_thresholds()
    token = np.sum([np.array(dist["groups"][g]["log_ratio_hist"], float) for g in ("first", "later")], axis=0)
    panels = (
        (
            token,
            "token log-ratio  δ = logp_train − logp_infer",
            "tokens",
            [("token_mask_share", "ratio_below"), ("token_tis_clipped_share", "ratio_above")],
        ),
        (
            np.array(dist["sequences"]["log_ratio_hist"], float),
            "sequence log-ratio  Σδ",
            "sequences",
            [("seq_tis_clipped_share", "seq_ratio_above")],
        ),
    )
    fig, axes = new_figure(11.0, 4.0, 2, wspace=0.22)
    for ax, (counts, xlabel, unit, lines) in zip(axes, panels):
        edges = ratio_axis(ax, dist["edges"]["log_ratio"])
        total = counts.sum()
        if total:
            share = counts / total
            bottom = float(share[share > 0].min()) / 2
            histogram(ax, share, edges, BLUE, fill_from=bottom, alpha=0.6)
            ax.set_yscale("log")
            ax.set_ylim(bottom, 1.0)
        for key, sub in lines:
            value = th.get(key, {}).get(sub)
            if value:
                ax.axvline(math.log(value), color=RED, ls=(0, (4, 3)), lw=0.9)
                ax.text(
                    math.log(value),
                    0.95,
                    f" ratio {tick(value)}",
                    transform=ax.get_xaxis_transform(),
                    color=RED,
                    fontsize=7.5,
                    ha="left" if value > 1 else "right",
                )
        ax.tick_params(axis="x", labelsize=7.5)
        ax.set(xlabel=xlabel + " (symlog)", ylabel=f"share of {unit}")
    return fig


def precision_rounds(record: RunRecord, dist: dict) -> Figure:
    """An adaptive run (run.json's ``precision``): K3 and its 95% interval after each round against the
    samples so far, with the band the target asks for around the last estimate, and the
    ``1/sqrt(n)`` the interval was expected to follow from the first round."""
    state = record.precision or {}
    rounds = state.get("rounds") or []
    fig, (ax,) = new_figure(6.0, 3.6)
    n = np.array([r["samples_total"] for r in rounds], float)
    k3 = np.array([r["k3_kl"] for r in rounds], float)
    low, high = np.array([r["low"] for r in rounds], float), np.array([r["high"] for r in rounds], float)
    finite = np.isfinite(k3) & np.isfinite(low) & np.isfinite(high)
    if finite.any():
        n, k3, low, high = n[finite], k3[finite], low[finite], high[finite]
        # the interval as a segment, not error bars off the estimate: a percentile interval of a skewed
        # ratio need not contain its estimate
        ax.vlines(n, low, high, color=BLUE, lw=1.2)
        ax.plot(n, k3, "o", color=BLUE, label="K3, 95% interval")
        target, last = float(state.get("target") or 0.0), k3[-1]
        if target:
            ax.axhspan(last * (1 - target), last * (1 + target), color=GREEN, alpha=0.15, lw=0)
            ax.plot([], [], color=GREEN, alpha=0.4, lw=6, label=f"±{target:.0%} of the last K3")
        if len(n) > 1 and k3[0] > 0:
            grid = np.linspace(n[0], n[-1], 50)
            half = (high[0] - low[0]) / 2 * np.sqrt(n[0] / grid)
            ax.plot(grid, last + half, color=GREY, ls=(0, (3, 2)), lw=0.9, label="round 1's half-width x √(n₁/n)")
            ax.plot(grid, last - half, color=GREY, ls=(0, (3, 2)), lw=0.9)
        legend(ax, loc="upper right")
    ax.set(xlabel="samples", ylabel="K3 KL")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return fig

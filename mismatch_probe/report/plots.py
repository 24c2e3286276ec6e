"""The report's figures, drawn with matplotlib from a run record and its stored distributions.

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
FIRST, LATER = "#1f77b4", "#d62728"
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


def _group_label(group: str) -> str:
    return {"first": "first turn", "later": "later turns (after tool output)"}[group]


def _present_groups(dist: dict) -> list[str]:
    return [g for g in ("first", "later") if dist["groups"][g]["n_tokens"]]


# ---- one run --------------------------------------------------------------------------------


def prob_density(dist: dict):
    """p_train against p_infer as a 2-D histogram (log colour), one panel per turn group."""
    from matplotlib.colors import LogNorm

    groups = _present_groups(dist) or ["first"]
    fig, axes = _figure(5.2 * len(groups) + 0.6, 4.6, len(groups))
    image = None
    vmax = max(1, max(int(dense(dist["groups"][g]["prob_hist"]).max(initial=0)) for g in groups))
    for ax, g in zip(axes, groups):
        hist = dense(dist["groups"][g]["prob_hist"]).astype(float)
        hist[hist == 0] = np.nan
        image = ax.imshow(
            hist.T,
            origin="lower",
            extent=(0, 1, 0, 1),
            cmap="viridis",
            interpolation="nearest",
            norm=LogNorm(vmin=1, vmax=vmax),
            aspect="equal",
        )
        ax.plot([0, 1], [0, 1], color="#999", lw=0.8, ls="--")
        ax.set_xlabel("p_infer (engine)")
        ax.set_ylabel("p_train (reference)")
        ax.set_title(f"{_group_label(g)}: {dist['groups'][g]['n_tokens']:,} tokens", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes, label="tokens per cell", shrink=0.85)
    return fig


def log_ppl_by_turn(dist: dict, record: RunRecord):
    """One point per sample-turn: log-ppl under the engine against the reference."""
    fig, (ax,) = _figure(5.4, 4.8)
    by_turn = record.metrics_by_turn or {}
    values = []
    for g, color in (("first", FIRST), ("later", LATER)):
        data = dist["groups"][g]
        x, y = np.asarray(data["log_ppl_infer"], float), np.asarray(data["log_ppl_train"], float)
        if not len(x):
            continue
        m = by_turn.get(g) or {}
        label = (
            f"{_group_label(g)}: {m.get('n_sequences', len(x)):,} sample-turns, r = {_g(m.get('pearson_log_ppl'))}, "
            f"mean |Δ| = {_g(m.get('log_ppl_abs_diff_mean'))}"
        )
        ax.scatter(x, y, s=6, alpha=0.5, color=color, label=label, linewidths=0)
        values += [x[np.isfinite(x)], y[np.isfinite(y)]]
    if values:
        v = np.concatenate(values)
        if len(v):
            lo, hi = float(v.min()), float(v.max())
            pad = (hi - lo) * 0.05 or 0.5
            ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="#999", lw=0.8, ls="--")
            ax.set_xlim(lo - pad, hi + pad)
            ax.set_ylim(lo - pad, hi + pad)
        ax.legend(loc="upper left", fontsize=7.5, frameon=False)
    ax.set_xlabel("log-ppl under the engine")
    ax.set_ylabel("log-ppl under the reference")
    return fig


def _bucket_labels(rows: list[dict]) -> list[str]:
    return [f"{_edge(r['p_infer_lo'])}–{_edge(r['p_infer_hi'])}" for r in rows]


def _edge(v: float) -> str:
    return "0" if v == 0 else "1" if v == 1 else f"{v:g}"


def _buckets(record: RunRecord, name: str) -> list[dict]:
    """A breakdown of the run (``p_infer_buckets``, ``response_length_buckets``, ``position_buckets``)."""
    return (record.breakdowns or {}).get(name) or []


def abs_delta_by_p_infer(record: RunRecord):
    """|delta| quantile bands per p_infer bucket (log scale): where the mismatch lives."""
    rows = _buckets(record, "p_infer_buckets")
    fig, (ax,) = _figure(6.8, 4.4, bottom=1.15)  # rotated bucket labels
    x = np.arange(len(rows))
    filled = [i for i, r in enumerate(rows) if r.get("count")]
    if filled:

        def col(key):
            return np.array([max(rows[i].get(key) or 0.0, FLOOR) for i in filled])

        xs = x[filled]
        ax.fill_between(xs, col("abs_delta_p50"), col("abs_delta_p90"), color="#1f77b4", alpha=0.35, label="p50–p90")
        ax.fill_between(xs, col("abs_delta_p90"), col("abs_delta_p99"), color="#1f77b4", alpha=0.15, label="p90–p99")
        ax.plot(xs, col("abs_delta_mean"), color="#1f77b4", marker="o", ms=3, label="mean")
        ax.plot(xs, col("abs_delta_max"), color="#d62728", marker="v", ms=4, ls="none", label="max")
        ax.set_yscale("log")
        for i in filled:
            ax.annotate(
                f"{rows[i]['count']:,}",
                (x[i], 1),
                xycoords=("data", "axes fraction"),
                ha="center",
                va="top",
                fontsize=7,
                color="#555",
                xytext=(0, -2),
                textcoords="offset points",
            )
        ax.legend(loc="lower left", fontsize=8, frameon=False)
    ax.set_xticks(x, _bucket_labels(rows), rotation=30, fontsize=8)
    ax.set_xlabel("p_infer bucket (numbers on top: tokens)")
    ax.set_ylabel("|logp_train − logp_infer|")
    return fig


def max_mismatch_vs_length(dist: dict, record: RunRecord):
    """Per-sequence max |p_train - p_infer| against response length (density), with the mean per
    length bucket and the 0.5 line."""
    from matplotlib.colors import LogNorm

    fig, (ax,) = _figure(6.8, 4.4)
    edges = dist["edges"]
    hist = dense(dist["sequences"]["length_vs_max_mismatch"]).astype(float)
    y_edges = np.array(edges["mismatch_log"], float)
    y_edges[0] = 10 ** (math.log10(y_edges[1]) - 0.2)  # the [0, 1e-8) bin, drawn just below 1e-8
    if hist.sum():
        hist[hist == 0] = np.nan
        mesh = ax.pcolormesh(edges["length"], y_edges, hist.T, cmap="viridis", norm=LogNorm(vmin=1))
        fig.colorbar(mesh, ax=ax, label="sequences")
    rows = _buckets(record, "response_length_buckets")
    if rows:
        centers = [math.sqrt(r["length_lo"] * (r["length_hi"] or r["length_lo"] * 2)) for r in rows]
        ax.plot(
            centers,
            [max(r["seq_max_mismatch_mean"], FLOOR) for r in rows],
            color="#d62728",
            marker="o",
            ms=3,
            label="mean per length bucket",
        )
        ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.axhline(0.5, color="#d62728", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(y_edges[0], 1.0)
    ax.set_xlabel("response length (model tokens)")
    ax.set_ylabel("max |p_train − p_infer| in the sequence")
    return fig


def mismatch_by_position(record: RunRecord):
    """Token mismatch against position in the sequence (position buckets)."""
    rows = _buckets(record, "position_buckets")
    fig, (ax,) = _figure(6.8, 4.0)
    if rows:
        x = np.arange(len(rows))
        ax.plot(x, [max(r["prob_diff_max"], FLOOR) for r in rows], color="#d62728", marker="v", ms=4, label="max |Δp|")
        ax.plot(
            x, [max(r["abs_delta_mean"], FLOOR) for r in rows], color="#2ca02c", marker="s", ms=3, label="mean |delta|"
        )
        ax.plot(
            x, [max(r["prob_diff_mean"], FLOOR) for r in rows], color="#1f77b4", marker="o", ms=3, label="mean |Δp|"
        )
        ax.set_yscale("log")
        ax.set_xticks(x, [f"{r['position_lo']}–{r['position_hi'] or '∞'}\n{r['count']:,}" for r in rows], fontsize=7.5)
        ax.legend(loc="best", fontsize=8, frameon=False)
    ax.set_xlabel("token position in the sequence (second line: tokens)")
    ax.set_ylabel("mismatch")
    return fig


def _seq_max_log_hist(dist: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence max mismatch over logarithmic bins: the length x mismatch density summed over
    lengths. Its first bin [0, 1e-8) is drawn just below 1e-8."""
    edges = np.array(dist["edges"]["mismatch_log"], float)
    edges[0] = 10 ** (math.log10(edges[1]) - 0.2)
    return dense(dist["sequences"]["length_vs_max_mismatch"]).sum(axis=0).astype(float), edges


def seq_max_mismatch_hist(dist: dict, record: RunRecord):
    """Histogram of the per-sequence max |p_train - p_infer|: on [0, 1] with the 0.5 line of the
    parallelism study, and on a log axis, where a well-matched run's mass actually is."""
    fig, (ax, ax_log) = _figure(11.0, 3.8, 2)
    edges = np.array(dist["edges"]["seq_max_mismatch"], float)
    counts = np.array(dist["sequences"]["max_mismatch_hist"], float)
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#1f77b4", edgecolor="white", lw=0.3)
    m = record.metrics or {}
    share = m.get("seq_max_mismatch_gt_0_5_share")
    ax.text(
        0.51,
        0.95,
        f"> 0.5: {m.get('seq_max_mismatch_gt_0_5_count', 0):,} of {m.get('n_sequences', 0):,}"
        f" sequences ({_pct(share)})",
        transform=ax.get_xaxis_transform(),
        fontsize=8,
        color="#d62728",
        va="top",
    )
    ax.set_xlim(0, 1)
    log_counts, log_edges = _seq_max_log_hist(dist)
    ax_log.stairs(log_counts, log_edges, fill=True, color="#1f77b4", alpha=0.7)
    ax_log.set_xscale("log")
    ax_log.set_xlim(log_edges[0], 1.0)
    for a in (ax, ax_log):
        a.axvline(0.5, color="#d62728", ls="--", lw=1)
        if counts.sum():
            a.set_yscale("log")
        a.set_xlabel("max |p_train − p_infer| in the sequence" + (" (log)" if a is ax_log else ""))
        a.set_ylabel("sequences")
    return fig


def _ratio_axis(ax, edges: np.ndarray) -> np.ndarray:
    """Draw a log-ratio histogram on a symmetric-log x axis; returns the drawable edges."""
    finite = edges.copy()
    finite[0], finite[-1] = -1e3, 1e3  # the open ends, drawn as the outermost bins
    ax.set_xscale("symlog", linthresh=1e-7, linscale=0.6)
    ax.set_xlim(finite[0], finite[-1])
    ax.set_xticks([-100, -1, -1e-2, -1e-4, -1e-6, 0, 1e-6, 1e-4, 1e-2, 1, 100])
    ax.tick_params(axis="x", labelsize=7.5)
    return finite


def importance_ratio(dist: dict, record: RunRecord):
    """Distribution of the token log-ratio and of the sequence log-ratio (log IS weights), with
    the thresholds of the correction what-ifs."""
    fig, axes = _figure(11.0, 3.9, 2)
    edges = np.array(dist["edges"]["log_ratio"], float)
    th = (record.corrections or {}).get("thresholds") or {}
    token = np.sum([np.array(dist["groups"][g]["log_ratio_hist"], float) for g in ("first", "later")], axis=0)
    panels = (
        (
            axes[0],
            token,
            "token log-ratio  δ = logp_train − logp_infer",
            "tokens",
            [("token_mask_share", "ratio_below"), ("token_tis_clipped_share", "ratio_above")],
        ),
        (
            axes[1],
            np.array(dist["sequences"]["log_ratio_hist"], float),
            "sequence log-ratio  Σδ",
            "sequences",
            [("seq_tis_clipped_share", "seq_ratio_above")],
        ),
    )
    for ax, counts, xlabel, ylabel, lines in panels:
        finite = _ratio_axis(ax, edges)
        total = counts.sum()
        if total:
            ax.stairs(counts / total, finite, fill=True, color="#1f77b4", alpha=0.6)
            ax.set_yscale("log")
        for key, sub in lines:
            value = (th.get(key) or {}).get(sub)
            if value:
                ax.axvline(math.log(value), color="#d62728", ls="--", lw=0.8)
                ax.text(
                    math.log(value),
                    0.97,
                    f" ratio {value:g}",
                    transform=ax.get_xaxis_transform(),
                    fontsize=7,
                    color="#d62728",
                    va="top",
                )
        ax.set_xlabel(xlabel + " (symlog)")
        ax.set_ylabel(f"share of {ylabel}")
    return fig


def run_figures(record: RunRecord, dist: dict) -> list[dict]:
    """Every figure of a one-run report: ``{"id", "title", "caption", "png"}``, in report order."""
    figures = [
        (
            "prob_density",
            "Token probabilities: reference vs engine",
            (
                "Each cell counts sampled tokens by their probability under the engine (x) and the reference (y). "
                "Agreement is the diagonal; mass off it is mismatch."
            ),
            lambda: prob_density(dist),
        ),
        (
            "log_ppl_by_turn",
            "Log-ppl per sample-turn, first vs later turns",
            (
                "One point per sample-turn. Later turns follow tool output, which is out of distribution for the model; "
                "published runs see them drift off the diagonal first."
            ),
            lambda: log_ppl_by_turn(dist, record),
        ),
        (
            "abs_delta_by_p_infer",
            "|delta| by engine probability",
            (
                "Quantile bands of |logp_train − logp_infer| per p_infer bucket. Mismatch concentrates on "
                "low-probability tokens, which are also the ones with the largest gradients."
            ),
            lambda: abs_delta_by_p_infer(record),
        ),
        (
            "seq_max_mismatch_hist",
            "Per-sequence max mismatch",
            (
                "The largest token probability gap in each sequence, on [0, 1] and on a log axis. The parallelism study's "
                "headline is the share right of 0.5."
            ),
            lambda: seq_max_mismatch_hist(dist, record),
        ),
        (
            "max_mismatch_vs_length",
            "Max mismatch vs response length",
            "Longer responses draw more tokens, so their worst token is worse even when the mean is flat.",
            lambda: max_mismatch_vs_length(dist, record),
        ),
        (
            "mismatch_by_position",
            "Mismatch vs token position",
            "Mean and max gap by position in the full sequence (prompt included in the position).",
            lambda: mismatch_by_position(record),
        ),
        (
            "importance_ratio",
            "Importance ratios",
            (
                "Token and sequence log importance weights log(π/μ). Dashed lines: the thresholds of the correction "
                "what-ifs below."
            ),
            lambda: importance_ratio(dist, record),
        ),
    ]
    out = []
    for fid, title, caption, draw in figures:
        out.append({"id": fid, "title": title, "caption": caption, "png": to_png(draw())})
    return out


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
        rows = _buckets(run["record"], "p_infer_buckets")
        labels = labels or _bucket_labels(rows)
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
        rows = _buckets(run["record"], "position_buckets")
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


def _g(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"

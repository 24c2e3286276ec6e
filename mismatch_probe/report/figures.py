"""A run report's seven figures, drawn as SVG (:mod:`.svg`) from the run record and its stored
distributions.

Rendering only: every number drawn here was computed by the analysis (run.json's breakdowns and
distributions.json's histograms). A figure is a fixed-size document whatever the token count.
Comparison and sweep pages draw their overlays with matplotlib (:mod:`.plots`).
"""

from __future__ import annotations

import math

import numpy as np

from mismatch_probe.analysis.distributions import dense
from mismatch_probe.record import RunRecord
from mismatch_probe.report.plots import FLOOR, bucket_labels, buckets
from mismatch_probe.report.svg import Figure, Scale, density_rgba, label

BLUE, RED, GREEN = "#1f77b4", "#d62728", "#2ca02c"
FIRST, LATER = BLUE, RED


def _group_label(group: str) -> str:
    return {"first": "first turn", "later": "later turns (after tool output)"}[group]


def _present_groups(dist: dict) -> list[str]:
    return [g for g in ("first", "later") if dist["groups"][g]["n_tokens"]]


def _short(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _log_scale(values, floor: float = FLOOR, pad: float = 1.6) -> Scale:
    """A log scale around the positive ``values`` (a decade's fraction of room each side)."""
    v = np.asarray([x for x in values if x is not None and x > 0 and math.isfinite(x)], np.float64)
    if not len(v):
        return Scale("log", floor, 1.0)
    return Scale("log", max(float(v.min()) / pad, floor), float(v.max()) * pad)


def prob_density(dist: dict) -> bytes:
    """p_train against p_infer as a 2-D histogram (log colour), one panel per turn group."""
    groups = _present_groups(dist) or ["first"]
    fig = Figure(80 + 500 * len(groups) + 90, 470)
    hists = {g: dense(dist["groups"][g]["prob_hist"]) for g in groups}
    vmax = max(1, max(int(h.max(initial=0)) for h in hists.values()))
    for i, g in enumerate(groups):
        ax = fig.axes(80 + 500 * i, 40, 380, 380, Scale("linear", 0, 1), Scale("linear", 0, 1))
        ax.image(density_rgba(hists[g], vmax), 0, 1, 0, 1)
        ax.line([0, 1], [0, 1], "#999", 1.0, "4 3")
        ax.frame(
            "p_infer (engine)", "p_train (reference)", f"{_group_label(g)}: {dist['groups'][g]['n_tokens']:,} tokens"
        )
    fig.colorbar(80 + 500 * len(groups) - 60, 60, 16, 340, vmax, "tokens per cell")
    return fig.svg()


def log_ppl_by_turn(dist: dict, record: RunRecord) -> bytes:
    """One point per sample-turn: log-ppl under the engine against the reference."""
    by_turn = record.metrics_by_turn or {}
    series, values = [], []
    for g, color in (("first", FIRST), ("later", LATER)):
        data = dist["groups"][g]
        x, y = np.asarray(data["log_ppl_infer"], float), np.asarray(data["log_ppl_train"], float)
        if not len(x):
            continue
        m = by_turn.get(g) or {}
        text = (
            f"{_group_label(g)}: {m.get('n_sequences', len(x)):,} sample-turns, r = {_short(m.get('pearson_log_ppl'))}, "
            f"mean |Δ| = {_short(m.get('log_ppl_abs_diff_mean'))}"
        )
        series.append((x, y, color, text))
        values += [x[np.isfinite(x)], y[np.isfinite(y)]]
    v = np.concatenate(values) if values else np.zeros(0)
    lo, hi = (float(v.min()), float(v.max())) if len(v) else (0.0, 1.0)
    pad = (hi - lo) * 0.05 or 0.5
    scale = Scale("linear", lo - pad, hi + pad)
    fig = Figure(560, 540)
    ax = fig.axes(85, 20, 450, 450, scale, Scale("linear", lo - pad, hi + pad))
    ax.line([lo - pad, hi + pad], [lo - pad, hi + pad], "#999", 1.0, "4 3")
    for x, y, color, text in series:
        ax.points(x, y, color, 1.8, 0.5, label=text)
    ax.frame("log-ppl under the engine", "log-ppl under the reference")
    ax.legend("upper left", 8.5)
    return fig.svg()


def abs_delta_by_p_infer(record: RunRecord) -> bytes:
    """|delta| quantile bands per p_infer bucket (log scale): where the mismatch lives."""
    rows = buckets(record, "p_infer_buckets")
    filled = [i for i, r in enumerate(rows) if r.get("count")]

    def col(key: str) -> np.ndarray:
        return np.array([max(rows[i].get(key) or 0.0, FLOOR) for i in filled])

    keys = ("abs_delta_p50", "abs_delta_p90", "abs_delta_p99", "abs_delta_mean", "abs_delta_max")
    y = _log_scale([v for k in keys for v in (col(k) if filled else [])], pad=2.0)
    n = max(len(rows), 1)
    fig = Figure(700, 460)
    ax = fig.axes(85, 30, 595, 330, Scale("linear", -0.5, n - 0.5), y)
    if filled:
        xs = np.array(filled, float)
        ax.band(xs, col("abs_delta_p50"), col("abs_delta_p90"), BLUE, 0.35, "p50–p90")
        ax.band(xs, col("abs_delta_p90"), col("abs_delta_p99"), BLUE, 0.15, "p90–p99")
        ax.line(xs, col("abs_delta_mean"), BLUE, 1.5, marker="o", label="mean")
        ax.points(xs, col("abs_delta_max"), RED, 4.0, 1.0, "v", label="max")
        for i in filled:
            fig.text(float(ax.px(i)), ax.top + 11, f"{rows[i]['count']:,}", 8.5, fill="#555")
    ax.frame(
        "p_infer bucket (numbers on top: tokens)",
        "|logp_train − logp_infer|",
        xticks=list(range(len(rows))),
        xticklabels=bucket_labels(rows),
        rotate_x=True,
        tick_size=9,
    )
    ax.legend("lower left")
    return fig.svg()


def max_mismatch_vs_length(dist: dict, record: RunRecord) -> bytes:
    """Per-sequence max |p_train - p_infer| against response length (density), with the mean per
    length bucket and the 0.5 line."""
    edges = dist["edges"]
    hist = dense(dist["sequences"]["length_vs_max_mismatch"])
    x_edges = np.array(edges["length"], float)
    y_edges = np.array(edges["mismatch_log"], float)
    y_edges[0] = 10 ** (math.log10(y_edges[1]) - 0.2)  # the [0, 1e-8) bin, drawn just below 1e-8
    fig = Figure(720, 460)
    ax = fig.axes(85, 20, 500, 370, Scale("log", x_edges[0], x_edges[-1]), Scale("log", y_edges[0], 1.0))
    if hist.sum():
        vmax = float(hist.max())
        # the bins are uniform in log x and in log y above the first, so an image fits them; the
        # first y bin is as tall as the others on this axis
        ax.image(density_rgba(hist, vmax), x_edges[0], x_edges[-1], y_edges[0], y_edges[-1])
        fig.colorbar(600, 40, 16, 330, vmax, "sequences")
    rows = buckets(record, "response_length_buckets")
    if rows:
        centers = [math.sqrt(r["length_lo"] * (r["length_hi"] or r["length_lo"] * 2)) for r in rows]
        means = [max(r["seq_max_mismatch_mean"], FLOOR) for r in rows]
        ax.line(centers, means, RED, 1.5, marker="o", label="mean per length bucket")
    ax.hline(0.5, RED)
    ax.frame("response length (model tokens)", "max |p_train − p_infer| in the sequence")
    ax.legend("lower right")
    return fig.svg()


def mismatch_by_position(record: RunRecord) -> bytes:
    """Token mismatch against position in the sequence (position buckets)."""
    rows = buckets(record, "position_buckets")
    series = [
        ("prob_diff_max", RED, "v", "max |Δp|"),
        ("abs_delta_mean", GREEN, "s", "mean |delta|"),
        ("prob_diff_mean", BLUE, "o", "mean |Δp|"),
    ]
    n = max(len(rows), 1)
    y = _log_scale([max(r[k], FLOOR) for r in rows for k, *_ in series], pad=2.0)
    fig = Figure(700, 440)
    ax = fig.axes(85, 20, 595, 330, Scale("linear", -0.5, n - 0.5), y)
    x = np.arange(len(rows), dtype=float)
    for key, color, marker, text in series:
        if rows:
            ax.line(x, [max(r[key], FLOOR) for r in rows], color, 1.5, marker=marker, label=text)
    ax.frame(
        "token position in the sequence (second line: tokens)",
        "mismatch",
        xticks=list(range(len(rows))),
        xticklabels=[f"{r['position_lo']}–{r['position_hi'] or '∞'}\n{r['count']:,}" for r in rows],
        tick_size=8.5,
    )
    ax.legend("lower right")
    return fig.svg()


def seq_max_mismatch_hist(dist: dict, record: RunRecord) -> bytes:
    """Histogram of the per-sequence max |p_train - p_infer|: on [0, 1] with the 0.5 line of the
    parallelism study, and on a log axis, where a well-matched run's mass actually is."""
    edges = np.array(dist["edges"]["seq_max_mismatch"], float)
    counts = np.array(dist["sequences"]["max_mismatch_hist"], float)
    log_edges = np.array(dist["edges"]["mismatch_log"], float)
    log_edges[0] = 10 ** (math.log10(log_edges[1]) - 0.2)  # the [0, 1e-8) bin, drawn just below 1e-8
    log_counts = dense(dist["sequences"]["length_vs_max_mismatch"]).sum(axis=0).astype(float)
    fig = Figure(1100, 390)
    m = record.metrics or {}
    for i, (c, e, xscale) in enumerate(
        ((counts, edges, Scale("linear", 0, 1)), (log_counts, log_edges, Scale("log", log_edges[0], 1.0)))
    ):
        y = Scale("log", 0.7, max(c.max(initial=1), 1) * 1.6) if c.sum() else Scale("linear", 0, 1)
        ax = fig.axes(85 + 550 * i, 20, 440, 300, xscale, y)
        if c.sum():
            ax.stairs(c, e, BLUE, 0.7, floor=0.7)
        ax.vline(0.5, RED)
        if i == 0:
            share = m.get("seq_max_mismatch_gt_0_5_share")
            count, total = m.get("seq_max_mismatch_gt_0_5_count", 0), m.get("n_sequences", 0)
            ax.note(0.5, 0.93, f"> 0.5: {count:,} of {total:,} sequences ({_pct(share)})", RED)
        ax.frame("max |p_train − p_infer| in the sequence" + (" (log)" if i else ""), "sequences")
    return fig.svg()


RATIO_TICKS = [-100, -1, -1e-2, -1e-4, -1e-6, 0, 1e-6, 1e-4, 1e-2, 1, 100]


def importance_ratio(dist: dict, record: RunRecord) -> bytes:
    """Distribution of the token log-ratio and of the sequence log-ratio (log IS weights), with
    the thresholds of the correction what-ifs."""
    edges = np.array(dist["edges"]["log_ratio"], float)
    edges[0], edges[-1] = -1e3, 1e3  # the open ends, drawn as the outermost bins
    th = (record.corrections or {}).get("thresholds") or {}
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
    fig = Figure(1100, 400)
    for i, (counts, xlabel, unit, lines) in enumerate(panels):
        x = Scale("symlog", -1e3, 1e3, linthresh=1e-7, linscale=0.6)
        total = counts.sum()
        share = counts / total if total else counts
        positive = share[share > 0]
        y = Scale("log", float(positive.min()) / 2, 1.0) if len(positive) else Scale("linear", 0, 1)
        ax = fig.axes(85 + 550 * i, 20, 440, 310, x, y)
        if total:
            ax.stairs(share, edges, BLUE, 0.6, floor=y.lo)
        for key, sub in lines:
            value = (th.get(key) or {}).get(sub)
            if value:
                ax.vline(math.log(value), RED, width=0.9)
                ax.note(math.log(value), 0.95, f"ratio {value:g}", RED, 8.5)
        ax.frame(
            xlabel + " (symlog)",
            f"share of {unit}",
            xticks=RATIO_TICKS,
            xticklabels=[label(t) for t in RATIO_TICKS],
            tick_size=8.5,
        )
    return fig.svg()


def run_figures(record: RunRecord, dist: dict) -> list[dict]:
    """Every figure of a one-run report: ``{"id", "title", "caption", "svg"}``, in report order."""
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
    return [{"id": fid, "title": title, "caption": caption, "svg": draw()} for fid, title, caption, draw in figures]

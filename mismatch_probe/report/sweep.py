"""sweep.md and sweep.html from a sweep's record (sweep.json): the attribution table, a forest plot
per headline metric, the determinism panel, cost against mismatch, and links to each point's report.
Rendering only: every number comes from the record."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mismatch_probe import __version__
from mismatch_probe.files import write_atomic
from mismatch_probe.numbers import fmt, pct
from mismatch_probe.sweep_record import SweepPointRecord, SweepRecord

SWEEP_MD = "sweep.md"
SWEEP_HTML = "sweep.html"
HEADLINES = {
    "k3_kl": "K3 KL",
    "prob_diff_max": "max |Δp|",
    "mult_prob_error": "multiplicative error",
}
DETERMINISM_LABELS = {
    "same_batch_twice": "prefill, the same batch twice",
    "alone_vs_batched": "prefill, each sequence alone vs in the batch",
    "other_neighbours_vs_batched": "prefill, other neighbours and batch size vs the batch",
}


def fold(value: float | None) -> str:
    """An x-fold ratio as people read it: 9.1x, 0.11x; "-" when unknown."""
    if value is None or not isinstance(value, int | float) or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}x"


def _interval(values: list | None, show=fold) -> str:
    if not values or len(values) < 3:
        return "-"
    return f"{show(values[0])} [{show(values[1])}, {show(values[2])}]"


def _settings(p: SweepPointRecord) -> str:
    return ", ".join(f"{k} = {v}" for k, v in p.settings.items()) or "(the spec as written)"


def attribution_rows(record: SweepRecord) -> list[dict[str, Any]]:
    """One row per point other than the baseline, largest effect on K3 first, within-noise last."""
    order = {row["name"]: i for i, row in enumerate(record.attribution.get("k3_kl", []))}
    rows = []
    for p in record.points[1:]:
        effects = {
            m: {
                "ratio": _interval((p.delta_vs_baseline.get(m) or {}).get("ratio")),
                "within_noise": (p.delta_vs_baseline.get(m) or {}).get("within_noise"),
                "paired": (p.delta_vs_baseline.get(m) or {}).get("paired"),
            }
            for m in HEADLINES
        }
        rows.append(
            {
                "name": p.name,
                "status": p.status,
                "settings": _settings(p),
                "reason": p.reason,
                "effects": effects,
                "within_noise": effects["k3_kl"]["within_noise"],
                "paired": effects["k3_kl"]["paired"],
                "cost": pct(p.cost.get("cost")) if p.cost.get("cost") is not None else "-",
                "engine_relative": fold(p.cost.get("engine_relative")),
                "reference_relative": fold(p.cost.get("reference_relative")),
                "gate": p.gate,
                "report": f"{p.run}/report.html" if p.run and p.status == "ok" else None,
            }
        )
    return sorted(rows, key=lambda r: (r["status"] != "ok", order.get(r["name"], len(order))))


def summary_lines(record: SweepRecord) -> list[str]:
    """The diagnosis in sentences: what moves K3 beyond noise, what does not, and what to change."""
    lines = []
    rows = record.attribution.get("k3_kl", [])
    moved = [r for r in rows if not r["within_noise"]]
    quiet = [r for r in rows if r["within_noise"]]
    if moved:
        lines.append(
            "Outside the noise: "
            + "; ".join(
                f"{r['name']} changes K3 {fold(r['ratio'][0])} [{fold(r['ratio'][1])}, {fold(r['ratio'][2])}]"
                for r in moved
            )
            + "."
        )
    if quiet:
        lines.append(
            "Within noise (the interval of the difference covers 0): " + ", ".join(r["name"] for r in quiet) + "."
        )
    refused = [p for p in record.points if p.status == "refused"]
    if refused:
        lines.append("Refused: " + "; ".join(f"{p.name} ({p.reason})" for p in refused) + ".")
    failed = [p for p in record.points if p.status == "failed"]
    if failed:
        lines.append("Failed: " + "; ".join(f"{p.name} ({p.reason})" for p in failed) + ".")
    rec = record.recommendation or {}
    if rec.get("gate"):
        if rec.get("point"):
            settings = ", ".join(f"{k} = {v}" for k, v in (rec.get("settings") or {}).items())
            lines.append(
                f"Recommendation: {rec['point']}" + (f" ({settings})" if settings else "") + f": {rec['why']}."
            )
        else:
            lines.append(f"Recommendation: none: {rec['why']}.")
    return lines


def forest_plot(record: SweepRecord, metric: str) -> bytes | None:
    """Each point's x-fold change of ``metric`` against the baseline with its interval, on a log
    axis; the band is the baseline's repeat spread (largest / smallest repeat, around 1x)."""
    from mismatch_probe.report.plots import _figure, to_png

    rows = [
        (p.name, p.delta_vs_baseline[metric])
        for p in record.points[1:]
        if p.status == "ok" and metric in p.delta_vs_baseline
    ]
    rows = [
        (n, e) for n, e in rows if all(isinstance(v, int | float) and v > 0 and math.isfinite(v) for v in e["ratio"])
    ]
    if not rows:
        return None
    fig, (ax,) = _figure(7.0, 0.45 * len(rows) + 1.4, layout="constrained")  # setting names of any length
    floor = (record.noise_floor.get("metrics") or {}).get(metric) or {}
    if floor.get("max_over_min"):
        spread = floor["max_over_min"]
        ax.axvspan(1 / spread, spread, color="#dde2ea", alpha=0.7, label="baseline repeats' spread")
    ax.axvline(1.0, color="#5b6473", lw=1)
    for i, (name, e) in enumerate(rows):
        est, lo, hi = e["ratio"]
        color = "#9aa3b2" if e["within_noise"] else "#1f5fbf"
        ax.errorbar([est], [i], xerr=[[est - lo], [hi - est]], fmt="o", color=color, capsize=3)
    ax.set_yticks(range(len(rows)), [n.replace("+", "\n+ ") for n, _ in rows])
    ax.invert_yaxis()
    values = [v for _, e in rows for v in e["ratio"]]
    if max(values) / min(values) > 10:  # orders of magnitude: a log axis; a few percent: a linear one
        ax.set_xscale("log")
    ax.set_xlabel(f"{HEADLINES[metric]}: x-fold vs baseline ({record.level:.0%} interval; grey: within noise)")
    if floor.get("max_over_min"):
        ax.legend(loc="best", fontsize=8)
    return to_png(fig)


def cost_plot(record: SweepRecord, thresholds: dict[str, float] | None = None) -> bytes | None:
    """Each point's cost (throughput lost, %) against its K3, with the gate's K3 line when it has one."""
    from mismatch_probe.report.plots import _figure, to_png

    pts: list[tuple[str, float, float, str | None]] = []
    for p in record.points:
        c, k3 = p.cost.get("cost"), p.metrics.get("k3_kl")
        if p.status == "ok" and isinstance(c, int | float) and isinstance(k3, int | float) and k3 > 0:
            pts.append((p.name, float(c), float(k3), p.gate))
    if not pts:
        return None
    fig, (ax,) = _figure(7.0, 4.2)
    for name, c, k3, gate in pts:
        color = {"PASS": "#2a9d3c", "WARN": "#c98a00", "FAIL": "#c0392b"}.get(gate or "", "#1f5fbf")
        ax.scatter([100 * c], [k3], color=color, s=30, zorder=3)
        ax.annotate(name, (100 * c, k3), fontsize=7, xytext=(4, 3), textcoords="offset points")
    if thresholds and "k3_kl" in thresholds:
        ax.axhline(thresholds["k3_kl"], color="#c0392b", ls="--", lw=1, label=f"gate: k3_kl <= {thresholds['k3_kl']:g}")
        ax.legend(loc="best", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("throughput cost vs baseline (%; slower side of engine and reference)")
    ax.set_ylabel("K3 KL")
    ax.set_xlim(left=min(-2.0, ax.get_xlim()[0]))
    return to_png(fig)


def determinism_rows(record: SweepRecord) -> list[dict[str, str]]:
    d = record.determinism or {}
    rows = []
    for key, label in DETERMINISM_LABELS.items():
        c = (d.get("prefill") or {}).get(key)
        if c:
            rows.append(
                {
                    "what": label,
                    "tokens": fmt(c["n_tokens"]),
                    "equal": pct(c["bitwise_equal_share"]),
                    "max": fmt(c["max_abs_delta"]),
                }
            )
    same = d.get("same_seed")
    if same:
        rows.append(
            {
                "what": f"sampling twice with one seed ({pct(same['identical_tokens_share'])} of {same['n_samples']} samples identical)",
                "tokens": fmt(same["n_tokens"]),
                "equal": pct(same["bitwise_equal_share"]),
                "max": fmt(same["max_abs_delta"]),
            }
        )
    return rows


def noise_rows(record: SweepRecord) -> list[dict[str, str]]:
    floor = (record.noise_floor or {}).get("metrics") or {}
    return [
        {
            "metric": HEADLINES.get(k, k),
            "values": ", ".join(fmt(v) for v in f.get("values", [])),
            "relative_std": pct(f.get("relative_std")),
            "max_over_min": fold(f.get("max_over_min")),
        }
        for k, f in floor.items()
        if k in HEADLINES or k in ("k1_kl", "seq_max_mismatch_mean", "log_ppl_infer")
    ]


def render_markdown(record: SweepRecord) -> str:
    lines = [f"# Sweep: {record.spec.get('name') or 'mismatch-probe'}", ""]
    lines += [f"- {s}" for s in summary_lines(record)] + [""]
    overview = (
        f"{len(record.points)} points ({record.mode}), baseline sampled {record.repeats} times; "
        f"{record.engine_configs} engine configurations, {record.engine_starts} engine starts over "
        f"{len(record.invocations)} invocation(s); intervals: {record.level:.0%} sequence bootstrap."
    )
    lines += [
        overview,
        "",
        "## Attribution (x-fold vs baseline)",
        "",
        "| point | settings | K3 | max abs Δp | mult. error | paired | within noise | cost | gate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in attribution_rows(record):
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['settings']} | {r['status']}: {r['reason']} | | | | | | |")
            continue
        e = r["effects"]
        lines.append(
            f"| {r['name']} | {r['settings']} | {e['k3_kl']['ratio']} | {e['prob_diff_max']['ratio']} | "
            f"{e['mult_prob_error']['ratio']} | {'yes' if r['paired'] else 'no'} | {'yes' if r['within_noise'] else 'no'} | "
            f"{r['cost']} | {r['gate'] or '-'} |"
        )
    lines += [
        "",
        "## Noise floor (baseline repeats)",
        "",
        "| metric | values | relative std | max / min |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['metric']} | {r['values']} | {r['relative_std']} | {r['max_over_min']} |" for r in noise_rows(record)
    ]
    det = determinism_rows(record)
    if det:
        lines += [
            "",
            "## Determinism (baseline engine)",
            "",
            "| check | tokens | bitwise equal | max abs Δ log p |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| {r['what']} | {r['tokens']} | {r['equal']} | {r['max']} |" for r in det]
        if note := (record.determinism or {}).get("same_seed_note"):
            lines += ["", f"Note: {note}."]
    lines += ["", "## Points", ""]
    lines += [
        f"- {p.name}: {p.status}" + (f", [report]({p.run}/report.html)" if p.status == "ok" and p.run else "")
        for p in record.points
    ]
    return "\n".join(lines) + "\n"


def render_html(record: SweepRecord) -> str:
    from mismatch_probe.report.html import _data_uri, _now, _templates

    bounds = (record.gate or {}).get("bounds") or {}
    figures = []
    for metric, label in HEADLINES.items():
        png = forest_plot(record, metric)
        if png:
            figures.append({"title": f"{label}: x-fold vs baseline", "src": _data_uri(png)})
    png = cost_plot(record, bounds)
    if png:
        figures.append(
            {"title": "cost vs K3" + (" (gate line dashed)" if "k3_kl" in bounds else ""), "src": _data_uri(png)}
        )
    baseline = record.points[0]
    context = {
        "title": f"mismatch-probe sweep: {record.spec.get('name') or ''}",
        "record": record,
        "summary": summary_lines(record),
        "rows": attribution_rows(record),
        "headlines": HEADLINES,
        "baseline": {
            "status": baseline.status,
            "report": f"{baseline.run}/report.html" if baseline.run and baseline.status == "ok" else None,
            "metrics": {label: fmt(baseline.metrics.get(m)) for m, label in HEADLINES.items()},
            "intervals": {label: _interval(baseline.intervals.get(m), fmt) for m, label in HEADLINES.items()},
            "throughput": {k: fmt(v) for k, v in baseline.cost.items() if k.endswith("per_s")},
        },
        "noise": noise_rows(record),
        "determinism": determinism_rows(record),
        "determinism_notes": [
            n for n in ((record.determinism or {}).get(k) for k in ("prefill_skipped", "same_seed_note")) if n
        ],
        "figures": figures,
        "version": __version__,
        "generated_at": _now(),
    }
    return _templates().get_template("sweep.html.j2").render(**context)


def write_sweep_reports(sweep_dir: Path, record: SweepRecord) -> Path:
    """Write sweep.md and sweep.html beside sweep.json; returns sweep.html's path."""
    write_atomic(sweep_dir / SWEEP_MD, render_markdown(record))
    return write_atomic(sweep_dir / SWEEP_HTML, render_html(record))


__all__ = ["render_html", "render_markdown", "write_sweep_reports"]

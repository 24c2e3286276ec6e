"""A sweep's view, from its record (sweep.json) alone, in the vocabulary of :mod:`.view`: the
diagnosis, the attribution table, the noise floor, the determinism panel, the points and the figure
list. ``sweep.md``, ``sweep.html`` and the terminal's summary render it (:mod:`.pages`:
``write_sweep_reports``, :mod:`.terminal`). Nothing here computes a number."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mismatch_probe.analysis.metric_docs import METRIC_DOC
from mismatch_probe.numbers import fmt, fold, interval, pct
from mismatch_probe.report.view import Card, Column, FigureInfo, Row, Table, View
from mismatch_probe.sweep_record import SweepPointRecord, SweepRecord
from mismatch_probe.version import __version__

SWEEP_MD = "sweep.md"
SWEEP_HTML = "sweep.html"
DETERMINISM_LABELS = {
    "same_batch_twice": "prefill, the same batch twice",
    "alone_vs_batched": "prefill, each sequence alone vs in the batch",
    "other_neighbours_vs_batched": "prefill, other neighbours and batch size vs the batch",
}
NOISE_METRICS = ("k1_kl", "seq_max_mismatch_mean", "log_ppl_infer")  # shown beside the headline ones
# each point's own numbers in the points table (a precision grid reads them across its cells)
POINT_METRICS = ("prob_diff_max", "mult_prob_error", "pearson_prob")


@dataclass
class SweepView(View):
    kind: Literal["sweep"]
    name: str
    title: str
    subtitle: str
    summary: list[str]
    baseline: list[Card]
    baseline_report: str
    attribution: Table
    noise: Table
    determinism: Table
    determinism_notes: list[str]
    points: Table
    corrections: Table
    figures: list[FigureInfo]
    version: str = __version__


def headlines() -> dict[str, str]:
    """The headline metrics a sweep attributes (its baseline's effects are over these), by label."""
    from mismatch_probe.analysis.sweep import HEADLINE_METRICS

    return {m: METRIC_DOC[m].label for m in HEADLINE_METRICS}


def _report(p: SweepPointRecord) -> str:
    return f"{p.run}/report.html" if p.run and p.status == "ok" else ""


def summary_lines(record: SweepRecord) -> list[str]:
    """The diagnosis in sentences: what moves K3 beyond noise, what does not, and what to change."""
    lines = []
    rows = record.attribution.get("k3_kl", [])
    moved = [r for r in rows if not r["within_noise"]]
    quiet = [r for r in rows if r["within_noise"]]
    if moved:
        lines.append(
            "Outside the noise: " + "; ".join(f"{r['name']} changes K3 {interval(r['ratio'])}" for r in moved) + "."
        )
    if quiet:
        lines.append(
            "Within noise (the interval of the difference covers 0): " + ", ".join(r["name"] for r in quiet) + "."
        )
    for status in ("refused", "failed"):
        points = [p for p in record.points if p.status == status]
        if points:
            lines.append(f"{status.capitalize()}: " + "; ".join(f"{p.name} ({p.reason})" for p in points) + ".")
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


def attribution_table(record: SweepRecord) -> Table:
    """One row per point other than the baseline, largest effect on K3 first, the others last."""
    heads = headlines()
    order = {row["name"]: i for i, row in enumerate(record.attribution.get("k3_kl", []))}
    points = sorted(record.points[1:], key=lambda p: (p.status != "ok", order.get(p.name, len(order))))
    rows = []
    for p in points:
        name = p.name.replace("+", " + ")
        if p.status != "ok":
            rows.append(Row([name], note=f"{p.status}: {p.reason}"))
            continue
        effects = [p.effect(m) for m in heads]
        within = bool(p.effect("k3_kl").get("within_noise"))
        rows.append(
            Row(
                [name]
                + [interval(e.get("ratio")) + (" (noise)" if e.get("within_noise") else "") for e in effects]
                + ["yes" if effects[0].get("paired") else "no", "yes" if within else "no"]
                + [pct(p.cost.get("cost")), fold(p.cost.get("engine_relative")), fold(p.cost.get("reference_relative"))]
                + [p.gate or "-", _report(p)],
                muted=within,
            )
        )
    return Table(
        "attribution",
        f"Attribution: each point against the baseline (x-fold, {pct(record.level)} interval)",
        [Column("point (the settings it changes)", "text"), *(Column(label) for label in heads.values())]
        + [Column("paired", "text"), Column("within noise", "text"), Column("cost"), Column("engine speed")]
        + [Column("reference speed"), Column("gate", "text"), Column("report", "link")],
        rows,
        lead="Sorted by the size of the effect on K3; points whose difference from the baseline is within noise "
        "(its interval covers 0) are grey. Paired: the point re-scored the baseline's own tokens, so sampling "
        "noise cancels.",
    )


def noise_table(record: SweepRecord) -> Table:
    floor = {metric: record.floor(metric) for metric in record.noise_floor.get("metrics") or {}}
    shown = {**headlines(), **{k: k for k in NOISE_METRICS}}
    return Table(
        "noise",
        "Noise floor: the baseline's repeats (same settings, other seeds)",
        [Column("metric", "text"), Column("values"), Column("relative std"), Column("largest / smallest")],
        [
            Row(
                [shown[k], ", ".join(fmt(v) for v in f.get("values", [])), pct(f.get("relative_std"))]
                + [fold(f.get("max_over_min"))]
            )
            for k, f in floor.items()
            if k in shown
        ],
    )


def determinism_table(record: SweepRecord) -> Table:
    d = record.determinism or {}
    rows = []
    for key, label in DETERMINISM_LABELS.items():
        c = record.prefill_determinism(key)
        if c:
            rows.append(Row([label, fmt(c["n_tokens"]), pct(c["bitwise_equal_share"]), fmt(c["max_abs_delta"])]))
    same = d.get("same_seed")
    if same:
        identical = f"{pct(same['identical_tokens_share'])} of {same['n_samples']} samples identical"
        rows.append(
            Row(
                [
                    f"sampling twice with one seed ({identical})",
                    fmt(same["n_tokens"]),
                    pct(same["bitwise_equal_share"]),
                    fmt(same["max_abs_delta"]),
                ]
            )
        )
    return Table(
        "determinism",
        "Determinism and batch invariance of the baseline engine",
        [Column("check", "text"), Column("tokens"), Column("bitwise-equal log-probs"), Column("max |Δ log p|")],
        rows,
    )


def axis_labels(record: SweepRecord) -> list[str]:
    """The sweep's axes, as its points name their levels (none in a sweep recorded before levels)."""
    return list(record.points[0].levels) if record.points else []


def _level(p: SweepPointRecord, axis: str) -> str:
    level = p.levels.get(axis)
    return level if level is not None else "as written"


def points_table(record: SweepRecord) -> Table:
    """Every point with its level on each axis, K3 with its interval and its own numbers."""
    axes = axis_labels(record)
    k3 = METRIC_DOC["k3_kl"].label
    rows = []
    for p in record.points:
        cells = [p.name.replace("+", " + "), *(_level(p, a) for a in axes), p.status]
        if p.status != "ok":
            rows.append(Row(cells, note=str(p.reason)))
            continue
        cells += [interval(p.intervals.get("k3_kl"), fmt), *(fmt(p.metrics.get(m)) for m in POINT_METRICS)]
        rows.append(Row([*cells, _report(p)]))
    return Table(
        "points",
        "Points",
        [Column("point", "text"), *(Column(a, "text") for a in axes), Column("status", "text")]
        + [Column(f"{k3} [{pct(record.level)} interval]"), *(Column(METRIC_DOC[m].label) for m in POINT_METRICS)]
        + [Column("report", "link")],
        rows,
    )


def baseline_k3_range(record: SweepRecord) -> tuple[float, float] | None:
    """The smallest and largest K3 of the baseline's repeats (the noise floor's span)."""
    values = record.repeat_values("k3_kl")
    return (min(values), max(values)) if values else None


def corrections_table(record: SweepRecord) -> Table:
    """Does a correction rescue the point? Per point and correction: the share it clips or drops and
    the K3 of what it keeps, marked when that K3 is back within the baseline's repeats."""
    from mismatch_probe.analysis.metric_docs import CORRECTION_DOCS, KEPT_K3_MEANING
    from mismatch_probe.analysis.metrics import KEPT_K3

    floor = baseline_k3_range(record)
    axes = axis_labels(record)

    def cell(corr: dict, key: str) -> str:
        kept = corr.get(KEPT_K3[key])
        if corr.get(key) is None and kept is None:
            return "-"  # a run analysed before the kept K3 was recorded, or one without sequences
        rescued = floor is not None and isinstance(kept, int | float) and kept <= floor[1]
        return f"{pct(corr.get(key))} → {fmt(kept)}" + (" ✓" if rescued else "")

    rows = []
    recorded = any(p.corrections for p in record.points)
    for p in record.points if recorded else ():
        first = [p.name.replace("+", " + "), *(_level(p, a) for a in axes)]
        if p.status != "ok":
            rows.append(Row(first, note=f"{p.status}: {p.reason}"))
            continue
        rows.append(Row([*first, fmt(p.metrics.get("k3_kl")), *(cell(p.corrections, k) for k in CORRECTION_DOCS)]))
    within = (
        f"✓: within the baseline's repeats ({fmt(floor[0])} to {fmt(floor[1])}) or below"
        if floor
        else "the baseline has no repeats to mark against"
    )
    return Table(
        "corrections",
        "Does a correction rescue it? Share clipped or dropped → K3 of what it keeps",
        [Column("point", "text"), *(Column(a, "text") for a in axes), Column(METRIC_DOC["k3_kl"].label)]
        + [Column(doc.label) for doc in CORRECTION_DOCS.values()],
        rows,
        lead=f"Each correction at the spec's thresholds: the share of tokens (token corrections) or sequences "
        f"(sequence corrections) it clips or drops, and the K3 of what it keeps: {KEPT_K3_MEANING}. {within}."
        if recorded
        else "This sweep was summarized before its record held the correction what-ifs; each point's own "
        "report has them.",
    )


def sweep_view(record: SweepRecord) -> SweepView:
    from mismatch_probe.report.figures import sweep_figure_list

    baseline = record.points[0]
    heads = headlines()
    name = record.spec.get("name") or "mismatch-probe"
    return SweepView(
        kind="sweep",
        name=name,
        title=f"Sweep: {name}",
        subtitle=(
            f"{len(record.points)} points ({record.mode}), baseline sampled {record.repeats} times; "
            f"{record.engine_configs} engine configurations, {record.engine_starts} engine starts over "
            f"{len(record.invocations)} invocation(s); intervals: {pct(record.level)} sequence bootstrap"
        ),
        summary=summary_lines(record),
        baseline=[
            Card(f"baseline {label}", fmt(baseline.metrics.get(m)), interval(baseline.intervals.get(m), fmt))
            for m, label in heads.items()
        ],
        baseline_report=_report(baseline),
        attribution=attribution_table(record),
        noise=noise_table(record),
        determinism=determinism_table(record),
        determinism_notes=[
            f"{n}." for n in (record.determinism_note(k) for k in ("prefill_skipped", "same_seed_note")) if n
        ],
        points=points_table(record),
        corrections=corrections_table(record),
        figures=[info for info, _ in sweep_figure_list()],
    )


__all__ = ["SWEEP_HTML", "SWEEP_MD", "SweepView", "summary_lines", "sweep_view"]

"""Several runs side by side: the comparison page's view (``compare.html``, and the terminal's
table of a spec's ``[[variants]]``), in the vocabulary of :mod:`.view`. :func:`label_runs` names,
colours and orders the runs; :func:`comparison_view` builds the page. Nothing here computes a
number: every value comes from the runs' records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from mismatch_probe.analysis.metric_docs import CORRECTION_DOCS, METRIC_DOC, METRIC_DOCS, rank
from mismatch_probe.files import portable_path, resolve_from_dir
from mismatch_probe.numbers import fmt, pct
from mismatch_probe.report import labels
from mismatch_probe.report.data import RunData
from mismatch_probe.report.figures import COMPARISON_FIGURES, RUN_COLORS
from mismatch_probe.report.view import Column, FigureInfo, Row, Table, View
from mismatch_probe.version import __version__


@dataclass
class ComparisonView(View):
    kind: Literal["comparison"]
    title: str
    subtitle: str
    runs: Table
    warnings: list[str]
    shared_rollouts: str
    differing: Table
    metrics: Table
    corrections: Table
    notes: list[tuple[str, str, list[str]]]  # (run label, colour, notes) of runs that have notes
    figures: list[FigureInfo]
    version: str = __version__


COMPARISON_EXTRA_ROWS = (  # (section, key, label, better)
    ("metrics_by_turn.later", "k3_kl", "K3 KL, later turns", "lower"),
    ("decode_vs_prefill", "k3_kl", "K3 KL, decode vs prefill", "lower"),
)


def _ranked(label: str, key: str, meaning: str, values: list, better: str | None, show=fmt) -> Row:
    best, worst = rank(values, better)
    marks = ["best" if i in best else "worst" if i in worst else "" for i in range(len(values))]
    return Row([label, *(show(v) for v in values), meaning], key=key, marks=["", *marks, ""])


def label_runs(runs: list[RunData]) -> list[RunData]:
    """Name and colour each run (its spec's name, else its directory, numbered when two are alike)
    and order them by hardware type (in the order types first appear), then configuration."""
    names = [labels.run_label(r.record, r.path) for r in runs]
    for k, run in enumerate(runs):
        # runs of one probe spec share its name; their directories tell them apart
        run.label = names[k] if names.count(names[k]) == 1 else run.path.name
        run.color = RUN_COLORS[k % len(RUN_COLORS)]
    given = [r.label for r in runs]
    for k, run in enumerate(runs):
        if given.count(run.label) > 1:
            run.label = f"{run.label} ({k + 1})"
    order = list(dict.fromkeys(labels.gpu_type(r.record) for r in runs))
    return sorted(
        runs,
        key=lambda r: (
            order.index(labels.gpu_type(r.record)),
            labels.engine_label(r.record),
            labels.reference_label(r.record),
        ),
    )


def comparison_view(runs: list[RunData], title: str = "") -> ComparisonView:
    """Several runs side by side, grouped by hardware type: settings that differ, every metric with
    the best and the worst run marked, and the overlaid distributions' list. ``runs`` as
    :func:`label_runs` names and orders them."""
    hardware = [labels.gpu_type(r.record) for r in runs]
    groups = [(g, hardware.count(g)) for g in dict.fromkeys(hardware)]
    run_columns = [Column(r.label, color=r.color) for r in runs]

    settings = [labels.comparable_settings(r.record) for r in runs]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    differing = [k for k in keys if len({s.get(k, "-") for s in settings}) > 1]

    metric_rows = [
        _ranked(doc.label, doc.key, doc.meaning, [r.record.metric(doc.key) for r in runs], doc.better)
        for doc in METRIC_DOCS
    ]
    for section, key, label, better in COMPARISON_EXTRA_ROWS:
        values = [r.record.lookup(f"{section}.{key}") for r in runs]
        if any(v is not None for v in values):
            metric_rows.append(_ranked(label, f"{section}.{key}", METRIC_DOC[key].meaning, values, better))
    correction_rows = [
        _ranked(doc.label, key, doc.meaning, [r.record.correction(key) for r in runs], "lower", pct)
        for key, doc in CORRECTION_DOCS.items()
    ]

    warnings = [
        f"The runs use different {what}; their numbers measure different things."
        for what in ("model", "prompts")
        if len({s.get(what) for s in settings}) > 1
    ]
    thresholds = {json.dumps(r.record.correction("thresholds"), sort_keys=True) for r in runs}
    if len(thresholds) > 1:
        warnings.append("The runs use different correction thresholds; their what-if shares are not comparable.")
    sources = {resolve_from_dir(r.path, r.record.rollouts_source().run or ".") for r in runs}
    grouped = [("", 1), *groups, ("", 1)]
    return ComparisonView(
        kind="comparison",
        title=title or f"mismatch-probe: {len(runs)} runs compared",
        subtitle=" · ".join(f"{g} ({n} run{'s' if n > 1 else ''})" for g, n in groups),
        runs=Table(
            "runs",
            "Runs, by hardware",
            [Column("hardware", "text"), Column("run", "text"), Column("engine", "text"), Column("reference", "text")]
            + [Column("model tokens"), Column("sequences"), Column("directory", "text")],
            [
                Row(
                    [
                        labels.gpu_type(r.record),
                        r.label,
                        labels.engine_label(r.record),
                        labels.reference_label(r.record),
                    ]
                    + [fmt(r.record.metric("n_model_tokens")), fmt(r.record.metric("n_sequences"))]
                    + [portable_path(r.path)]
                )
                for r in runs
            ],
        ),
        warnings=warnings,
        shared_rollouts=portable_path(next(iter(sources))) if len(sources) == 1 else "",
        differing=Table(
            "differences",
            "What differs between the runs",
            [Column("setting", "code"), *(Column(r.label, "text", r.color) for r in runs)],
            [Row([k, *(s.get(k, "-") for s in settings)]) for k in differing],
        ),
        metrics=Table(
            "metrics",
            "Metrics side by side",
            [Column("metric", "text"), *run_columns, Column("meaning", "long")],
            metric_rows,
            lead="Green marks the best run of a row, red the worst (rows where lower or higher is plainly better).",
            groups=grouped,
        ),
        corrections=Table(
            "corrections",
            "Correction what-ifs: share clipped or dropped",
            [Column("correction", "text"), *run_columns, Column("what it does", "long")],
            correction_rows,
        ),
        notes=[(r.label, r.color, labels.notes(r.record)) for r in runs if labels.notes(r.record)],
        figures=[info for info, _ in COMPARISON_FIGURES],
    )

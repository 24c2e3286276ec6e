"""A timeline's view: the mismatch of an RL run over its training steps, from its record
(``timeline.json``) and ``steps.parquet``, in the vocabulary of :mod:`.view`.

:func:`timeline_view` builds it; ``timeline.html`` (:mod:`.html`, the run and sweep pages' look:
``templates/timeline.html.j2``) and ``timeline.md`` (:mod:`.markdown`) render it, and the
terminal's summary (:func:`timeline_summary`) says its headlines: a headline per drifted metric,
the drift test of every metric, the steps (a long timeline shows its kept steps and its first and
last few; ``steps.parquet`` holds them all), the kept steps and why, notes and failed steps. Its
figures are :mod:`.figures.timeline`'s. Nothing here computes a statistic: every number comes from
the record or the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from mismatch_probe.analysis.drift import POWER_FACTOR, POWER_STEPS
from mismatch_probe.analysis.timeline import DRIFT_METRICS
from mismatch_probe.numbers import fmt, fold, pct, seconds
from mismatch_probe.report.data import Columns, step_columns
from mismatch_probe.report.figures import timeline_figure_list
from mismatch_probe.report.labels import SHARES, metric_label
from mismatch_probe.report.view import Card, Column, FigureInfo, Pairs, Row, Table, View
from mismatch_probe.timeline_record import TimelineRecord
from mismatch_probe.version import __version__

if TYPE_CHECKING:
    import pyarrow as pa

TIMELINE_HTML = "timeline.html"
TIMELINE_MD = "timeline.md"
ALL_ROWS_UP_TO = 60  # a timeline of more steps shows its kept steps and its first and last few
EDGE_ROWS = 5


@dataclass
class TimelineView(View):
    kind: Literal["timeline"]
    title: str
    name: str
    subtitle: str
    status: str
    headlines: list[str]  # a sentence per drifted metric, or why none is
    cards: list[Card]
    drift: Table  # every tested metric: its change point or none
    steps: Table
    kept: Table
    failed: Table
    notes: list[str]
    setup: Pairs
    figures: list[FigureInfo]
    version: str = __version__


def _value(key: str, value: Any) -> str:
    return pct(value) if key in SHARES and isinstance(value, int | float) else fmt(value)


def _fold(value: Any) -> str:
    return value if isinstance(value, str) else fold(value)  # "inf", as a drift result writes it


def _steps(span: Any) -> str:
    """A range of steps, [a, b], as "steps a–b" (or "step a" when a is b)."""
    if not span or span[0] is None:
        return "-"
    a, b = int(span[0]), int(span[-1])
    return f"step {a}" if a == b else f"steps {a}–{b}"


def drift_sentence(metric: str, result: dict[str, Any]) -> str:
    """The headline of a metric whose drift was detected: where it departs and by how much, on
    the scale its test reads (an x-fold change for a log-scale metric, the two medians for a share
    or an error near 1)."""
    label = metric_label(metric)
    where = f"at step {result.get('change_step')} ({_steps(result.get('interval'))})"
    window = f"its median over {_steps(result.get('baseline_steps'))}"
    before, after = _value(metric, result.get("baseline")), _value(metric, result.get("after"))
    if (result.get("scale") or DRIFT_METRICS.get(metric)) == "log":
        return f"{label} departs from its baseline {where}: {_fold(result.get('ratio'))} {window} ({before} → {after})"
    return f"{label} departs from its baseline {where}: {window} is {before}, from the change to the alarm {after}"


def _alpha(record: TimelineRecord) -> float | None:
    alpha = record.options.get("alpha")
    if alpha is None:
        alpha = next((r.get("alpha") for r in record.drift.values() if r.get("alpha") is not None), None)
    return alpha


def false_alarm_rate(record: TimelineRecord) -> str:
    """The drift test's false-alarm rate as the record states it: per run over every metric tested
    (each at its share, timeline/runner.py: drift_tests), or per metric for a timeline written before
    the run-level rate (no ``alpha_scope``)."""
    alpha = _alpha(record)
    if alpha is None:
        return "-"
    if record.options.get("alpha_scope") != "run":
        return f"{pct(alpha)} per metric"
    tested = [r for r in record.drift.values() if not r.get("reason")]
    each = next((r.get("alpha") for r in tested if r.get("alpha") is not None), None)
    if not tested or each is None:
        return f"{pct(alpha)} per run"
    return f"{pct(alpha)} per run over the {len(tested)} metrics tested (each at {pct(each)})"


def k3_power(record: TimelineRecord) -> str | None:
    """What the K3 test could catch on this run: the chance that a 2x rise lasting 20 steps alarms
    within them, at this run's threshold and step-to-step noise (analysis/drift.py: DriftResult.power)."""
    power = (record.drift.get("k3_kl") or {}).get("power")
    if power is None:
        return None
    return f"a {POWER_FACTOR:g}x rise of {metric_label('k3_kl')} lasting {POWER_STEPS} steps alarms within them in {pct(power)} of runs with this run's noise"


def headline_lines(record: TimelineRecord) -> list[str]:
    """A sentence per metric that drifted (in the order of ``DRIFT_METRICS``), else why none is
    reported: no drift found, or none could be tested."""
    if not record.steps.get("count"):
        return ["no steps analysed yet"]
    ordered = [m for m in DRIFT_METRICS if m in record.drift] + [m for m in record.drift if m not in DRIFT_METRICS]
    drifted = [drift_sentence(m, record.drift[m]) for m in ordered if record.drift[m].get("detected")]
    if drifted:
        return drifted
    tested = [m for m in ordered if not record.drift[m].get("reason")]
    if tested:
        return [f"no drift found in any metric (false-alarm rate {false_alarm_rate(record)})"]
    reasons = list(dict.fromkeys(str(record.drift[m]["reason"]) for m in ordered))
    return ["drift not tested: " + ("; ".join(reasons) if reasons else "no metric was tested")]


def overview_line(record: TimelineRecord) -> str:
    s = record.steps
    line = f"{fmt(s.get('count') or 0)} steps"
    if s.get("count"):
        line += f" ({_steps([s.get('first'), s.get('last')]).removeprefix('steps ').removeprefix('step ')})"
    line += f", {fmt(s.get('model_tokens') or 0)} model tokens"
    if s.get("failed"):
        line += f"; {len(s['failed'])} step(s) could not be read"
    return line


def timeline_summary(record: TimelineRecord) -> str:
    """The terminal's summary: the steps and tokens, then the headlines."""
    return "\n".join([overview_line(record), *headline_lines(record)])


def drift_table(record: TimelineRecord) -> Table:
    rows = []
    for metric in [m for m in DRIFT_METRICS if m in record.drift] + [m for m in record.drift if m not in DRIFT_METRICS]:
        r = record.drift[metric]
        if r.get("reason"):
            rows.append(Row([metric_label(metric)], key=metric, note=f"not tested: {r['reason']}"))
            continue
        detected = bool(r.get("detected"))
        rows.append(
            Row(
                [
                    metric_label(metric),
                    "departs" if detected else "no drift",
                    str(r.get("change_step")) if detected else "-",
                    _steps(r.get("interval")) if detected else "-",
                    str(r["alarm_step"]) if detected and r.get("alarm_step") is not None else "-",
                    f"{_value(metric, r.get('baseline'))} ({_steps(r.get('baseline_steps'))})",
                    _value(metric, r.get("after")) if detected else "-",
                    _fold(r.get("ratio")) if detected else "-",
                ],
                key=metric,
                muted=not detected,
            )
        )
    alpha = _alpha(record)
    return Table(
        "drift",
        "Drift: each metric against its early steps",
        [Column("metric", "text"), Column("result", "text"), Column("change step"), Column("interval")]
        + [
            Column("alarm step"),
            Column("baseline median"),
            Column("median, change to alarm"),
            Column("that / baseline"),
        ],
        rows,
        lead="Each metric's per-step values are tested against its baseline window (the first steps): the change "
        "step is where its level shifts, with the steps it could be; the alarm step is the first step at which "
        "the test is past its threshold. "
        + (f"False-alarm rate {false_alarm_rate(record)}." if alpha is not None else "")
        + (f" Detection: {k3_power(record)}." if k3_power(record) else ""),
    )


def _why(item: str, worst: Any) -> str:
    if item in ("first", "last"):
        return f"the {item} step"
    if item == "all":
        return "every step is kept (--keep all)"
    kind, _, metric = item.partition(" ")
    if kind == "worst":
        return f"among the {worst} largest {metric_label(metric)}" if worst else f"a largest {metric_label(metric)}"
    if kind == "change":
        return f"{metric_label(metric)}'s change point"
    return item


def _run_report(run: str | None) -> str:
    return f"{run}/report.html" if run else ""


def kept_table(record: TimelineRecord) -> Table:
    worst = record.options.get("worst")
    rows = []
    for k in record.kept:
        cells = [str(k.step), "; ".join(_why(w, worst) for w in k.why)]
        if k.run:
            rows.append(Row([*cells, _run_report(k.run)]))
        else:
            rows.append(Row(cells, note=f"no run directory: {k.reason}" if k.reason else "no run directory"))
    return Table(
        "kept",
        "Kept steps: full run directories worth opening",
        [Column("step"), Column("why", "text"), Column("report", "link")],
        rows,
        lead="Each kept step is imported and analysed as a run of its own (its worst sequences token by token, "
        "every figure of a run report).",
    )


def failed_table(record: TimelineRecord) -> Table:
    failed = record.steps.get("failed") or {}
    return Table(
        "failed",
        "Steps that could not be read",
        [Column("step"), Column("why", "text")],
        [Row([str(step), str(why)]) for step, why in sorted(failed.items(), key=lambda kv: int(kv[0]))],
    )


def shown_steps(steps: np.ndarray, record: TimelineRecord) -> list[int]:
    """The indices of the steps the page's table shows: all of a short timeline; of a long one its
    first and last few, the kept steps and each change point."""
    n = len(steps)
    if n <= ALL_ROWS_UP_TO:
        return list(range(n))
    wanted = {int(k.step) for k in record.kept}
    wanted |= {
        int(r["change_step"]) for r in record.drift.values() if r.get("detected") and r.get("change_step") is not None
    }
    shown = set(range(EDGE_ROWS)) | set(range(n - EDGE_ROWS, n))
    shown |= {int(i) for i in np.flatnonzero(np.isin(steps, list(wanted)))}
    return sorted(shown)


def steps_table(record: TimelineRecord, columns: Columns) -> Table:
    rows_all = columns["all"]
    steps = rows_all.get("step", np.zeros(0)).astype(np.int64)
    routing = bool(len(steps)) and bool(np.isfinite(rows_all["routing_flip_share"]).any())
    kept = {k.step: k for k in record.kept}
    changes: dict[int, list[str]] = {}
    for metric, r in record.drift.items():
        if r.get("detected") and r.get("change_step") is not None:
            changes.setdefault(int(r["change_step"]), []).append(metric_label(metric))
    worst = record.options.get("worst")

    def num(key: str, i: int) -> Any:
        v = rows_all[key][i]
        return None if np.isnan(v) else float(v)

    shown = shown_steps(steps, record)
    rows: list[Row] = []
    previous = -1
    for i in shown:
        if i > previous + 1:
            rows.append(Row(["…"], note=f"{i - previous - 1} steps not shown (steps.parquet has every step)"))
        previous = i
        step = int(steps[i])
        k3 = [num("k3_kl", i), num("k3_kl_low", i), num("k3_kl_high", i)]
        cells = [str(step), f"{fmt(k3[0])} [{fmt(k3[1])}, {fmt(k3[2])}]" if k3[1] is not None else fmt(k3[0])]
        cells += [fmt(num(m, i)) for m in ("prob_diff_max", "mult_prob_error", "seq_max_mismatch_mean")]
        cells.append(pct(num("token_tis_clipped_share", i)))
        if routing:
            cells.append(pct(num("routing_flip_share", i)))
        why = [_why(w, worst) for w in kept[step].why] if step in kept else []
        why += [f"{m}'s change point" for m in changes.get(step, []) if f"{m}'s change point" not in why]
        cells += ["; ".join(why), _run_report(kept[step].run if step in kept else None)]
        rows.append(Row(cells, marks=["", "worst"] if step in changes else []))
    lead = (
        f"{len(shown)} of {fmt(len(steps))} steps: the first and last {EDGE_ROWS}, the kept steps and each change "
        "point; steps.parquet holds every step (one row per step and turn group)."
        if len(shown) < len(steps)
        else "Every step (group: all model tokens); steps.parquet has the same rows with every metric and turn group."
    )
    return Table(
        "steps",
        "Steps",
        [Column("step"), Column(f"{metric_label('k3_kl')} [interval]")]
        + [Column(metric_label(m)) for m in ("prob_diff_max", "mult_prob_error", "seq_max_mismatch_mean")]
        + [Column(metric_label("token_tis_clipped_share"))]
        + ([Column(metric_label("routing_flip_share"))] if routing else [])
        + [Column("kept", "text"), Column("report", "link")],
        rows,
        lead=lead + " The K3 interval is the step's sequence bootstrap (which sequences the step happened to sample).",
    )


def _keep(options: dict[str, Any]) -> str:
    keep = options.get("keep")
    if keep == "auto":
        return f"auto: the first and last steps, the {options.get('worst', '?')} of largest K3, each change point"
    return {"all": "all: every step", "none": "none"}.get(str(keep), "-")


def timeline_view(record: TimelineRecord, table: pa.Table) -> TimelineView:
    """The timeline's one view, from its record and ``steps.parquet``."""
    return view_of(record, step_columns(table))


def view_of(record: TimelineRecord, columns: Columns) -> TimelineView:
    """:func:`timeline_view` from the table's columns (:func:`step_columns`)."""
    source = record.source
    path = str(source.get("path") or "")
    name = Path(path).name or path or "timeline"
    s, o = record.steps, record.options
    k3 = record.drift.get("k3_kl") or {}
    tested = [r for r in record.drift.values() if not r.get("reason")]
    cards = [
        Card("steps", fmt(s.get("count") or 0), _steps([s.get("first"), s.get("last")]) if s.get("count") else ""),
        Card("model tokens", fmt(s.get("model_tokens") or 0), "over every step"),
        Card(
            "drift",
            (
                f"the run drifted: {drifted} of {len(tested)} metrics"
                if (drifted := sum(bool(r.get("detected")) for r in tested))
                else f"none in {len(tested)} metrics tested"
            ),
            f"false-alarm rate {false_alarm_rate(record)}",
        ),
    ]
    if k3 and not k3.get("reason"):
        cards.append(
            Card(f"{metric_label('k3_kl')}, baseline median", fmt(k3.get("baseline")), _steps(k3.get("baseline_steps")))
        )
    setup = [
        ("source", f"{source.get('format', '?')} dumps: {path or '-'}"),
        ("model", str(source.get("model") or "- (no --model: no kept step has a run directory)")),
        ("status", record.status),
        ("baseline", f"the first {o['baseline_steps']} steps" if o.get("baseline_steps") else "-"),
        ("false-alarm rate", false_alarm_rate(record)),
        ("detection", k3_power(record) or "-"),
        ("kept", _keep(o)),
        ("probe version", record.probe_version),
    ]
    if record.gate and record.gate.get("status"):
        setup.append(("gate", str(record.gate["status"])))
    if record.timings.get("seconds") is not None:
        setup.append(("time", f"{seconds(record.timings['seconds'])} s"))
    return TimelineView(
        kind="timeline",
        title=f"Timeline: {name}",
        name=name,
        subtitle=f"{source.get('format', '?')} dumps; " + overview_line(record),
        status=record.status,
        headlines=headline_lines(record),
        cards=cards,
        drift=drift_table(record),
        steps=steps_table(record, columns),
        kept=kept_table(record),
        failed=failed_table(record),
        notes=list(record.notes),
        setup=setup,
        figures=[info for info, _ in timeline_figure_list(columns)],
    )

"""A timeline's page: the mismatch of an RL run over its training steps, from its record
(``timeline.json``) and ``steps.parquet``.

One view model (:func:`timeline_view`) is rendered as ``timeline.html`` (the run and sweep pages'
look: ``templates/timeline.html.j2``), ``timeline.md`` and the terminal's summary
(:func:`timeline_summary`): a headline per drifted metric, the drift test of every metric, the
steps (a long timeline shows its kept steps and its first and last few; ``steps.parquet`` holds
them all), the kept steps and why, notes and failed steps. Its figures (:func:`timeline_figures`)
draw each metric against the step with the same helpers as the run's figures: the step's bootstrap
band, the baseline window shaded, its median as a line, the change point and its interval, and the
published ranges where the project has them. Nothing here computes a statistic: every number
comes from the record or the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from mismatch_probe.analysis.metric_docs import (
    CORRECTION_DOCS,
    K3_BY_GPU,
    METRIC_DOC,
    NEMO_RL_MULT_ERROR_THRESHOLD,
    PUBLISHED_K3,
    VERL_PROB_DIFF_EXPECTED,
    VERL_PROB_DIFF_ISSUE,
    fmt_range,
)
from mismatch_probe.analysis.timeline import DRIFT_METRICS
from mismatch_probe.files import write_atomic
from mismatch_probe.numbers import fmt, fold, pct, seconds
from mismatch_probe.report import html
from mismatch_probe.report.figures import FIGURES_DIR, DrawnFigure, FigureInfo
from mismatch_probe.report.figures.drawing import (
    BLUE,
    FLOOR,
    GREEN,
    GREY,
    RED,
    RUN_COLORS,
    finish,
    new_figure,
    style,
    to_svg,
)
from mismatch_probe.report.markdown import table as md_table
from mismatch_probe.report.model import Card, Column, Row, Table, View
from mismatch_probe.report.pages import write_figure_files
from mismatch_probe.text import md_text
from mismatch_probe.timeline_record import TimelineRecord
from mismatch_probe.version import __version__

if TYPE_CHECKING:
    import pyarrow as pa
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

TIMELINE_HTML = "timeline.html"
TIMELINE_MD = "timeline.md"
ALL_ROWS_UP_TO = 60  # a timeline of more steps shows its kept steps and its first and last few
EDGE_ROWS = 5
MARKERS_UP_TO = 60  # a line of fewer steps marks each one (one step alone is a point, not a line)
ENVELOPE_BINS = 150  # a longer series is drawn as the range of each of this many runs of steps
ROUTING_LABELS = {"routing_flip_share": "routing flip share", "routing_set_agreement_mean": "routing set agreement"}
SHARES = (*CORRECTION_DOCS, "routing_flip_share")  # shown as percentages

# ---- the view model -------------------------------------------------------------------------


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
    setup: list[tuple[str, str]]
    figures: list[FigureInfo]
    version: str = __version__


Columns = dict[str, dict[str, np.ndarray]]  # turn group -> column -> values by step (null: NaN)


def step_columns(table: pa.Table) -> Columns:
    """steps.parquet's rows of each turn group as float arrays, one value per step (null: NaN)."""
    import pyarrow.compute as pc

    out: Columns = {}
    for group in ("all", "first", "later"):
        rows = table.filter(pc.equal(table.column("group"), group))
        out[group] = {
            name: rows.column(name).to_numpy(zero_copy_only=False).astype(float)
            for name in rows.column_names
            if name != "group"
        }
    return out


def metric_label(key: str) -> str:
    """A metric's name on the page: its documented label, a correction's name, or routing's."""
    if key in METRIC_DOC:
        return METRIC_DOC[key].label
    if key in CORRECTION_DOCS:
        return f"{CORRECTION_DOCS[key].label} share"
    return ROUTING_LABELS.get(key, key)


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
        return [f"no drift found in any metric (false-alarm rate {pct(_alpha(record))} per metric)"]
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
        + (f"False-alarm rate {pct(alpha)} per metric over the run." if alpha is not None else ""),
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
    """The timeline's one view model, from its record and ``steps.parquet``."""
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
            "drifted metrics",
            f"{sum(bool(r.get('detected')) for r in tested)} of {len(tested)} tested",
            f"false-alarm rate {pct(_alpha(record))} per metric",
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
        ("false-alarm rate", f"{pct(_alpha(record))} per metric over the run"),
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


# ---- the figures ----------------------------------------------------------------------------

TimelineDraw = Callable[[TimelineRecord, Columns], "Figure"]
BAND_ALPHA = 0.22


def _figure(fid: str, title: str, caption: str, wide: bool = False) -> FigureInfo:
    return FigureInfo(fid, title, caption, wide, f"{FIGURES_DIR}/{fid}.svg")


def _has(columns: Columns, group: str, key: str) -> bool:
    values = columns[group].get(key)
    return values is not None and bool(np.isfinite(values).any())


MARKS = (
    "The grey band is the baseline window and the dashed grey line the baseline median; a solid line marks a "
    "change point (its interval shaded) and a dashed one of its colour the median from it to the alarm."
)


def timeline_figure_list(columns: Columns) -> list[tuple[FigureInfo, TimelineDraw]]:
    """The page's figures: K3, |Δp|, the multiplicative error, the sequence max mismatch, the
    importance-ratio tails and the corrections' shares, always; first vs later turns when the run
    has later turns; MoE routing when it was compared."""
    published = "; ".join(f"{f.precision} K3 {fmt_range(f.low, f.high)} ({f.source})" for f in PUBLISHED_K3)
    figures: list[tuple[FigureInfo, TimelineDraw]] = [
        (
            _figure(
                "k3_kl",
                "K3 KL by step",
                "Each step's K3 with its sequence-bootstrap interval (blue band), on a log axis. " + MARKS + " "
                f"Shaded in colour where they fall in view: the K3 published for quantized rollouts ({published}).",
                wide=True,
            ),
            k3_figure,
        ),
        (
            _figure(
                "prob_diff",
                "Token probability gap by step",
                "The largest |p_train − p_infer| of the step (red) and its mean over tokens (blue), with their "
                "intervals, on a log axis. " + MARKS,
            ),
            prob_diff_figure,
        ),
        (
            _figure(
                "mult_prob_error",
                "Multiplicative error by step",
                "mean exp(|δ|) of the step with its interval (NeMo-RL's token_mult_prob_error; 1 is perfect). " + MARKS,
            ),
            lambda record, columns: single_figure(record, columns, "mult_prob_error", log=False),
        ),
        (
            _figure(
                "seq_max_mismatch_mean",
                "Sequence max mismatch by step",
                "Per sequence the largest |Δp|, averaged over the step's sequences, with its interval. " + MARKS,
            ),
            lambda record, columns: single_figure(record, columns, "seq_max_mismatch_mean", log=True),
        ),
        (
            _figure(
                "ratio_tails",
                "Importance-ratio tails by step",
                "χ² of the token importance ratios as verl computes it (mean(ratio²) − 1: near 0 it can dip below "
                "0), their normalized effective sample size (1 is perfect), and the 99th percentile of |δ| (log "
                "axis). " + MARKS,
                wide=True,
            ),
            ratio_tails_figure,
        ),
        (
            _figure(
                "corrections",
                "What the corrections clip or drop, by step",
                "The share of tokens (token TIS, token mask) or sequences (sequence TIS, geometric rejection) each "
                "correction clips or drops at the timeline's thresholds. " + MARKS,
            ),
            corrections_figure,
        ),
    ]
    if _has(columns, "later", "k3_kl"):
        figures.append(
            (
                _figure(
                    "turns",
                    "K3 KL by step, first vs later turns",
                    "K3 of the first assistant turn and of the later turns (after tool output), with their intervals. "
                    "Later turns follow text the model did not write; published runs see them drift first.",
                ),
                turns_figure,
            )
        )
    if _has(columns, "all", "routing_flip_share"):
        figures.append(
            (
                _figure(
                    "routing_flip_share",
                    "MoE routing flips by step",
                    "The share of tokens for which some MoE layer picked another set of experts in the engine than "
                    "in the trainer. " + MARKS,
                ),
                lambda record, columns: single_figure(record, columns, "routing_flip_share", log=False),
            )
        )
    return figures


def _positive(values: np.ndarray) -> np.ndarray:
    """Values on a log axis: 0 and below at the floor (NaN stays a gap)."""
    return np.where(np.isnan(values), np.nan, np.maximum(values, FLOOR))


def _runs(x: np.ndarray, y: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """``y`` cut into at most ``bins`` runs of consecutive steps (a row each, NaN-padded), and the
    first and last step of each run, interleaved."""
    n = len(y)
    size = -(-n // bins)
    k = -(-n // size)
    block = np.full(k * size, np.nan)
    block[:n] = y
    starts = np.arange(k) * size
    return block.reshape(k, size), np.column_stack([x[starts], x[np.minimum(starts + size - 1, n - 1)]]).ravel()


def envelope(x: np.ndarray, y: np.ndarray, bins: int = ENVELOPE_BINS) -> tuple[np.ndarray, np.ndarray]:
    """A long series drawn as ``bins`` runs of steps, each as its smallest and largest value in the
    order they occur, so a figure's size stays bounded however many steps there are and no spike
    is smoothed away; a run with no value is a gap (NaN)."""
    if len(y) <= 2 * bins:
        return x, y
    block, xs = _runs(x, y, bins)
    lo, hi = np.fmin.reduce(block, axis=1), np.fmax.reduce(block, axis=1)  # NaN only where all are
    first = np.argmin(np.where(np.isnan(block), np.inf, block), axis=1) <= np.argmax(
        np.where(np.isnan(block), -np.inf, block), axis=1
    )
    return xs, np.column_stack([np.where(first, lo, hi), np.where(first, hi, lo)]).ravel()


def _line(ax: Axes, x: np.ndarray, y: np.ndarray, color: str, label: str, *, log: bool, lw: float = 1.2) -> bool:
    """A metric against the step; False (nothing drawn) when it has no value."""
    if not len(y) or not np.isfinite(y).any():
        return False
    xs, ys = envelope(x, _positive(y) if log else y, ENVELOPE_BINS)
    marker = "o" if len(x) <= MARKERS_UP_TO else None
    ax.plot(xs, ys, color=color, lw=lw, label=label, marker=marker, ms=2.5)
    return True


def _band(ax: Axes, x: np.ndarray, cols: dict[str, np.ndarray], key: str, color: str, *, log: bool) -> None:
    """A metric's per-step interval, shaded (over a run of steps: its lowest low to its highest high)."""
    low, high = cols.get(f"{key}_low"), cols.get(f"{key}_high")
    if low is None or high is None or not np.isfinite(low).any():
        return
    if log:
        low, high = _positive(low), _positive(high)
    if len(x) > 2 * ENVELOPE_BINS:
        lows, xs = _runs(x, low, ENVELOPE_BINS)
        highs, _ = _runs(x, high, ENVELOPE_BINS)
        x, low, high = (xs[0::2] + xs[1::2]) / 2, np.fmin.reduce(lows, axis=1), np.fmax.reduce(highs, axis=1)
    ax.fill_between(x, low, high, color=color, alpha=BAND_ALPHA, lw=0)


def _window(ax: Axes, record: TimelineRecord, metrics: tuple[str, ...]) -> None:
    """The baseline window of the first of ``metrics`` that was tested, shaded."""
    for metric in metrics:
        span = (record.drift.get(metric) or {}).get("baseline_steps")
        if span and not record.drift[metric].get("reason"):
            ax.axvspan(span[0], span[-1], color=GREY, alpha=0.18, lw=0, label="baseline window")
            return


def _number(value: Any) -> float | None:
    """A finite number of a drift result (which writes infinities as "inf"), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value):
        return float(value)
    return None


def _drift(ax: Axes, record: TimelineRecord, metric: str, last: float, color: str = RED, *, log: bool) -> None:
    """A metric's baseline median, and its change point (a line and its interval shaded) with the
    median from it to the alarm, when one was detected. A level a log axis cannot show is left out."""
    r = record.drift.get(metric) or {}
    if not r or r.get("reason"):
        return

    def level(value: Any) -> float | None:
        v = _number(value)
        return None if v is None or (log and v <= 0) else v

    if (baseline := level(r.get("baseline"))) is not None:
        ax.axhline(baseline, color="#5b6473", ls=(0, (4, 3)), lw=0.9)
    change = _number(r.get("change_step"))
    if not r.get("detected") or change is None:
        return
    lo, hi = (_number(v) for v in (r.get("interval") or (None, None))[:2])
    if lo is not None and hi is not None and hi > lo:
        ax.axvspan(lo, hi, color=color, alpha=0.12, lw=0)
    ax.axvline(change, color=color, lw=1.0, label=f"{metric_label(metric)}: change at step {int(change)}")
    if (after := level(r.get("after"))) is not None:
        end = _number(r.get("alarm_step"))
        ax.hlines(after, change, max(end if end is not None else last, change), color=color, ls=(0, (4, 3)), lw=0.9)


def _frame(ax: Axes, x: np.ndarray, ylabel: str, *, log: bool, drawn: bool) -> None:
    """The axes of a metric against the step: the steps' span, integer step ticks (a few: each tick
    is a costly artist), a log y axis for a metric that grows by factors."""
    from matplotlib.ticker import MaxNLocator

    if not drawn:
        ax.text(0.5, 0.5, "no steps", transform=ax.transAxes, ha="center", color="#888")
        ax.set_yticks([])
        return
    if log:
        ax.set_yscale("log")
    lo, hi = float(x[0]), float(x[-1])
    pad = max((hi - lo) * 0.01, 0.5)
    ax.set_xlim(lo - pad, hi + pad)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.set(xlabel="step", ylabel=ylabel)


def _legend_above(fig: Figure, ax: Axes, height: float) -> None:
    """The legend in a band above the axes (no search for a free corner, nothing drawn over the
    data), the figure's top margin grown to hold its rows."""
    handles, _ = ax.get_legend_handles_labels()
    if not handles:
        return
    ncols = min(len(handles), 3)
    rows = -(-len(handles) // ncols)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.01), ncols=ncols, fontsize=7.5, borderaxespad=0.2)
    fig.subplots_adjust(top=1 - (0.12 + 0.19 * rows) / height)


def _x(cols: dict[str, np.ndarray]) -> np.ndarray:
    return cols.get("step", np.zeros(0))


def _last(x: np.ndarray) -> float:
    return float(x[-1]) if len(x) else 0.0


HEIGHT = 3.9  # inches, legend band included
WIDE, NARROW = 11.0, 7.0


def k3_figure(record: TimelineRecord, columns: Columns) -> Figure:
    """K3 with its band and drift marks; the published K3 ranges (``PUBLISHED_K3``) that fall near
    the data, shaded (a band decades away would flatten the data)."""
    cols = columns["all"]
    x = _x(cols)
    fig, (ax,) = new_figure(WIDE, HEIGHT)
    _window(ax, record, ("k3_kl",))
    _band(ax, x, cols, "k3_kl", BLUE, log=True)
    drawn = _line(ax, x, cols.get("k3_kl", np.zeros(0)), BLUE, metric_label("k3_kl"), log=True)
    _drift(ax, record, "k3_kl", _last(x), log=True)
    if drawn:
        y = _positive(np.concatenate([cols[k] for k in ("k3_kl", "k3_kl_low", "k3_kl_high")]))
        y = y[np.isfinite(y)]  # (an infinite K3, a token the trainer gives probability 0, is not drawn)
        lo, hi = float(y.min()) / 1.5, float(y.max()) * 1.5
        for f, color in zip(PUBLISHED_K3, (RUN_COLORS[3], RUN_COLORS[4])):
            if f.high >= lo and f.low <= hi:
                source = f.source.split(",")[0].split(" (")[0]
                ax.axhspan(f.low, f.high, color=color, alpha=0.12, lw=0, label=f"published {f.precision} K3: {source}")
        for (where, low, high), color in zip(K3_BY_GPU, ("#cfe8cf", "#f3dfb8", "#f2c4c4")):
            if high >= lo and low <= hi:
                ax.axhspan(low, high, color=color, alpha=0.35, lw=0, label=f"published bf16 K3, {where}")
        ax.set_ylim(lo, hi)
    _frame(ax, x, "K3 KL", log=True, drawn=drawn)
    _legend_above(fig, ax, HEIGHT)
    return fig


def prob_diff_figure(record: TimelineRecord, columns: Columns) -> Figure:
    cols = columns["all"]
    x = _x(cols)
    fig, (ax,) = new_figure(NARROW, HEIGHT)
    _window(ax, record, ("prob_diff_max", "prob_diff_mean"))
    drawn = False
    for key, color in (("prob_diff_max", RED), ("prob_diff_mean", BLUE)):
        _band(ax, x, cols, key, color, log=True)
        drawn |= _line(ax, x, cols.get(key, np.zeros(0)), color, metric_label(key), log=True)
        _drift(ax, record, key, _last(x), color, log=True)
    if drawn:  # verl's FAQ reads the mean: below 0.005 expected, above 0.01 a precision issue
        ax.axhline(
            VERL_PROB_DIFF_EXPECTED,
            color=GREEN,
            lw=0.8,
            ls=":",
            label=f"verl: mean expected < {VERL_PROB_DIFF_EXPECTED:g}",
        )
        ax.axhline(
            VERL_PROB_DIFF_ISSUE,
            color=RED,
            lw=0.8,
            ls=":",
            label=f"verl: mean > {VERL_PROB_DIFF_ISSUE:g} a precision issue",
        )
    _frame(ax, x, "|p_train − p_infer|", log=True, drawn=drawn)
    _legend_above(fig, ax, HEIGHT)
    return fig


def single_figure(record: TimelineRecord, columns: Columns, key: str, *, log: bool) -> Figure:
    """One metric with its interval (when it has one) and its drift marks."""
    cols = columns["all"]
    x = _x(cols)
    fig, (ax,) = new_figure(NARROW, HEIGHT)
    _window(ax, record, (key,))
    _band(ax, x, cols, key, BLUE, log=log)
    drawn = _line(ax, x, cols.get(key, np.zeros(0)), BLUE, metric_label(key), log=log)
    _drift(ax, record, key, _last(x), log=log)
    if (
        key == "mult_prob_error"
        and drawn
        and np.nanmax(cols.get(key, np.zeros(1))) > 1 + (NEMO_RL_MULT_ERROR_THRESHOLD - 1) / 4
    ):
        # NeMo-RL's threshold, drawn when the data comes near it (else it would flatten the data)
        ax.axhline(
            NEMO_RL_MULT_ERROR_THRESHOLD,
            color=RED,
            lw=0.8,
            ls=":",
            label=f"NeMo-RL threshold {NEMO_RL_MULT_ERROR_THRESHOLD:g}",
        )
    _frame(ax, x, metric_label(key), log=log, drawn=drawn)
    if key in SHARES and drawn:
        _percent(ax)
    _legend_above(fig, ax, HEIGHT)
    return fig


def _percent(ax: Axes) -> None:
    from matplotlib.ticker import PercentFormatter

    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=None))


# χ² on a linear axis: verl's estimate dips below 0 when the true value is near 0 (metric_docs)
RATIO_TAILS = (("chi2_token", BLUE, False), ("ess", GREEN, False), ("abs_delta_p99", RED, True))


def ratio_tails_figure(record: TimelineRecord, columns: Columns) -> Figure:
    """χ² of the token ratios, their ESS and the p99 of |δ|, a panel each (named on its y axis; no legend)."""
    cols = columns["all"]
    x = _x(cols)
    fig, axes = new_figure(WIDE, 3.5, ncols=3, wspace=0.32)
    for ax, (key, color, log) in zip(axes, RATIO_TAILS, strict=True):
        _window(ax, record, (key,))
        drawn = _line(ax, x, cols.get(key, np.zeros(0)), color, metric_label(key), log=log)
        _drift(ax, record, key, _last(x), log=log)
        _frame(ax, x, metric_label(key), log=log, drawn=drawn)  # (a title would cost a layout pass)
    return fig


CORRECTION_LINES = ("token_tis_clipped_share", "token_mask_share", "seq_tis_clipped_share", "geo_rejected_share")


def corrections_figure(record: TimelineRecord, columns: Columns) -> Figure:
    cols = columns["all"]
    x = _x(cols)
    fig, (ax,) = new_figure(NARROW, HEIGHT)
    _window(ax, record, CORRECTION_LINES)
    drawn = False
    for key, color in zip(CORRECTION_LINES, (BLUE, RED, GREEN, RUN_COLORS[3])):
        drawn |= _line(ax, x, cols.get(key, np.zeros(0)), color, metric_label(key), log=False)
        _drift(ax, record, key, _last(x), color, log=False)
    _frame(ax, x, "share clipped or dropped", log=False, drawn=drawn)
    if drawn:
        _percent(ax)
    _legend_above(fig, ax, HEIGHT)
    return fig


def turns_figure(record: TimelineRecord, columns: Columns) -> Figure:
    """K3 of the first turn and of the later ones, each with its band."""
    fig, (ax,) = new_figure(NARROW, HEIGHT)
    _window(ax, record, ("k3_kl",))
    drawn = False
    for group, color, label in (("first", BLUE, "first turn"), ("later", RED, "later turns (after tool output)")):
        cols = columns[group]
        gx = _x(cols)
        _band(ax, gx, cols, "k3_kl", color, log=True)
        drawn |= _line(ax, gx, cols.get("k3_kl", np.zeros(0)), color, label, log=True)
    _frame(ax, _x(columns["all"]), "K3 KL", log=True, drawn=drawn)
    _legend_above(fig, ax, HEIGHT)
    return fig


def timeline_figures(record: TimelineRecord, columns: Columns) -> list[DrawnFigure]:
    """The page's figures, as SVG."""
    with style():
        return [
            DrawnFigure(info, to_svg(finish(draw(record, columns)))) for info, draw in timeline_figure_list(columns)
        ]


# ---- the pages ------------------------------------------------------------------------------


def render_markdown(view: TimelineView) -> str:
    """timeline.md."""
    out = [f"# {md_text(view.title)}", "", f"{md_text(view.subtitle)}. Status **{md_text(view.status)}**.", ""]
    out += [f"- **{md_text(line)}**" for line in view.headlines] + [""]
    out += [
        f"- **{md_text(c.label)}**: {md_text(c.value)}" + (f" ({md_text(c.note)})" if c.note else "")
        for c in view.cards
    ]
    out += [""]
    out += md_table(view.drift)
    out += ["## Figures", "", "The same figures, with captions, are in `timeline.html`.", ""]
    out += [f"![{md_text(f.title)}]({f.path})" for f in view.figures] + [""]
    out += md_table(view.steps) + md_table(view.kept)
    if view.notes:
        out += ["## Notes", ""] + [f"- {md_text(n)}" for n in view.notes] + [""]
    out += md_table(view.failed)
    out += ["## The timeline", "", "| | |", "|---|---|"] + [f"| {md_text(k)} | {md_text(v)} |" for k, v in view.setup]
    return "\n".join(out).rstrip("\n") + "\n"


def render_html(view: TimelineView, figures: list[DrawnFigure]) -> str:
    """timeline.html: self-contained like the run and sweep pages (figures as data URIs, no script)."""
    # html._page's annotation names the views written before this one; it reads a view's title and figures
    return html._page("timeline.html.j2", view, figures)  # type: ignore[arg-type]


def render_timeline(out: Path, record: TimelineRecord, table: pa.Table) -> list[str]:
    """``figures/*.svg``, ``timeline.md`` and ``timeline.html`` in the timeline directory ``out``;
    returns the figures' paths (relative to ``out``), for the record."""
    columns = step_columns(table)
    view = view_of(record, columns)
    figures = timeline_figures(record, columns)
    listed = write_figure_files(Path(out), figures)
    write_atomic(Path(out) / TIMELINE_MD, render_markdown(view))
    write_atomic(Path(out) / TIMELINE_HTML, render_html(view, figures))
    return [f["path"] for f in listed]


def render_again(out: str | Path) -> Path:
    """A timeline's page rendered again from its timeline.json and steps.parquet (``mismatch-probe
    report DIR``); returns timeline.html's path."""
    import pyarrow.parquet as pq

    from mismatch_probe.timeline_record import STEPS_PARQUET, read_timeline

    out = Path(out)
    record = read_timeline(out)
    record.figures = render_timeline(out, record, pq.read_table(out / STEPS_PARQUET))
    record.write(out)
    return out / TIMELINE_HTML


__all__ = [
    "TIMELINE_HTML",
    "TIMELINE_MD",
    "TimelineView",
    "headline_lines",
    "render_again",
    "render_html",
    "render_markdown",
    "render_timeline",
    "step_columns",
    "timeline_figure_list",
    "timeline_figures",
    "timeline_summary",
    "timeline_view",
]

"""The terminal renderings of the views (rich): a run's summary after ``compare`` and
``analyze``, a comparison of runs (a spec's ``[[variants]]``), a sweep's diagnosis. The same
tables as the pages, with the same columns, labels and cells, less the long explanations."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable

from mismatch_probe.report.comparison_view import ComparisonView
from mismatch_probe.report.labels import NOTE
from mismatch_probe.report.run_view import RunView
from mismatch_probe.report.sweep_view import SweepView
from mismatch_probe.report.view import Table

MARK_STYLES = {"best": "green", "worst": "red"}


def table(t: Table, title: str | None = None) -> RichTable:
    """``t`` as a rich table, without its "long" columns (meanings, explanations)."""
    shown = [i for i, c in enumerate(t.columns) if c.kind != "long"]
    out = RichTable(title=escape(t.title if title is None else title), title_justify="left")
    for i in shown:
        c = t.columns[i]
        out.add_column(escape(c.label), justify="right" if c.kind == "num" else "left")
    for row in t.rows:
        cells = []
        for i in shown:
            if row.note and i >= len(row.cells):
                cells.append(escape(row.note) if i == len(row.cells) else "")
                continue
            text = escape(row.cells[i])
            if i == 0 and row.key:
                text += f" [dim]{escape(row.key)}[/dim]"
            mark = row.marks[i] if i < len(row.marks) else ""
            cells.append(f"[{MARK_STYLES[mark]}]{text}[/]" if mark else text)
        out.add_row(*cells, style="dim" if row.muted else None)
    return out


def note(line: str) -> str:
    """A note as console markup: a warning's "note:" in yellow."""
    if line.startswith(NOTE):
        return f"[yellow]{NOTE.strip()}[/] {escape(line[len(NOTE) :])}"
    return escape(line)


def print_run(console: Console, view: RunView) -> None:
    """A run's summary: its metric and correction tables, the routing agreement, the weight sync's
    verdict and findings, notes, timings."""
    console.print(table(view.metrics, f"mismatch: {view.subtitle}"))
    console.print(table(view.corrections, "correction what-ifs (share of the data a trainer would clip or drop)"))
    if view.routing_lead:
        console.print(escape(f"MoE routing: {view.routing_lead}"))
    if view.sync is not None:
        console.print(escape(f"weight sync: {view.sync.verdict}"))
        for line in view.sync.findings:
            console.print(note(NOTE + line))
    for t in view.stack[:1]:  # the configuration's known risks (init); what was not mirrored is in the report
        for row in t.rows:
            if len(row.cells) == 3:
                console.print(note(NOTE + f"known risk of this configuration: {row.cells[0]}: {row.cells[1]}"))
    if view.precision_outcome:  # met, or not met and how many more samples
        console.print(escape(view.precision_outcome))
    for line in view.notes:
        console.print(note(line))
    for row in view.next_steps.rows:  # what to do next: the problems only; the report has every line
        if not row.muted:
            command = f": {row.cells[3]}" if row.cells[3] else ""
            console.print(note(NOTE + f"next ({row.cells[0]}): {row.cells[1]}; {row.cells[2]}{command}"))
    if view.timings.rows:
        console.print(
            "time: "
            + escape(", ".join(f"{stage} {s}s ({share})" for stage, s, share in (r.cells for r in view.timings.rows)))
        )


def print_comparison(console: Console, view: ComparisonView) -> None:
    """Runs side by side: which is which, then every metric with the best and worst marked."""
    console.print(table(view.runs, view.title))
    for line in view.warnings:
        console.print(note(NOTE + line))
    console.print(table(view.metrics))
    console.print(table(view.corrections))


def print_sweep(console: Console, view: SweepView) -> None:
    """A sweep's diagnosis in sentences."""
    for line in view.summary:
        console.print(escape(line))

"""Markdown renderings of the views: a run's ``report.md``, a sweep's ``sweep.md`` and a
timeline's ``timeline.md``.

They open anywhere (a terminal, an editor, a CI artifact viewer, GitHub). Every text goes through
the package's one Markdown escape (:func:`mismatch_probe.text.md_text`; a code span through
:func:`mismatch_probe.text.md_code`), since names and settings come from the user.
"""

from __future__ import annotations

from mismatch_probe.report.run_view import RunView
from mismatch_probe.report.sweep_view import SweepView
from mismatch_probe.report.sync_view import SyncView
from mismatch_probe.report.timeline_view import TimelineView
from mismatch_probe.report.view import FigureInfo, Pairs, Table
from mismatch_probe.text import md_code, md_text


def _cell(table: Table, i: int, text: str, key: str) -> str:
    kind = table.columns[i].kind
    if kind == "link":
        return f"[{table.columns[i].label}]({text})" if text else ""
    if kind == "code":
        return md_code(text, in_table=True) if text else ""
    out = md_text(text)
    return f"{out} {md_code(key, in_table=True)}" if i == 0 and key else out


def table(t: Table, heading: str = "##") -> list[str]:
    """A table under its title and lead; an empty one is left out."""
    if not t.rows:
        return []
    out = [f"{heading} {md_text(t.title)}", ""] + ([md_text(t.lead), ""] if t.lead else [])
    out += ["| " + " | ".join(md_text(c.label) for c in t.columns) + " |"]
    out += ["|" + "|".join("---:" if c.kind == "num" else "---" for c in t.columns) + "|"]
    for row in t.rows:
        cells = [_cell(t, i, text, row.key) for i, text in enumerate(row.cells)]
        if row.note:
            cells += [md_text(row.note)] + [""] * (len(t.columns) - len(cells) - 1)
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


def _pairs(rows: Pairs) -> list[str]:
    return ["| | |", "|---|---|"] + [f"| {md_text(k)} | {md_text(v)} |" for k, v in rows] + [""]


def render_run(view: RunView) -> str:
    """A run's report.md."""
    out = [f"# {md_text(view.title)}", "", f"{md_text(view.subtitle)}. Status **{md_text(view.status)}**.", ""]
    out += ["## At a glance", ""] + [
        f"- **{md_text(c.label)}**: {md_text(c.value)} ({md_text(c.note)})" for c in view.headline
    ]
    out += [""] + [f"- {md_text(line)}" for line in view.notes] + ([""] if view.notes else [])
    if view.precision is not None:
        out += table(view.precision)
    out += table(view.next_steps)
    out += ["## Environment and settings", ""] + _pairs(view.setup)
    for t in view.stack:
        out += table(t)
    out += table(view.metrics)
    if view.dashboard is not None:
        out += table(view.dashboard)
    out += table(view.corrections)
    for t in view.breakdowns:
        out += table(t)
    for t in view.routing:
        out += table(t)
    if view.sync is not None:
        out += sync(view.sync)
    out += [
        "## Figures",
        "",
        "The same figures, with captions and the worst sequences token by token, are in `report.html`.",
        "",
    ]
    out += _figures(view.figures)
    out += table(view.worst)
    out += ["## The run", ""] + _pairs(view.run) + table(view.timings, "###")
    return "\n".join(out).rstrip("\n") + "\n"


def _figures(figures: list[FigureInfo]) -> list[str]:
    """Each figure as an image of its file beside the page (figures/<id>.svg)."""
    return [f"![{md_text(f.title)}]({f.path})" for f in figures] + [""]


def sync(view: SyncView) -> list[str]:
    """The weight-sync probe's section: the verdict (and each finding), what was synced, its tables."""
    out = ["## Weight sync", "", f"**{md_text(view.verdict)}**", ""]
    out += [f"- {md_text(line)}" for line in view.findings] + ([""] if view.findings else [])
    out += _pairs(view.setup)
    out += table(view.repeats, "###") + table(view.stale_cache, "###") + table(view.vs_fresh, "###")
    if view.engine_report:
        out += ["### The engine's report of the last sync", ""] + _pairs(view.engine_report)
    return out + table(view.timings, "###")


def render_sweep(view: SweepView) -> str:
    """A sweep's sweep.md."""
    out = (
        [f"# {md_text(view.title)}", ""]
        + [f"- {md_text(s)}" for s in view.summary]
        + ["", md_text(view.subtitle) + ".", ""]
    )
    out += [f"- **{md_text(c.label)}**: {md_text(c.value)} {md_text(c.note)}" for c in view.baseline] + [""]
    out += table(view.attribution)
    out += (
        table(view.corrections)
        if view.corrections.rows
        else [f"## {md_text(view.corrections.title)}", "", md_text(view.corrections.lead), ""]
    )
    out += table(view.noise) + table(view.determinism)
    out += [f"Note: {md_text(n)}" for n in view.determinism_notes] + ([""] if view.determinism_notes else [])
    out += table(view.points)
    return "\n".join(out).rstrip("\n") + "\n"


def render_timeline(view: TimelineView) -> str:
    """A timeline's timeline.md."""
    out = [f"# {md_text(view.title)}", "", f"{md_text(view.subtitle)}. Status **{md_text(view.status)}**.", ""]
    out += [f"- **{md_text(line)}**" for line in view.headlines] + [""]
    out += [
        f"- **{md_text(c.label)}**: {md_text(c.value)}" + (f" ({md_text(c.note)})" if c.note else "")
        for c in view.cards
    ]
    out += [""]
    out += table(view.drift)
    out += ["## Figures", "", "The same figures, with captions, are in `timeline.html`.", ""]
    out += _figures(view.figures)
    out += table(view.steps) + table(view.kept)
    if view.notes:
        out += ["## Notes", ""] + [f"- {md_text(n)}" for n in view.notes] + [""]
    out += table(view.failed)
    out += ["## The timeline", ""] + _pairs(view.setup)
    return "\n".join(out).rstrip("\n") + "\n"

"""Renderings of a gate result: a rich table for the terminal, JUnit XML for CI systems (one
testcase per check), and Markdown for a CI job summary. Rendering only; :mod:`.gate` evaluates."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Literal

from mismatch_probe.gate.checks import GateResult, significant
from mismatch_probe.text import md_code, md_text

STATUS_STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red", "ERROR": "bold magenta"}
STATUS_ICON = {"PASS": "✅", "WARN": "⚠️", "FAIL": "❌", "ERROR": "⛔"}


def rich_table(result: GateResult):
    from rich.markup import escape
    from rich.table import Table

    counts = result.counts()
    table = Table(
        title=f"gate {result.status}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n), title_justify="left"
    )
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("status", "left"),
        ("check", "left"),
        ("value", "right"),
        ("bound", "left"),
        ("detail", "left"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for r in result.results:
        table.add_row(
            f"[{STATUS_STYLE[r.status]}]{r.status}[/]",
            escape(r.name),
            significant(r.value),
            escape(r.bound + (" (warn)" if r.severity == "warn" else "")),
            escape(r.message),
        )
    return table


def per_check_table(result: GateResult):
    """A timeline's gate (one result per check and step) as one row per check: its worst status,
    how many steps did not pass and which came first, and the worst value against its bound."""
    from rich.markup import escape
    from rich.table import Table

    from mismatch_probe.gate.checks import STATUS_ORDER

    by_check: dict[str, list] = {}
    for r in result.results:
        by_check.setdefault(r.name.split(" @ step ")[0], []).append(r)
    table = Table(title=f"gate {result.status}", title_justify="left")
    for col in ("status", "check", "steps not passing", "first", "worst value", "bound"):
        table.add_column(col, justify="right" if col in ("steps not passing", "first", "worst value") else "left")
    for name, rows in by_check.items():
        status = max((r.status for r in rows), key=STATUS_ORDER.index)
        bad = [r for r in rows if r.status != "PASS"]
        first = bad[0].name.rpartition(" @ step ")[2] if bad else ""
        values = [r.value for r in rows if r.value is not None]
        worst = max(values, key=abs) if values else None
        table.add_row(
            f"[{STATUS_STYLE[status]}]{status}[/]",
            escape(name),
            f"{len(bad)} of {len(rows)}",
            escape(first),
            significant(worst),
            escape(rows[0].bound if status != "ERROR" else rows[0].message),
        )
    return table


def junit_xml(result: GateResult) -> str:
    """JUnit XML: a testsuite of one testcase per check. FAIL is a <failure>, ERROR an <error>;
    WARN passes and says so in <system-out> (JUnit has no warning state)."""
    counts = result.counts()
    suites = ET.Element(
        "testsuites",
        name="mismatch-probe gate",
        tests=str(len(result.results)),
        failures=str(counts["FAIL"]),
        errors=str(counts["ERROR"]),
    )
    suite = ET.SubElement(
        suites,
        "testsuite",
        name="mismatch-probe gate",
        tests=str(len(result.results)),
        failures=str(counts["FAIL"]),
        errors=str(counts["ERROR"]),
        skipped="0",
    )
    props = ET.SubElement(suite, "properties")
    for name, value in (("run", result.run), ("thresholds", result.thresholds), ("baseline", result.baseline or "")):
        ET.SubElement(props, "property", name=name, value=value)
    for r in result.results:
        case = ET.SubElement(suite, "testcase", name=r.name, classname="mismatch_probe.gate.checks")
        detail = f"{r.metric}: {r.message} (bound {r.bound})" + (f"\n{r.description}" if r.description else "")
        if r.status == "FAIL":
            ET.SubElement(case, "failure", message=r.message, type="threshold").text = detail
        elif r.status == "ERROR":
            ET.SubElement(case, "error", message=r.message, type="configuration").text = detail
        out = ET.SubElement(case, "system-out")
        out.text = f"{r.status}: " + detail + (f"\nsource: {r.source}" if r.source else "")
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def markdown(result: GateResult) -> str:
    counts = result.counts()
    lines = [
        f"## {STATUS_ICON[result.status]} mismatch-probe gate: {result.status}",
        "",
        f"Run {md_code(result.run, in_table=False)} against {md_code(result.thresholds, in_table=False)}"
        + (f", baseline {md_code(result.baseline, in_table=False)}" if result.baseline else "")
        + ": "
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        + ".",
        "",
        "| status | check | value | bound | why |",
        "|---|---|---|---|---|",
    ]
    for r in result.results:
        lines.append(
            f"| {STATUS_ICON[r.status]} {r.status} | {md_text(r.name)} | {significant(r.value)} | "
            f"{md_text(r.bound)}{' (warn)' if r.severity == 'warn' else ''} | {md_text(r.message)} |"
        )
    described = [r for r in result.results if r.description or r.source]
    if described:
        lines += ["", "<details><summary>What the checks mean</summary>", ""]
        lines += [
            f"- **{md_text(r.name)}**: {md_text(r.description)}"
            + (f" (source: {md_text(r.source)})" if r.source else "")
            for r in described
        ]
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"

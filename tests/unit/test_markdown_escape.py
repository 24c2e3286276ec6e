"""The one Markdown escape (mismatch_probe/text.py): outside text read back by a CommonMark parser
with GitHub's tables (markdown-it, which rich brings) is the same text, in a table cell, a list
item and a code span, and never markup; every Markdown page the package writes uses it."""

from __future__ import annotations

import html

import pytest
from markdown_it import MarkdownIt

from mismatch_probe.gate.checks import CheckResult, GateResult
from mismatch_probe.gate.junit import markdown as gate_markdown
from mismatch_probe.text import md_code, md_text

HOSTILE = ["a|b", "x\\|y", "trailing \\", "<script>alert(1)</script>", "&amp; &lt;", "<b>bold</b> | <i>", "C:\\dir\\"]
PARSER = MarkdownIt("commonmark").enable("table")


def cell(source: str) -> str:
    rendered = PARSER.render(f"| x | y |\n|---|---|\n| {source} | z |\n")
    return rendered.split("<td>")[1].split("</td>")[0]


@pytest.mark.parametrize("text", HOSTILE)
def test_outside_text_reads_back_as_itself_in_a_cell_and_a_list_item(text):
    assert cell(md_text(text)) == html.escape(text, quote=False)
    assert PARSER.render(f"- {md_text(text)}\n") == f"<ul>\n<li>{html.escape(text, quote=False)}</li>\n</ul>\n"


def test_a_newline_cannot_end_the_row_or_the_item():
    assert md_text("a\nb\r\nc") == "a b  c"
    assert cell(md_text("a\n| b")) == "a | b"


@pytest.mark.parametrize("text", ["plain", "a|b", "`tick`", "two `` ticks", "<i>&amp;"])
def test_a_code_span_holds_its_text_literally_in_a_table_and_outside(text):
    code = f"<code>{html.escape(text, quote=False)}</code>"
    assert cell(md_code(text, in_table=True)) == code
    assert PARSER.render(f"Run {md_code(text, in_table=False)}\n") == f"<p>Run {code}</p>\n"


def test_the_gates_job_summary_escapes_as_the_reports_do():
    check = CheckResult(
        name="<rel> | x", status="FAIL", value=1.0, bound="<= 1e-3", message="a\nb", severity="fail", metric="k3_kl"
    )
    text = gate_markdown(GateResult(run="runs/a|b", thresholds="t.toml", baseline=None, results=[check]))
    assert f"| {md_text('<rel> | x')} |" in text and f"| {md_text('a b')} |" in text
    assert "Run `runs/a|b` against `t.toml`" in text  # a code span outside the table: literal

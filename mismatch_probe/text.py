"""How text from outside (a model's name, a setting, a prompt, a check's name in a thresholds file)
is written into Markdown, in one place: every Markdown page the package writes (a run's
``report.md``, ``sweep.md``, ``timeline.md``, the gate's job summary) goes through :func:`md_text`,
and a code span through :func:`md_code`.

The rule is the one every context on those pages needs, so a renderer never picks: a table cell
ends at a pipe and its row at a newline; a list item or a heading ends at a newline too; GitHub and
CI summaries render raw HTML and character references, so a ``<`` or an ``&`` would make markup of
a name. Backslash escapes (CommonMark: any ASCII punctuation) keep the text readable where the
Markdown is read as it is (a terminal, an editor). Left alone: ``>`` (without a ``<`` it starts
no tag, and it opens a quote only at a line's start, where no outside text is put), and backticks,
``*`` and ``_`` (the package's own sentences, which go through the same escape, mark names as code
with backticks; an underscore inside a name emphasises nothing).
"""

from __future__ import annotations

import re

_MARKDOWN_SPECIAL = str.maketrans({"\\": "\\\\", "|": "\\|", "<": "\\<", "&": "\\&", "\r": " ", "\n": " "})


def md_text(value: object) -> str:
    """``value`` as literal text for a Markdown table cell, list item, heading or link text: one
    line, backslashes, pipes, ``<`` and ``&`` escaped."""
    return str(value).translate(_MARKDOWN_SPECIAL)


def md_code(value: object, *, in_table: bool) -> str:
    """``value`` as a Markdown code span: one line, fenced by more backticks than it holds in a
    row. Nothing is escaped inside a code span but, in a table cell, the pipe (GitHub's tables
    split a row at every unescaped pipe, code spans included)."""
    text = str(value).replace("\r", " ").replace("\n", " ")
    if in_table:
        text = text.replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"

"""The documentation's text as the docs tests read it: its pages, their fenced code blocks (with the
marker before each) and every ``mismatch-probe`` command line in them.

Markers, an HTML comment on the line before a fence (invisible on GitHub and in the site):

- ``<!-- docs:run -->`` before a ``bash`` block: the block runs on CPU, in a scratch copy of the
  checkout's fixtures, probes and committed runs (tests/docs/test_blocks.py), and must exit 0;
- ``<!-- docs:no-run: REASON -->`` before a ``python`` block: it is not run, for REASON (code that
  goes inside a framework's trainer); it is still compiled, and what it uses of ``mismatch_probe``
  must exist. Every other ``python`` block runs.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*docs:(run|no-run)(?::\s*(.*?))?\s*-->\s*$")


def pages() -> list[Path]:
    """Every Markdown text a user reads: README.md, ARCHITECTURE.md and the site's pages."""
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # "run", "no-run" or None
    reason: str  # of a no-run marker

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    out, lines = [], page.read_text().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : j])
        before = lines[i - 1] if i > 0 else ""
        marker = MARKER.match(before)
        out.append(
            Block(
                page, i + 1, lang.lower(), body, marker.group(1) if marker else None, (marker and marker.group(2)) or ""
            )
        )
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


@dataclass(frozen=True)
class Command:
    where: str
    text: str
    subcommand: str
    words: list[str]  # after the subcommand


INLINE = re.compile(r"`(mismatch-probe [^`]+)`")
SHELL_LANGS = ("bash", "sh", "shell", "console", "text", "")


def _command_lines(code: str) -> list[str]:
    """The shell lines of a block, continuations joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.split("\n"):
        line = line.strip().removeprefix("$ ")
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in prose: split on blanks
        return text.split()


def commands() -> list[Command]:
    """Every ``mismatch-probe SUBCOMMAND ...`` the docs show, in a shell block, in inline code or in the
    example CI workflows (examples/ci)."""
    found: list[Command] = []

    def add(where: str, text: str) -> None:
        for piece in re.split(r"&&|\|\||;|\|", text):
            words = _split(piece)
            while words and words[0] != "mismatch-probe" and not words[0].endswith("/mismatch-probe"):
                words = words[1:]
            if len(words) < 2:
                continue
            rest = words[2:]
            if "--" in rest:  # what follows a bare -- is the command's arguments, not its options
                rest = rest[: rest.index("--")]
            found.append(Command(where, piece.strip(), words[1], rest))

    for workflow in sorted((ROOT / "examples" / "ci").glob("*.yml")):  # shown on the gate page
        for line in _command_lines(workflow.read_text()):
            if "mismatch-probe" in line:
                add(str(workflow.relative_to(ROOT)), line)
    for page in pages():
        fenced = set()
        for b in blocks(page):
            fenced.update(range(b.line, b.line + b.code.count("\n") + 2))
            if b.lang in SHELL_LANGS:
                for line in _command_lines(b.code):
                    if "mismatch-probe" in line:
                        add(f"{b.where}", line)
        for n, line in enumerate(page.read_text().split("\n"), 1):
            if n in fenced:
                continue
            for m in INLINE.finditer(line):
                add(f"{page.relative_to(ROOT)}:{n}", m.group(1))
    return found


def cli_options() -> dict[str, set[str]]:
    """Each command of the CLI -> every option it takes (both names of a --x/--no-x pair, and --help)."""
    import typer.main

    from mismatch_probe.cli import app

    group = typer.main.get_command(app)
    return {
        name: {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}
        for name, command in group.commands.items()
    }

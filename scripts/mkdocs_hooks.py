"""mkdocs hooks (mkdocs.yml ``hooks``): links from a page to a file of the repository outside ``docs/``.

The pages are written to read on GitHub too, so a page links to ``../../probes/demo.toml`` or
``../reports/example/report.html`` the way GitHub resolves it. mkdocs does not publish those files,
and would report every such link as missing (or, without ``--strict``, leave it broken in the site).
This hook checks each one against the checkout: a link to a file that does not exist is a warning,
which ``mkdocs build --strict`` turns into a failed build. A link that resolves is pointed at
``extra.source_url`` (a repository browser's URL of the tree, e.g. ``https://github.com/o/r/blob/main``)
when the site sets one, and is otherwise written as the path it names, in code.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path, PurePosixPath

log = logging.getLogger("mkdocs.hooks.repo_links")

# [text](target) and ![alt](target), target without a scheme; code spans and fenced blocks are skipped
LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(\s*)(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _outside_links(line: str):
    spans = [m.span() for m in CODE_SPAN.finditer(line)]
    for m in LINK.finditer(line):
        if any(a <= m.start() < b for a, b in spans):
            continue
        target = m.group(3)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            continue
        yield m


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces as -)."""
    anchors, fenced = set(), False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-"))
    return anchors


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    repo = docs_dir.parent
    page_dir = (docs_dir / page.file.src_uri).parent
    source_url = (config.get("extra") or {}).get("source_url")
    out, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        if fenced:
            out.append(line)
            continue
        for m in reversed(list(_outside_links(line))):
            bang, text, target = m.groups()
            path_part, _, anchor = target.partition("#")
            resolved = (page_dir / path_part).resolve()
            if resolved.is_relative_to(docs_dir):
                continue  # a page or a file mkdocs publishes: mkdocs' own validation checks it
            if not resolved.is_relative_to(repo) or not resolved.exists():
                log.warning("%s links to %s, which is not a file of the repository", page.file.src_uri, target)
                continue
            if anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved.read_text()):
                log.warning("%s links to %s, whose heading #%s does not exist", page.file.src_uri, target, anchor)
                continue
            rel = PurePosixPath(resolved.relative_to(repo).as_posix())
            if bang:  # an image must be published to show: keep images under docs/
                log.warning("%s shows %s from outside docs/: move the image under docs/", page.file.src_uri, target)
                continue
            if source_url:
                link = f"[{text}]({source_url.rstrip('/')}/{rel}{'#' + anchor if anchor else ''})"
            else:
                link = text if f"{rel}" in text else f"{text} (`{rel}`)"
            line = line[: m.start()] + link + line[m.end() :]
        out.append(line)
    return "\n".join(out)

"""Reading a rendered report page in tests: the text and the tables of one of its sections."""

from __future__ import annotations

from html.parser import HTMLParser


class SectionTables(HTMLParser):
    """The text and the tables (rows of cell texts, a cell's parts joined by a space) of one
    <section id=...> of a page."""

    def __init__(self, section: str):
        super().__init__()
        self.section, self.inside, self.depth = section, False, 0
        self.tables: list[list[list[str]]] = []
        self.text: list[str] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "section":
            self.depth += 1
            if dict(attrs).get("id") == self.section:
                self.inside, self.depth = True, 1
        if not self.inside:
            return
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag):
        if tag == "section" and self.inside:
            self.depth -= 1
            self.inside = self.depth > 0
        if self.inside and tag in ("td", "th") and self.cell is not None:
            self.tables[-1][-1].append(" ".join(part.strip() for part in self.cell if part.strip()))
            self.cell = None

    def handle_data(self, data):
        if self.inside:
            self.text.append(data)
        if self.cell is not None:
            self.cell.append(data)

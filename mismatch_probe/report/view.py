"""The one vocabulary every page of the reports is built of: tables (:class:`Table` of
:class:`Column` and :class:`Row`), headline cards (:class:`Card`), name-value pairs, the figures a
page shows (:class:`FigureInfo`) and a worst sequence's tokens (:class:`Span`), with every cell
already written as text. A page's view (:class:`View`: a run's, a comparison's, a sweep's, a
timeline's) is made of these alone, so :mod:`.html`, :mod:`.markdown` and :mod:`.terminal` render
any page with the same few pieces and cannot disagree; ``mismatch-probe report DIR --json`` prints
a view.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

ColumnKind = Literal["text", "num", "long", "link", "code"]


@dataclass
class Column:
    label: str
    # "num" right-aligned; "long" an explanation (the terminal leaves it out); "link" a relative
    # path shown as a link named after the column; "code" a name as written in a file (a setting)
    kind: ColumnKind = "num"
    color: str = ""  # a run's colour on the comparison page


@dataclass
class Row:
    cells: list[str]
    key: str = ""  # the run.json key the row shows, after its first cell
    marks: list[str] = field(default_factory=list)  # per cell: "best", "worst" or ""
    muted: bool = False  # within noise (a sweep's point)
    note: str = ""  # in place of the cells after the first ones: why there are no numbers


@dataclass
class Table:
    id: str
    title: str
    columns: list[Column]
    rows: list[Row]
    lead: str = ""
    groups: list[tuple[str, int]] = field(default_factory=list)  # headers over the value columns


@dataclass
class Card:
    label: str
    value: str
    note: str = ""


@dataclass
class Span:
    """One token of a worst sequence: its text, colour class and hover text; or a gap of tokens
    left out."""

    text: str = ""
    cls: str = ""
    title: str = ""
    gap: int = 0


@dataclass(frozen=True)
class FigureInfo:
    """A figure as a page lists it; the drawing is :mod:`.figures`'."""

    id: str
    title: str
    caption: str
    wide: bool = False  # spans the page's width
    path: str = ""  # the file beside the page's Markdown (figures/<id>.svg), where there is one


Pairs = list[tuple[str, str]]  # name-value rows (a page's settings)


def pairs(rows: list[tuple[str, Any]]) -> Pairs:
    """Name-value rows with every value written as text."""
    return [(name, str(value)) for name, value in rows]


@dataclass
class View:
    """A page's view: plain data, serializable as JSON (``report --json``). Each page's view is a
    dataclass deriving from this one, its fields in the page's order."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"


class Page(Protocol):
    """What a page's frame reads of any view: its title and the figures it shows."""

    @property
    def title(self) -> str: ...

    @property
    def figures(self) -> list[FigureInfo]: ...

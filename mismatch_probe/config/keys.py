"""Names a user typed: did-you-mean for unknown keys and values, and the line of a key in a TOML file.

The one place that suggests a close name (spec keys, thresholds keys, metric names, engine names,
engine arguments all use :func:`did_you_mean`), so every "unknown ..." message reads the same.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

from mismatch_probe.errors import ConfigError

# difflib's own default; metric paths and engine names pass their own
DEFAULT_CUTOFF = 0.6


def closest(word: str, options: Iterable[str], *, cutoff: float = DEFAULT_CUTOFF) -> str | None:
    """The option closest to ``word`` (difflib's ratio at least ``cutoff``), or None."""
    found = difflib.get_close_matches(word, sorted(options), n=1, cutoff=cutoff)
    return found[0] if found else None


def did_you_mean(
    word: str, options: Iterable[str], *, otherwise: str | None = None, cutoff: float = DEFAULT_CUTOFF
) -> str:
    """A hint: ``did you mean 'x'?`` for a close option, else ``otherwise`` (default: the options)."""
    options = sorted(options)
    close = closest(word, options, cutoff=cutoff)
    if close is not None:
        return f"did you mean {close!r}?"
    return otherwise if otherwise is not None else f"known keys: {', '.join(options)}"


def unknown_key(key: str, known: Iterable[str], where: str) -> ConfigError:
    """``<where>: unknown key 'x' (did you mean 'y'?)``."""
    return ConfigError(f"{where}: unknown key {key!r}", hint=did_you_mean(key, known))


# ---- where a key is in a TOML file ---------------------------------------------------------

_PART = r"(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')"
_DOTTED = rf"{_PART}(?:\s*\.\s*{_PART})*"
_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_DOTTED})\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(rf"^\s*({_DOTTED})\s*=")


def _parts(dotted: str) -> tuple[str, ...]:
    return tuple(a or b or c for a, b, c in re.findall(r"\"([^\"]*)\"|'([^']*)'|([A-Za-z0-9_-]+)", dotted))


class KeyLines:
    """Line numbers (1-based) of the tables and keys of a TOML text, by their path as a parser
    (or pydantic's error ``loc``) names them: ``("engine", "dtype")``, ``("checks", 1, "op")``,
    ``("variants", 0, "reference", "tensor_parallel_size")`` for either ``[variants.reference]``
    or a dotted ``reference.tensor_parallel_size = 2``. A line scanner, not a parser: a key inside
    a multi-line string can be mistaken for one, which costs a line number, never a wrong error."""

    def __init__(self, text: str) -> None:
        self.lines: dict[tuple[str | int, ...], int] = {}
        self._arrays: dict[tuple[str | int, ...], int] = {}  # array-of-tables path -> last index
        table: tuple[str | int, ...] = ()
        for n, line in enumerate(text.splitlines(), 1):
            if m := _HEADER.match(line):
                parts = _parts(m[2])
                if m[1] == "[[":
                    array = self._resolve(parts[:-1]) + (parts[-1],)
                    self._arrays[array] = self._arrays.get(array, -1) + 1
                    table = (*array, self._arrays[array])
                else:
                    table = self._resolve(parts)
                self._add(table, n)
            elif m := _KEY.match(line):
                self._add(table + _parts(m[1]), n)

    def _resolve(self, parts: Sequence[str]) -> tuple[str | int, ...]:
        """``[variants.reference]`` belongs to the last ``[[variants]]`` so far."""
        out: tuple[str | int, ...] = ()
        for p in parts:
            out += (p,)
            if out in self._arrays:
                out += (self._arrays[out],)
        return out

    def _add(self, path: tuple[str | int, ...], n: int) -> None:
        for i in range(1, len(path) + 1):  # a dotted key also places its tables
            self.lines.setdefault(path[:i], n)

    def line(self, loc: Sequence[str | int]) -> int | None:
        """The line of ``loc``, else of the nearest enclosing table or key that is in the text."""
        path = tuple(loc)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None

    def headers(self, array: str) -> list[int]:
        """The lines of the ``[[array]]`` headers, in order."""
        return [self.lines[(array, i)] for i in range(self._arrays.get((array,), -1) + 1)]

"""A small SVG chart layer for a run report's figures.

The report draws seven fixed kinds of chart from stored histograms and a few hundred points, so it
needs axes on linear, log and symmetric-log scales, ticks, lines, points, filled histograms, bands,
density images and a legend, and nothing else. Written as SVG text (the density images as small
embedded PNGs), a figure costs milliseconds, where matplotlib's import and text layout cost about
a second for a report (``benchmarks/bench_report.py --profile``), and it stays sharp at any zoom.
Rendering only: nothing here computes a number the report states.
"""

from __future__ import annotations

import base64
import math
import struct
import zlib
from dataclasses import dataclass, field
from html import escape

import numpy as np

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
AXIS_COLOR, GRID_COLOR, TEXT_COLOR = "#444", "#e6e6e6", "#222"
# matplotlib's viridis, 64 steps (interpolated between them)
_VIRIDIS = bytes.fromhex(
    "44015446075a470d6047136548186a481d6f482374482878472d7b46327e453781443b844240864045883e49893d4e8a"
    "3a538b38588c365c8d34608d32648e31688e2f6c8e2d708e2c738e2a778e297b8e277f8e26828e24868e238a8d218e8d"
    "20928c1f968b1f9a8a1f9e891fa18721a58523a98326ad812ab07f2fb47c35b7793bbb7542be714ac16d52c5695ac864"
    "65cb5e6ece5877d15381d34d8bd64695d840a0da39aadc32b5de2bc0df25cae11fd5e21adfe318eae51af4e61efde725"
)
VIRIDIS = np.frombuffer(_VIRIDIS, dtype=np.uint8).reshape(-1, 3).astype(np.float64)


def _num(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".")


def label(v: float) -> str:
    """A tick label: plain, short ("0.001", "1e-05", "20")."""
    return "0" if v == 0 else f"{v:g}"


# ---- scales -----------------------------------------------------------------------------------


@dataclass
class Scale:
    """Data to [0, 1] along an axis: ``linear``, ``log`` (base 10) or ``symlog`` (linear within
    ``linthresh`` of 0, logarithmic outside, as matplotlib's symlog with base 10)."""

    kind: str
    lo: float
    hi: float
    linthresh: float = 1.0
    linscale: float = 1.0

    def _t(self, v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.kind == "log":
                return np.log10(v)
            if self.kind == "symlog":
                lin = self.linscale / (1.0 - 1.0 / 10.0)
                a = np.abs(v)
                out = np.where(
                    a <= self.linthresh,
                    v * lin / self.linthresh,
                    np.sign(v) * (lin + np.log10(np.maximum(a, self.linthresh) / self.linthresh)),
                )
                return out
            return v

    def __call__(self, v) -> np.ndarray:
        lo, hi = self._t(np.array([self.lo, self.hi]))
        return (self._t(v) - lo) / (hi - lo)

    def ticks(self, target: int = 6) -> list[float]:
        lo, hi = self.lo, self.hi
        if self.kind == "log":
            first, last = math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9)
            decades = list(range(first, last + 1))
            if len(decades) < 3:  # a narrow range: 1, 2 and 5 of each decade
                ticks = [m * 10.0**k for k in range(first - 1, last + 1) for m in (1, 2, 5)]
                return [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]
            stride = max(1, math.ceil(len(decades) / 9))
            return [10.0**k for k in decades[::stride]]
        span = hi - lo
        if span <= 0:
            return [lo]
        raw = span / target
        step = 10 ** math.floor(math.log10(raw))
        step *= next(m for m in (1, 2, 2.5, 5, 10) if step * m >= raw)
        start = math.ceil(lo / step - 1e-9)
        decimals = max(0, 1 - math.floor(math.log10(step)))  # one more than the step's: 2.5 x 10^k
        return [round(i * step, decimals) for i in range(start, math.floor(hi / step + 1e-9) + 1)]


# ---- the figure -------------------------------------------------------------------------------


@dataclass
class Figure:
    """A figure of ``width`` x ``height`` pixels; :meth:`axes` adds a panel, :meth:`svg` writes it."""

    width: int
    height: int
    parts: list[str] = field(default_factory=list)
    _clips: int = 0

    def axes(self, left: float, top: float, width: float, height: float, x: Scale, y: Scale) -> Axes:
        self._clips += 1
        clip = f"c{self._clips}"
        self.parts.append(
            f'<clipPath id="{clip}"><rect x="{_num(left)}" y="{_num(top)}" width="{_num(width)}" '
            f'height="{_num(height)}"/></clipPath>'
        )
        return Axes(self, left, top, width, height, x, y, clip, start=len(self.parts))

    def text(self, x: float, y: float, s: str, size: float = 11, anchor: str = "middle", **kw) -> None:
        self.parts.append(_text(x, y, s, size, anchor, **kw))

    def colorbar(self, left: float, top: float, width: float, height: float, vmax: float, caption: str) -> None:
        """A vertical log color scale from 1 to ``vmax`` (what :func:`density_rgba` maps)."""
        steps = np.linspace(1.0, 0.0, 128)[:, None]
        rgba = np.concatenate([_viridis(steps), np.full((128, 1, 1), 255, np.uint8)], axis=-1)
        self.parts.append(_image(rgba, left, top, width, height))
        self.parts.append(
            f'<rect x="{_num(left)}" y="{_num(top)}" width="{_num(width)}" height="{_num(height)}" '
            f'fill="none" stroke="{AXIS_COLOR}" stroke-width="0.8"/>'
        )
        scale = Scale("log", 1.0, max(vmax, 10.0))
        for t in scale.ticks():
            y = top + height * (1 - float(scale(t)))
            self.parts.append(_line([left + width, left + width + 4], [y, y], AXIS_COLOR, 0.8))
            self.text(left + width + 6, y + 4, label(t), 10, "start")
        self.text(left + width + 50, top + height / 2, caption, 11, "middle", rotate=True)

    def svg(self) -> bytes:
        body = "".join(self.parts)
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
            f'viewBox="0 0 {self.width} {self.height}" font-family="{FONT}">'
            f'<rect width="100%" height="100%" fill="white"/>{body}</svg>'
        ).encode()


@dataclass
class Axes:
    """One panel: a box in pixels and a scale on each axis. Drawing methods take data coordinates."""

    fig: Figure
    left: float
    top: float
    width: float
    height: float
    x: Scale
    y: Scale
    clip: str
    start: int = 0  # where the panel's elements begin in the figure: its grid goes there, under the data
    legend_items: list[tuple[str, str, str]] = field(default_factory=list)  # (kind, color, label)

    def px(self, v) -> np.ndarray:
        return self.left + self.width * self.x(v)

    def py(self, v) -> np.ndarray:
        return self.top + self.height * (1 - self.y(v))

    def _add(self, element: str) -> None:
        self.fig.parts.append(f'<g clip-path="url(#{self.clip})">{element}</g>')

    def line(
        self,
        xs,
        ys,
        color: str,
        width: float = 1.5,
        dash: str | None = None,
        marker: str | None = None,
        label: str | None = None,
    ) -> None:
        px, py = self.px(xs), self.py(ys)
        keep = np.isfinite(px) & np.isfinite(py)
        if keep.sum() >= 2:
            self._add(_line(px[keep], py[keep], color, width, dash))
        if marker:
            self.points(np.asarray(xs)[keep], np.asarray(ys)[keep], color, 3.0 if marker != "v" else 3.5, 1.0, marker)
        if label:
            self.legend_items.append(("line", color, label))

    def points(
        self, xs, ys, color: str, r: float = 2.0, alpha: float = 1.0, marker: str = "o", label: str | None = None
    ) -> None:
        """Markers at the points, as one path (a zero-length segment per point, round caps)."""
        px, py = self.px(xs), self.py(ys)
        keep = np.isfinite(px) & np.isfinite(py)
        if keep.any():
            if marker == "o":
                d = "".join(f"M{_num(a)} {_num(b)}h0" for a, b in zip(px[keep], py[keep]))
                self._add(
                    f'<path d="{d}" stroke="{color}" stroke-width="{_num(2 * r)}" stroke-linecap="round" '
                    f'opacity="{alpha}" fill="none"/>'
                )
            else:  # "v": a triangle pointing down, "s": a square
                shape = {
                    "v": f"l{_num(r)} {_num(-1.7 * r)}h{_num(-2 * r)}z",
                    "s": f"m{-r} {-r}h{2 * r}v{2 * r}h{-2 * r}z",
                }
                start = {"v": (0, r), "s": (0, 0)}[marker]
                d = "".join(
                    f"M{_num(a + start[0])} {_num(b + start[1])}{shape[marker]}" for a, b in zip(px[keep], py[keep])
                )
                self._add(f'<path d="{d}" fill="{color}" opacity="{alpha}"/>')
        if label:
            self.legend_items.append(("point", color, label))

    def stairs(self, counts, edges, color: str, alpha: float = 0.6, floor: float | None = None) -> None:
        """A filled histogram: ``counts[i]`` over ``[edges[i], edges[i+1])``, from ``floor`` (the
        bottom of the axis by default) up."""
        counts, edges = np.asarray(counts, np.float64), np.asarray(edges, np.float64)
        base = self.y.lo if floor is None else floor
        with np.errstate(divide="ignore", invalid="ignore"):
            top = np.where(counts > 0, counts, base)
        xs = np.repeat(self.px(edges), 2)[1:-1]
        ys = np.repeat(self.py(top), 2)
        y0 = float(self.py(base))
        ys = np.where(np.isfinite(ys), ys, y0)
        d = (
            f"M{_num(xs[0])} {_num(y0)}"
            + "".join(f"L{_num(a)} {_num(b)}" for a, b in zip(xs, ys))
            + f"L{_num(xs[-1])} {_num(y0)}Z"
        )
        self._add(f'<path d="{d}" fill="{color}" opacity="{alpha}" stroke="none"/>')

    def band(self, xs, lo, hi, color: str, alpha: float, label: str | None = None) -> None:
        px, plo, phi = self.px(xs), self.py(lo), self.py(hi)
        pts = list(zip(px, phi)) + list(zip(px[::-1], plo[::-1]))
        d = "M" + "L".join(f"{_num(a)} {_num(b)}" for a, b in pts) + "Z"
        self._add(f'<path d="{d}" fill="{color}" opacity="{alpha}" stroke="none"/>')
        if label:
            self.legend_items.append(("band", f"{color};{alpha}", label))

    def vline(self, x: float, color: str, dash: str = "4 3", width: float = 1.0) -> None:
        px = float(self.px(x))
        self._add(_line([px, px], [self.top, self.top + self.height], color, width, dash))

    def hline(self, y: float, color: str, dash: str = "4 3", width: float = 1.0) -> None:
        py = float(self.py(y))
        self._add(_line([self.left, self.left + self.width], [py, py], color, width, dash))

    def image(self, rgba: np.ndarray, x0: float, x1: float, y0: float, y1: float) -> None:
        """An RGBA image (rows top to bottom) over the data rectangle [x0, x1] x [y0, y1]."""
        left, right = float(self.px(x0)), float(self.px(x1))
        top, bottom = float(self.py(y1)), float(self.py(y0))
        self._add(_image(rgba, left, top, right - left, bottom - top))

    def note(
        self,
        x_data: float | None,
        y_frac: float,
        s: str,
        color: str = TEXT_COLOR,
        size: float = 9,
        anchor: str = "start",
    ) -> None:
        """Text at a data x (or the left edge) and a fraction of the axis height from the bottom."""
        x = self.left + 4 if x_data is None else float(self.px(x_data)) + 3
        self.fig.text(x, self.top + self.height * (1 - y_frac), s, size, anchor, fill=color)

    def frame(
        self,
        xlabel: str,
        ylabel: str,
        title: str | None = None,
        xticks: list[float] | None = None,
        xticklabels: list[str] | None = None,
        rotate_x: bool = False,
        tick_size: float = 10,
    ) -> None:
        """Grid, box, ticks, tick labels and axis labels."""
        fig, parts = self.fig, self.fig.parts
        right, bottom = self.left + self.width, self.top + self.height
        yticks = self.y.ticks()
        grid = []
        for t in yticks:
            y = float(self.py(t))
            if self.top - 0.5 <= y <= bottom + 0.5:
                grid.append(_line([self.left, right], [y, y], GRID_COLOR, 0.8))
                parts.append(_line([self.left - 4, self.left], [y, y], AXIS_COLOR, 0.8))
                fig.text(self.left - 6, y + 3.5, label(t), tick_size, "end")
        xticks = self.x.ticks() if xticks is None else xticks
        labels = xticklabels or [label(t) for t in xticks]
        for t, s in zip(xticks, labels):
            x = float(self.px(t))
            if self.left - 0.5 <= x <= right + 0.5:
                parts.append(_line([x, x], [bottom, bottom + 4], AXIS_COLOR, 0.8))
                if rotate_x:
                    parts.append(_text(x + 3, bottom + 10, s, tick_size, "end", rotate=-30, hang=True))
                else:
                    for i, line in enumerate(s.split("\n")):
                        fig.text(x, bottom + 16 + i * (tick_size + 2), line, tick_size)
        parts.append(
            f'<rect x="{_num(self.left)}" y="{_num(self.top)}" width="{_num(self.width)}" height="{_num(self.height)}" '
            f'fill="none" stroke="{AXIS_COLOR}" stroke-width="0.8"/>'
        )
        parts[self.start : self.start] = grid
        below = 58 if rotate_x else 34 + 12 * max(s.count("\n") for s in labels or [""])
        fig.text(self.left + self.width / 2, bottom + below, xlabel, 11.5)
        fig.text(self.left - 58, self.top + self.height / 2, ylabel, 11.5, rotate=True)
        if title:
            fig.text(self.left + self.width / 2, self.top - 8, title, 11.5)

    def legend(self, where: str = "upper left", size: float = 9.5) -> None:
        """The labelled series, inside the axes at a corner."""
        if not self.legend_items:
            return
        line_h = size + 5
        x = self.left + 10 if "left" in where else self.left + self.width - 10
        y0 = self.top + 14 if "upper" in where else self.top + self.height - 8 - line_h * (len(self.legend_items) - 1)
        for i, (kind, color, text) in enumerate(self.legend_items):
            y = y0 + i * line_h
            sx = x if "left" in where else x - 22
            if kind == "line":
                self.fig.parts.append(_line([sx, sx + 18], [y - 4, y - 4], color, 1.8))
            elif kind == "point":
                self.fig.parts.append(f'<circle cx="{_num(sx + 9)}" cy="{_num(y - 4)}" r="3" fill="{color}"/>')
            else:
                c, a = color.split(";")
                self.fig.parts.append(
                    f'<rect x="{_num(sx)}" y="{_num(y - 9)}" width="18" height="10" fill="{c}" opacity="{a}"/>'
                )
            if "left" in where:
                self.fig.text(sx + 24, y, text, size, "start")
            else:
                self.fig.text(sx - 6, y, text, size, "end")


# ---- primitives -------------------------------------------------------------------------------


def _line(xs, ys, color: str, width: float, dash: str | None = None) -> str:
    d = "M" + "L".join(f"{_num(a)} {_num(b)}" for a, b in zip(xs, ys))
    extra = f' stroke-dasharray="{dash}"' if dash else ""
    return f'<path d="{d}" stroke="{color}" stroke-width="{_num(width)}" fill="none"{extra}/>'


def _text(
    x: float,
    y: float,
    s: str,
    size: float,
    anchor: str,
    rotate: bool | float = False,
    hang: bool = False,
    fill: str = TEXT_COLOR,
) -> str:
    angle = -90 if rotate is True else float(rotate or 0)
    transform = f' transform="rotate({_num(angle)} {_num(x)} {_num(y)})"' if angle else ""
    baseline = ' dominant-baseline="hanging"' if hang else ""
    return (
        f'<text x="{_num(x)}" y="{_num(y)}" font-size="{_num(size)}" text-anchor="{anchor}" fill="{fill}"'
        f"{transform}{baseline}>{escape(s)}</text>"
    )


def _viridis(values: np.ndarray) -> np.ndarray:
    """Colors of ``values`` in [0, 1] as uint8 RGB (last axis)."""
    pos = np.clip(values, 0.0, 1.0) * (len(VIRIDIS) - 1)
    i = np.minimum(pos.astype(np.int64), len(VIRIDIS) - 2)
    f = (pos - i)[..., None]
    return np.round(VIRIDIS[i] * (1 - f) + VIRIDIS[i + 1] * f).astype(np.uint8)


def density_rgba(counts: np.ndarray, vmax: float) -> np.ndarray:
    """A 2-D count histogram [x, y] as an RGBA image (rows top to bottom = y high to low): log color
    from 1 to ``vmax``, transparent where the count is 0."""
    c = np.asarray(counts, np.float64).T[::-1]
    with np.errstate(divide="ignore"):
        level = np.log(np.maximum(c, 1.0)) / math.log(max(vmax, 2.0))
    rgba = np.zeros(c.shape + (4,), np.uint8)
    rgba[..., :3] = _viridis(level)
    rgba[..., 3] = np.where(c > 0, 255, 0)
    return rgba


def png(rgba: np.ndarray) -> bytes:
    """An RGBA uint8 image [rows, columns, 4] as PNG bytes (no filtering, zlib level 9)."""
    h, w, _ = rgba.shape
    rows = np.zeros((h, w * 4 + 1), np.uint8)
    rows[:, 1:] = rgba.reshape(h, w * 4)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def _image(rgba: np.ndarray, x: float, y: float, w: float, h: float) -> str:
    data = base64.b64encode(png(rgba)).decode("ascii")
    return (
        f'<image x="{_num(x)}" y="{_num(y)}" width="{_num(w)}" height="{_num(h)}" preserveAspectRatio="none" '
        f'style="image-rendering:pixelated" href="data:image/png;base64,{data}"/>'
    )

"""Figures as self-contained SVG (no plotting library, no external assets): rendering only, the
points and statistics come from the analysis."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

import numpy as np

WIDTH, HEIGHT, MARGIN = 520, 440, 56
COLORS = {"first": "#1f77b4", "later": "#d62728"}


@dataclass
class Series:
    label: str
    color: str
    x: np.ndarray
    y: np.ndarray


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    return list(np.linspace(lo, hi, n))


def scatter_svg(series: list[Series], *, title: str, xlabel: str, ylabel: str,
                limits: tuple[float, float] | None = None) -> str:
    """A square scatter with the y = x diagonal (agreement) and a legend line per series."""
    xs = [s.x[np.isfinite(s.x) & np.isfinite(s.y)] for s in series]
    ys = [s.y[np.isfinite(s.x) & np.isfinite(s.y)] for s in series]
    if limits is None:
        values = np.concatenate(xs + ys) if any(len(v) for v in xs) else np.array([0.0, 1.0])
        lo, hi = float(values.min()), float(values.max())
        pad = (hi - lo) * 0.05 or 0.5
        limits = (lo - pad, hi + pad)
    lo, hi = limits
    plot_w, plot_h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN

    def px(v):
        return MARGIN + (np.asarray(v) - lo) / (hi - lo) * plot_w

    def py(v):
        return HEIGHT - MARGIN - (np.asarray(v) - lo) / (hi - lo) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>',
           f'<rect x="{MARGIN}" y="{MARGIN}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#888"/>',
           f'<line x1="{px(lo):.1f}" y1="{py(lo):.1f}" x2="{px(hi):.1f}" y2="{py(hi):.1f}" stroke="#bbb" '
           'stroke-dasharray="4 3"/>']
    for t in _ticks(lo, hi):
        out.append(f'<text x="{px(t):.1f}" y="{HEIGHT - MARGIN + 14}" text-anchor="middle">{t:.3g}</text>')
        out.append(f'<text x="{MARGIN - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:.3g}</text>')
    out.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 14}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text x="14" y="{HEIGHT / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {HEIGHT / 2})">{escape(ylabel)}</text>')
    for s, x, y in zip(series, xs, ys):
        dots = "".join(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2"/>' for a, b in zip(px(x), py(y)))
        out.append(f'<g fill="{s.color}" fill-opacity="0.45">{dots}</g>')
    for k, s in enumerate(series):
        y0 = MARGIN + 14 + 16 * k
        out.append(f'<circle cx="{MARGIN + 10}" cy="{y0 - 4}" r="4" fill="{s.color}"/>')
        out.append(f'<text x="{MARGIN + 20}" y="{y0}">{escape(s.label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


FIGURES_DIR = "figures"
TURN_FIGURES = {"log_ppl": "log_ppl_by_turn.svg", "probs": "token_prob_by_turn.svg"}


def write_turn_figures(run_dir, record: dict, points) -> dict:
    """The two first-vs-later scatters, into ``<run>/figures/``; returns their relative paths."""
    from pathlib import Path

    out = Path(run_dir) / FIGURES_DIR
    out.mkdir(exist_ok=True)
    by_turn = record.get("metrics_by_turn") or {}
    label = {"first": "first turns", "later": "later turns (after tool output)"}

    def series(kind: str) -> list[Series]:
        result = []
        for group in ("first", "later"):
            m = by_turn.get(group) or {}
            x, y = getattr(points, kind).get(group, (np.zeros(0), np.zeros(0)))
            if not m.get("n_model_tokens"):
                continue
            if kind == "log_ppl":
                stats = (f"{m['n_sequences']} sample-turns, r = {_f(m.get('pearson_log_ppl'))}, "
                         f"mean |d log-ppl| = {_f(m.get('log_ppl_abs_diff_mean'))}")
            else:
                stats = f"{m['n_model_tokens']} tokens, r = {_f(m.get('pearson_prob'))}"
            result.append(Series(f"{label[group]}: {stats}", COLORS[group], x, y))
        return result

    (out / TURN_FIGURES["log_ppl"]).write_text(scatter_svg(
        series("log_ppl"), title="log-ppl per sample-turn: engine vs reference",
        xlabel="log-ppl (engine, infer)", ylabel="log-ppl (reference, train)"))
    (out / TURN_FIGURES["probs"]).write_text(scatter_svg(
        series("probs"), title="token probability: engine vs reference",
        xlabel="p_infer", ylabel="p_train", limits=(0.0, 1.0)))
    return {k: f"{FIGURES_DIR}/{v}" for k, v in TURN_FIGURES.items()}


def _f(v) -> str:
    return "-" if v is None else f"{v:.4g}"

"""How numbers are written for people, in one place: the reports and the terminal summary
(:func:`fmt`, :func:`pct`) and the gate's check lines (:func:`significant`)."""

from __future__ import annotations

import math


def fmt(value) -> str:
    """A metric for a table cell: "-" when missing, integers with thousands separators, 4 decimals
    in [1e-3, 1e4), scientific notation outside it, and 7 decimals just next to 1 (ESS, Pearson r
    and the multiplicative error sit there, where 4 decimals would all read 1.0000)."""
    if value is None:
        return "-"
    if isinstance(value, str):  # "inf" / "-inf" as run.json stores them, or a label
        return value
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    if 0.9999 < abs(value) < 1.0001 and abs(value) != 1.0:
        return f"{value:.7f}"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4f}"


def pct(value) -> str:
    """A share as a percentage with 3 significant digits; "-" when missing."""
    if value is None:
        return "-"
    return f"{100 * value:.3g}%"


def significant(value) -> str:
    """A checked value in the gate's lines: "missing", nan and inf spelled out, else 4 significant
    digits (what a threshold is compared with, without a fixed decimal point)."""
    if value is None:
        return "missing"
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    return f"{value:.4g}"

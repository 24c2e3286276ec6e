"""How numbers are written for people, in one place: the reports, the terminal summary and the
figures' labels (:func:`fmt`, :func:`pct`, :func:`fold`, :func:`short`, :func:`tick`,
:func:`seconds`) and the gate's check lines (:func:`significant`)."""

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


def fold(value) -> str:
    """An x-fold ratio as people read it: 9.1x, 0.11x; "-" when unknown."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}x"


def ratio(a, b) -> str:
    """``a / b`` as an x-fold ratio; "-" when either is missing or ``b`` is 0."""
    try:
        return fold(float(a) / float(b))
    except (TypeError, ValueError, ZeroDivisionError):
        return "-"


def interval(values, show=fold) -> str:
    """An estimate and its interval, ``[estimate, low, high]``, as "est [lo, hi]"; "-" when absent."""
    if not values or len(values) < 3:
        return "-"
    return f"{show(values[0])} [{show(values[1])}, {show(values[2])}]"


def short(value) -> str:
    """A value in a figure's legend: 4 significant digits; "-" when missing."""
    return "-" if value is None else f"{value:.4g}"


def tick(value: float, _pos=None) -> str:
    """An axis tick or a bucket edge: plain and short ("0", "0.001", "1e-05", "20"), never mathtext
    (matplotlib's 10^k labels are parsed by pyparsing, which cost half a report's drawing time).
    The second argument lets matplotlib's FuncFormatter call it."""
    return "0" if value == 0 else f"{value:g}"


def seconds(value: float) -> str:
    """A duration in seconds, to the hundredth."""
    return f"{value:.2f}"


def mib(n_bytes: float) -> str:
    """A size in MiB, whole, with thousands separators."""
    return f"{n_bytes / 2**20:,.0f} MiB"


def significant(value) -> str:
    """A checked value in the gate's lines: "missing", nan and inf spelled out, else 4 significant
    digits (what a threshold is compared with, without a fixed decimal point)."""
    if value is None:
        return "missing"
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    return f"{value:.4g}"

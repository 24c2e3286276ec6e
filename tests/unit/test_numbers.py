"""How numbers are written (mismatch_probe.numbers), against strings written out by hand."""

from __future__ import annotations

import math

import pytest

from mismatch_probe.numbers import fmt, fold, interval, mib, pct, ratio, seconds, short, significant, tick


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        ("inf", "inf"),  # as run.json stores an infinity
        (True, "True"),  # a bool is not written as the int 1
        (1234567, "1,234,567"),
        (0, "0"),
        (0.0, "0"),
        (-0.0, "0"),
        (math.nan, "NaN"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (0.012345678, "0.0123"),
        (-3.14159, "-3.1416"),
        (9999.4, "9999.4000"),
        (12345.6, "1.235e+04"),  # 1e4 and above: scientific
        (0.000999, "9.990e-04"),  # below 1e-3: scientific
        (1e-3, "0.0010"),
        (4.2e-9, "4.200e-09"),
        (1.0, "1.0000"),  # exactly 1 is not "next to 1"
        (0.99999123, "0.9999912"),  # ESS / Pearson r next to 1: 7 decimals, not 1.0000
        (1.0000456, "1.0000456"),
        (-0.99995, "-0.9999500"),
        (0.9999, "0.9999"),  # the band is open: 0.9999 itself has 4 decimals
    ],
)
def test_fmt(value, text):
    assert fmt(value) == text


def test_pct():
    assert pct(None) == "-"
    assert pct(0) == "0%"
    assert pct(0.5) == "50%"
    assert pct(0.012345) == "1.23%"
    assert pct(1 / 3) == "33.3%"
    assert pct(1.0) == "100%"


def test_significant():
    assert significant(None) == "missing"
    assert significant(math.nan) == "nan" and significant(math.inf) == "inf" and significant(-math.inf) == "-inf"
    assert significant(0.00123456) == "0.001235"
    assert significant(123456.0) == "1.235e+05"
    assert significant(2) == "2"
    assert significant(0.05) == "0.05"


def test_fold_ratio_and_interval():
    assert fold(None) == "-" and fold(math.nan) == "-" and fold(math.inf) == "inf" and fold("x") == "-"
    assert fold(9.123) == "9.12x" and fold(0.1149) == "0.115x" and fold(1) == "1x"
    assert ratio(3.0, 2.0) == "1.5x" and ratio(1.0, 0) == "-" and ratio(None, 2.0) == "-"
    assert interval([2.0, 1.5, 3.25]) == "2x [1.5x, 3.25x]"
    assert interval([0.5, 0.25, 1.0], fmt) == "0.5000 [0.2500, 1.0000]"
    assert interval(None) == "-" and interval([1.0]) == "-"


def test_figure_labels():
    assert [tick(v) for v in (0, 0.001, 1e-5, 20, 0.5, 1e6)] == ["0", "0.001", "1e-05", "20", "0.5", "1e+06"]
    assert short(None) == "-" and short(0.123456) == "0.1235" and short(12345.6) == "1.235e+04"
    assert seconds(1.234) == "1.23" and mib(3 * 2**20) == "3 MiB" and mib(5000 * 2**20) == "5,000 MiB"

"""Exact order statistics by radix selection (analysis/order_stats.py) against numpy's sort and quantile."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mismatch_probe.analysis import order_stats
from mismatch_probe.analysis.metrics import QUANTILES
from mismatch_probe.analysis.order_stats import (
    float32_bits,
    linear_ranks,
    needed_ranks,
    order_statistics,
    quantiles_from_bits,
)
from mismatch_probe.analysis.terms import quantiles


def _values(kind: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == 0:  # bf16-like |delta|: spread over decades
        v = np.abs(rng.normal(0, 0.01, n))
    elif kind == 1:  # heavy ties and infinities
        v = rng.choice([0.0, 1e-3, 2.5, np.inf], n)
    elif kind == 2:  # subnormal floats and zeros
        v = np.abs(rng.standard_cauchy(n)) * 1e-42
    elif kind == 3:  # almost all exactly 0 (one bucket holds nearly everything)
        v = np.zeros(n)
        v[rng.random(n) < 0.01] = np.inf
    else:
        v = rng.exponential(1, n) ** 3
    return v.astype(np.float32)


def _chunks(bits: np.ndarray, cells: np.ndarray, pieces: int):
    bounds = np.linspace(0, len(bits), pieces + 1).astype(int)
    return lambda: ((bits[a:b], cells[a:b]) for a, b in itertools.pairwise(bounds))


@pytest.fixture(params=["histogram", "direct", "histogram, keyed once"])
def selection(request, monkeypatch):
    """Every way of selecting: the histograms (large inputs), direct partitioning (small ones), and
    the histograms over values keyed once for both passes (the caller gives ``n_values``)."""
    monkeypatch.setattr(order_stats, "DIRECT_PER_CELL", 1 << 30 if request.param == "direct" else 0)
    if request.param == "histogram, keyed once":
        plain = order_stats.order_statistics

        def with_count(chunks, *args, **kwargs):
            n_values = sum(len(bits) for bits, _ in chunks())
            return plain(chunks, *args, n_values=n_values, **kwargs)

        monkeypatch.setattr(order_stats, "order_statistics", with_count)
    return request.param


@pytest.mark.parametrize("seed", range(60))
def test_every_order_statistic_and_quantile_equals_numpy(seed: int, selection) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 2, 3, 5, 10, 101, 1000, 30000]))
    v = _values(seed % 5, n, rng)
    n_cells = int(rng.integers(1, 6))
    cells = rng.integers(-1, n_cells, n)  # -1: in no group
    groups = [list(range(n_cells)), *([c] for c in range(n_cells)), list(range(0, n_cells, 2))]
    sizes = [int(np.isin(cells, g).sum()) for g in groups]
    ranks = [needed_ranks(m, QUANTILES) for m in sizes]
    got = order_stats.order_statistics(_chunks(float32_bits(v), cells, int(rng.integers(1, 4))), n_cells, groups, ranks)
    for g, m, r, bits in zip(groups, sizes, ranks, got):
        members = np.sort(v[np.isin(cells, g)])
        assert bits.view(np.float32).tolist() == members[r].tolist()
        stats = dict(zip(r, bits.view(np.float32).astype(np.float64).tolist()))
        # bit for bit what metrics.quantiles (numpy's linear method on float64) gives
        assert quantiles_from_bits(m, QUANTILES, stats) == quantiles(members, QUANTILES)


def test_every_rank_of_a_group_spread_over_chunks(selection) -> None:
    rng = np.random.default_rng(7)
    v = _values(0, 5000, rng)
    v[::7] = v[3]  # ties across the bucket boundaries
    cells = np.zeros(5000, dtype=np.int64)
    got = order_stats.order_statistics(_chunks(float32_bits(v), cells, 5), 1, [[0]], [list(range(5000))])[0]
    assert got.view(np.float32).tolist() == np.sort(v).tolist()


def test_linear_ranks_follow_numpy_at_the_ends() -> None:
    assert [a.tolist() for a in linear_ranks(1, [0.5, 0.99])[:2]] == [[0, 0], [0, 0]]
    previous, following, gamma = linear_ranks(101, [0.5, 0.9, 0.99])
    assert previous.tolist() == [50, 90, 99] and following.tolist() == [51, 91, 100]
    assert ((gamma >= 0) & (gamma < 1e-12)).all()  # 100 * 0.9 rounds to just above 90, as in numpy
    assert quantiles_from_bits(0, QUANTILES, {}) == {"p50": None, "p90": None, "p99": None}


def test_refuses_what_has_no_bit_order_and_ranks_out_of_range(selection) -> None:
    with pytest.raises(ValueError, match="non-negative"):
        float32_bits(np.array([1.0, -2.0]))
    with pytest.raises(ValueError, match="non-negative"):
        float32_bits(np.array([np.nan]))
    assert float32_bits(np.array([-0.0], dtype=np.float32)).tolist() == [0]
    bits = float32_bits(np.array([1.0, 2.0]))
    with pytest.raises(IndexError, match="2 values"):
        order_statistics(_chunks(bits, np.zeros(2, int), 1), 1, [[0]], [[2]])

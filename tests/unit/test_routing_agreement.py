"""The popcount behind the routing agreement: NumPy's ``bitwise_count`` where NumPy has it (2.x),
the byte-table fallback on NumPy 1.26; both must count exactly what Python's ``int.bit_count`` does."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_probe.analysis import routing_agreement
from mismatch_probe.analysis.routing_agreement import popcount_by_bytes, shared_experts

UINT64_MAX = np.iinfo(np.uint64).max
EDGES = np.array([0, 1, 2**63, UINT64_MAX, UINT64_MAX - 1, 0x5555555555555555, 0xAAAAAAAAAAAAAAAA], np.uint64)


def words(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random uint64 words over the whole range, with the edge cases mixed in."""
    x = np.random.default_rng(seed).integers(0, UINT64_MAX, shape, dtype=np.uint64, endpoint=True)
    x.reshape(-1)[: len(EDGES)] = EDGES[: x.size]
    return x


def bit_counts(x: np.ndarray) -> np.ndarray:
    """The reference: Python's int.bit_count of each element, integers throughout (tolist gives ints)."""
    return np.array([int(v).bit_count() for v in np.ravel(x).tolist()], dtype=np.int64).reshape(x.shape)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (1,), (7,), (50, 3), (4, 5, 6)])
def test_the_fallback_counts_what_int_bit_count_counts(shape):
    x = words(len(shape), shape)
    got = popcount_by_bytes(x)
    assert got.shape == x.shape and got.dtype == np.uint8
    assert (got.astype(np.int64) == bit_counts(x)).all()


def test_the_edge_cases_one_by_one():
    assert popcount_by_bytes(EDGES).tolist() == [0, 1, 1, 64, 63, 32, 32]
    assert popcount_by_bytes(np.array([1 << k for k in range(64)], np.uint64)).tolist() == [1] * 64
    assert popcount_by_bytes(np.array(UINT64_MAX, np.uint64)).shape == ()  # a 0-d array stays 0-d
    assert int(popcount_by_bytes(np.array(UINT64_MAX, np.uint64))) == 64


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_every_unsigned_width_and_non_contiguous_views(dtype):
    x = words(3, (40, 6)).astype(dtype)  # astype wraps: each width keeps its low bits
    for view in (x, x[:, ::2], x.T, x[::-1]):
        assert (popcount_by_bytes(view).astype(np.int64) == bit_counts(view)).all()
    assert popcount_by_bytes(np.array([np.iinfo(dtype).max], dtype)).tolist() == [8 * np.dtype(dtype).itemsize]


def test_signed_and_float_arrays_are_refused():
    for x in (np.array([-1], np.int64), np.array([1.0])):
        with pytest.raises(TypeError, match="unsigned"):
            popcount_by_bytes(x)


@pytest.mark.skipif(not hasattr(np, "bitwise_count"), reason="NumPy < 2 has no np.bitwise_count")
def test_the_fallback_equals_numpys_bitwise_count():
    x = words(7, (1000, 4))
    assert routing_agreement.popcount is np.bitwise_count  # NumPy 2 runs NumPy's own
    native = np.bitwise_count(x)
    assert native.dtype == popcount_by_bytes(x).dtype and (native == popcount_by_bytes(x)).all()
    assert np.bitwise_count(np.zeros(0, np.uint64)).shape == popcount_by_bytes(np.zeros(0, np.uint64)).shape


def test_shared_experts_with_either_popcount_is_the_set_intersection(monkeypatch):
    """Top-8 of 200 experts (four 64-bit words): |A & B| against Python sets, with the popcount
    this NumPy runs and with the fallback."""
    rng = np.random.default_rng(0)
    a = np.sort(np.array([rng.choice(200, 8, replace=False) for _ in range(300)]).reshape(100, 3, 8), axis=-1)
    b = a.copy()
    swap = rng.random(b.shape) < 0.3
    b[swap] = rng.integers(0, 200, swap.sum())
    expect = np.array([len(set(x) & set(y)) for x, y in zip(a.reshape(-1, 8).tolist(), b.reshape(-1, 8).tolist())])
    assert (shared_experts(a, b).reshape(-1) == expect).all()
    monkeypatch.setattr(routing_agreement, "popcount", popcount_by_bytes)
    assert (shared_experts(a, b).reshape(-1) == expect).all()
    assert shared_experts(a[:0], b[:0]).shape == (0, 3)

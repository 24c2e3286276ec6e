"""Exact quantiles of many groups of non-negative float32 values, without sorting them.

The metrics report quantiles of |delta| (float32, one per model token) for every group of tokens
(all, first turn, later turns, each turn index, each p_infer bucket of those). Partitioning a copy
of each group costs a pass per group and a float64 copy of up to 100M values; here every group is a
union of *cells* (each value belongs to exactly one), and a quantile is found by radix selection
on the float's bit pattern, which for non-negative floats orders like the value:

1. one histogram of the upper 16 bits per cell (``bincount``, streamed in chunks) gives, per group,
   the 16-bit bucket that holds each wanted rank and the rank inside it;
2. the values that fall into a wanted (cell, bucket) are gathered (usually a few percent) and the
   lower 16 bits are selected among them.

The k-th smallest value is exact, so :func:`linear_quantiles` reproduces ``numpy.quantile``'s
``linear`` method bit for bit from the order statistics it needs (tested against it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

HI = 16  # bits of the first histogram
BINS = 1 << HI
_CHUNK = 1 << 22  # values per chunk of the passes: bounds the temporaries (~100 MiB)
# below this many values per histogram cell, selecting among the gathered values directly is
# cheaper than two histograms of 65536 buckets per cell (a timeline step of a few thousand tokens)
DIRECT_PER_CELL = 4096


def float32_bits(values: np.ndarray) -> np.ndarray:
    """The uint32 bit patterns of non-negative float32 values (which sort like the values); -0.0
    becomes +0.0. NaN and negative values have no place in this order and are refused."""
    v = np.asarray(values, dtype=np.float32)
    if v.size and not (v >= 0).all():
        raise ValueError("order statistics need non-negative, non-NaN values")
    return (v + np.float32(0.0)).view(np.uint32)  # -0.0 + 0.0 = +0.0


def order_statistics(
    chunks: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]],
    n_cells: int,
    groups: Sequence[Sequence[int]],
    ranks: Sequence[Sequence[int]],
    *,
    n_values: int | None = None,
) -> list[np.ndarray]:
    """The ``ranks[g]``-th smallest (0-based) of the values whose cell is in ``groups[g]``, as uint32
    bit patterns, for every group ``g``. ``chunks()`` yields the values in pieces, each as
    (:func:`float32_bits`, each value's cell in ``[0, n_cells)`` or -1 for a value in no group); it
    is called twice, so the values are never concatenated. Memory: ``n_cells x 65536`` counts, so
    keep cells few (tens); the caller maps what it groups by onto cells. ``n_values``, the number of
    values when the caller knows it: more than the direct selection takes skips gathering them,
    and at most one piece's worth are keyed once for both passes (a timeline step), not twice."""
    group_cells = [np.asarray(sorted({int(c) for c in g}), dtype=np.int64) for g in groups]
    wanted = [np.asarray(r, dtype=np.int64) for r in ranks]
    limit = DIRECT_PER_CELL * n_cells
    gathered = _gather(chunks, limit) if n_values is None or n_values <= limit else None
    if gathered is not None:
        return _direct(*gathered, group_cells, wanted)
    from mismatch_probe.analysis.kernels import compiled

    loops = compiled(n_values)  # the two passes as loops over the values, keyed on the fly (analysis/kernels.py)
    pieces: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]] = lambda: _pieces(chunks)
    if loops is None and n_values is not None and n_values <= _CHUNK:
        keyed = list(_pieces(chunks))
        pieces = lambda: keyed

    # 1. per cell, how many values in each upper-16-bit bucket
    flat = np.zeros(n_cells * BINS, dtype=np.int64)
    if loops is not None:
        for bits, cells in chunks():
            bits, cells = _checked_piece(bits, cells)
            loops.histogram(bits, cells, HI, flat)
    else:
        for key, _ in pieces():
            flat += np.bincount(key[key >= 0], minlength=n_cells * BINS)
    counts = flat.reshape(n_cells, BINS)

    # per group and rank: the bucket that holds it and the rank among the bucket's values
    need = np.zeros(n_cells * BINS, dtype=bool)
    located = []
    for g, (cs, rs) in enumerate(zip(group_cells, wanted)):
        cum = np.cumsum(counts[cs].sum(axis=0))
        if len(rs) and (rs.min() < 0 or rs.max() >= cum[-1]):
            raise IndexError(f"group {g} has {int(cum[-1])} values; ranks {rs.tolist()} are out of range")
        bucket = np.searchsorted(cum, rs, side="right")
        inside = rs - np.where(bucket > 0, cum[bucket - 1], 0)
        located.append((bucket, inside))
        for b in np.unique(bucket):
            need[cs * BINS + b] = True

    # 2. the values in a wanted (cell, bucket), grouped by it (a stable radix sort of small ids)
    pair_of = np.full(n_cells * BINS, -1, dtype=np.int32)
    pairs = np.flatnonzero(need)
    pair_of[pairs] = np.arange(len(pairs), dtype=np.int32)
    cand_pair, cand_low = [np.zeros(0, np.int32)], [np.zeros(0, np.uint16)]
    if loops is not None:
        for bits, cells in chunks():
            found_pair, found_low = loops.candidates(*_checked_piece(bits, cells), HI, pair_of)
            cand_pair.append(found_pair)
            cand_low.append(found_low)
    else:
        for key, bits in pieces():
            pid = np.where(key >= 0, pair_of[np.maximum(key, 0)], -1)
            hit = pid >= 0
            cand_pair.append(pid[hit])
            cand_low.append((bits[hit] & np.uint32(BINS - 1)).astype(np.uint16))
    pid = np.concatenate(cand_pair)
    order = np.argsort(pid, kind="stable")
    low = np.concatenate(cand_low)[order]
    bounds = np.searchsorted(pid[order], np.arange(len(pairs) + 1))

    out = []
    for cs, (bucket, inside) in zip(group_cells, located):
        values = np.zeros(len(bucket), dtype=np.uint32)
        for b in np.unique(bucket):
            ids = pair_of[cs * BINS + b]
            lows = np.concatenate([low[bounds[i] : bounds[i + 1]] for i in ids[ids >= 0]])
            at = bucket == b
            ks = inside[at]
            picked = np.partition(lows, np.unique(ks))[ks]
            values[at] = (np.uint32(b) << np.uint32(HI)) | picked.astype(np.uint32)
        out.append(values)
    return out


def _gather(
    chunks: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]], limit: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Every (bits, cell) pair concatenated, or None once there are more than ``limit`` of them."""
    bits, cells, n = [], [], 0
    for b, c in chunks():
        n += len(b)
        if n > limit:
            return None
        bits.append(np.asarray(b, dtype=np.uint32))
        cells.append(np.asarray(c))
    if not bits:
        return np.zeros(0, np.uint32), np.zeros(0, np.int64)
    return np.concatenate(bits), np.concatenate(cells)


def _direct(
    bits: np.ndarray, cells: np.ndarray, group_cells: list[np.ndarray], wanted: list[np.ndarray]
) -> list[np.ndarray]:
    """The same order statistics by partitioning each group's values (few values: no histograms)."""
    out = []
    for g, (cs, rs) in enumerate(zip(group_cells, wanted)):
        values = bits[np.isin(cells, cs)]
        if len(rs) and (rs.min() < 0 or rs.max() >= len(values)):
            raise IndexError(f"group {g} has {len(values)} values; ranks {rs.tolist()} are out of range")
        out.append(np.partition(values, np.unique(rs))[rs].astype(np.uint32) if len(rs) else np.zeros(0, np.uint32))
    return out


def _checked_piece(bits: np.ndarray, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A piece as uint32 bits and int64 cells, the same length."""
    bits, cells = np.asarray(bits, dtype=np.uint32), np.asarray(cells, dtype=np.int64)
    if bits.shape != cells.shape:
        raise ValueError(f"{len(bits)} values but {len(cells)} cells")
    return bits, cells


def _pieces(chunks: Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(cell * 65536 + upper 16 bits, or -1 outside every cell; the bits) in pieces of at most _CHUNK."""
    for bits, cells in chunks():
        bits, cells = _checked_piece(bits, cells)
        for lo in range(0, len(bits), _CHUNK):
            b, c = bits[lo : lo + _CHUNK], cells[lo : lo + _CHUNK]
            key = c.astype(np.int64) * BINS + (b >> np.uint32(HI)).astype(np.int64)
            yield np.where(c >= 0, key, -1), b


def linear_ranks(n: int, qs: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The two order statistics (0-based ranks) each quantile of ``n`` values interpolates between,
    and its weight, exactly as ``numpy.quantile(..., method="linear")`` computes them."""
    virtual = (n - 1) * np.asanyarray(qs, dtype=np.float64)
    previous = np.floor(virtual)
    following = previous + 1
    above = virtual >= n - 1
    previous[above] = -1
    following[above] = -1
    previous, following = previous.astype(np.intp), following.astype(np.intp)
    gamma = np.asanyarray(virtual - previous)
    previous[above] = n - 1  # numpy indexes -1: the last value
    following[above] = n - 1
    return previous, following, gamma


def lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``numpy.quantile``'s interpolation between neighbouring order statistics (numpy's ``_lerp``)."""
    diff_b_a = np.subtract(b, a)
    out = np.asanyarray(np.add(a, diff_b_a * t))
    np.subtract(b, diff_b_a * (1 - t), out=out, where=t >= 0.5, casting="unsafe", dtype=out.dtype)
    return out


def quantiles_from_bits(n: int, qs: dict[str, float], order_stat: dict[int, float]) -> dict[str, float | None]:
    """``metrics.quantiles`` of ``n`` values from the order statistics it needs (``order_stat[k]``,
    the k-th smallest as a float): linear interpolation, ``inf`` (not NaN) when the tail is."""
    if n == 0:
        return {k: None for k in qs}
    previous, following, gamma = linear_ranks(n, list(qs.values()))
    finite_max = np.finfo(np.float64).max
    a = np.minimum(np.array([order_stat[int(i)] for i in previous], dtype=np.float64), finite_max)
    b = np.minimum(np.array([order_stat[int(i)] for i in following], dtype=np.float64), finite_max)
    out = lerp(a, b, gamma)
    # An interpolation that touched an infinite neighbour lands above 1e300.
    return {k: (math.inf if v > 1e300 else float(v)) for k, v in zip(qs, out)}


def needed_ranks(n: int, qs: dict[str, float]) -> list[int]:
    """The order statistics :func:`quantiles_from_bits` and a maximum need for ``n`` values."""
    if n == 0:
        return []
    previous, following, _ = linear_ranks(n, list(qs.values()))
    return sorted({*previous.tolist(), *following.tolist(), n - 1})

"""One pass, every group: MetricsAccumulator's turn groups against an accumulator per group fed that
group's tokens alone (what the analysis did before it made one pass), and the fast bin lookups
against numpy's search."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mismatch_probe.analysis.distributions import LENGTH_EDGES, LOG_RATIO_EDGES, MISMATCH_LOG_EDGES, bin_index
from mismatch_probe.analysis.metrics import P_INFER_BUCKET_EDGES, POSITION_BUCKET_EDGES, MetricsAccumulator
from mismatch_probe.analysis.terms import bucket_index, segment_starts


# exact today (order statistics, counts, maxima, per-sequence values); the rest are sums whose
# order of summation differs between the two ways, so equal to rounding
def _exact(key: str) -> bool:
    return key.startswith(("n_", "seq_", "log_ppl", "pearson_log", "chi2_seq")) or key.endswith(
        ("_p50", "_p90", "_p99", "_max", "count", "share", "_lo", "_hi")
    )


def _shards(seed: int, n_shards: int = 3):
    """Multi-turn shards: samples of 1-4 turns, some p_train = 0, exact-zero deltas, long positions."""
    rng = np.random.default_rng(seed)
    sample = 0
    for _ in range(n_shards):
        lengths = rng.integers(1, 400, 40)
        n = int(lengths.sum())
        sid = np.repeat(np.arange(sample, sample + 40), lengths)
        sample += 40
        starts = np.r_[0, np.cumsum(lengths)[:-1]]
        pos = np.arange(n) - np.repeat(starts, lengths) + rng.integers(0, 40000, 40).repeat(lengths)
        turns_of = rng.integers(1, 5, 40).repeat(lengths)
        turn = np.minimum(
            (pos - pos.min()) * 0
            + (np.arange(n) - np.repeat(starts, lengths)) * turns_of // np.repeat(lengths, lengths),
            turns_of - 1,
        )
        li = np.log(rng.beta(5, 0.3, n)).astype(np.float32)
        lt = np.where(rng.random(n) < 0.3, li, li + rng.normal(0, 0.02, n)).clip(max=0).astype(np.float32)
        lt[rng.random(n) < 0.002] = -np.inf
        yield lt, li, sid, turn.astype(np.int16), pos.astype(np.int32)


def _close(got, want, path: str = "") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            _close(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a, b, f"{path}[{i}]")
    elif isinstance(want, float) and not _exact(path.rsplit(".", 1)[-1]):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15) or (math.isnan(got) and math.isnan(want)), path
    else:
        assert got == want or (isinstance(want, float) and math.isnan(got) and math.isnan(want)), path


@pytest.mark.parametrize("seed", range(4))
def test_each_group_of_one_pass_equals_an_accumulator_of_its_tokens_alone(seed: int) -> None:
    groups = {"first": lambda t: t == 0, "later": lambda t: t >= 1, **{k: (lambda t, k=k: t == k) for k in range(4)}}
    one_pass = MetricsAccumulator()
    alone = {name: MetricsAccumulator() for name in ["all", *groups]}
    for lt, li, sid, turn, pos in _shards(seed):
        shard = one_pass.add(lt, li, segment_starts(sid), pos, turn)
        assert shard is not None
        alone["all"].add(lt, li, segment_starts(sid), pos)
        for name, select in groups.items():
            keep = select(turn)
            if keep.any():
                alone[name].add(lt[keep], li[keep], segment_starts(sid[keep], turn[keep]), pos[keep])
    assert one_pass.turns == [0, 1, 2, 3]
    for name, acc in alone.items():
        for part in ("metrics", "corrections", "breakdowns"):
            _close(getattr(one_pass, part)(name), getattr(acc, part)(), f"{name}.{part}")
        for a, b in zip(one_pass.sequences(name), acc.sequences()):
            np.testing.assert_array_equal(a, b)  # every per-sequence value, bit for bit


@pytest.mark.parametrize("seed", range(2))
def test_bucket_quantiles_selected_only_when_asked_for_are_the_same(seed: int) -> None:
    """A timeline's accumulator (bucket_quantiles=False: the groups' order statistics alone, a
    bucket's only when asked for) gives every group's and bucket's values bit for bit."""
    eager, lazy = MetricsAccumulator(), MetricsAccumulator(bucket_quantiles=False)
    for lt, li, sid, turn, pos in _shards(seed):
        for acc in (eager, lazy):
            acc.add(lt, li, segment_starts(sid), pos, turn)
    for group in ("all", "first", "later", 0, 2):
        _close(lazy.metrics(group), eager.metrics(group), f"{group}.metrics")
        _close(lazy.breakdowns(group), eager.breakdowns(group), f"{group}.breakdowns")


def test_groups_without_tokens_and_an_accumulator_without_turns() -> None:
    acc = MetricsAccumulator()
    lt, li, sid, _, pos = next(_shards(9, 1))
    acc.add(lt, li, segment_starts(sid), pos)  # no turns: every token is turn 0
    assert acc.turns == [0]
    _close(acc.metrics("first"), acc.metrics())
    later = acc.metrics("later")
    assert later["n_model_tokens"] == 0 and later["k3_kl"] is None and later["abs_delta_p99"] is None
    assert acc.breakdowns("later")["p_infer_buckets"] == [] and acc.metrics(7)["n_sequences"] == 0
    with pytest.raises(ValueError, match="unknown group"):
        acc.metrics("second")


def test_more_turns_than_one_order_statistics_pass_holds() -> None:
    """Turn indices are histogrammed 64 to a pass; 150 turns take three, and each is exact."""
    rng = np.random.default_rng(3)
    n = 150 * 20
    turn = np.repeat(np.arange(150), 20).astype(np.int16)
    li = np.log(rng.beta(5, 0.3, n))
    lt = (li + rng.normal(0, 0.01, n)).clip(max=0)
    acc = MetricsAccumulator()
    acc.add(lt, li, np.array([0]), None, turn)
    for t in (0, 1, 63, 64, 149):
        solo = MetricsAccumulator()
        solo.add(lt[turn == t], li[turn == t], np.array([0]))
        assert acc.metrics(t)["abs_delta_p90"] == solo.metrics()["abs_delta_p90"]
        assert acc.metrics(t)["abs_delta_max"] == solo.metrics()["abs_delta_max"]


def test_bucket_index_is_numpys_search() -> None:
    rng = np.random.default_rng(0)
    p = np.concatenate([rng.uniform(0, 1, 10000), np.array(P_INFER_BUCKET_EDGES), [0.0, 1.0, np.inf]])
    want = np.searchsorted(np.asarray(P_INFER_BUCKET_EDGES[1:-1]), p, side="right")
    np.testing.assert_array_equal(bucket_index(p, P_INFER_BUCKET_EDGES), want)
    pos = np.arange(0, 70000)
    want = np.searchsorted(np.asarray(POSITION_BUCKET_EDGES[1:]), pos, side="right")
    np.testing.assert_array_equal(bucket_index(pos, POSITION_BUCKET_EDGES + (np.inf,)), want)


@pytest.mark.parametrize("edges", [LOG_RATIO_EDGES, LENGTH_EDGES, MISMATCH_LOG_EDGES, np.linspace(0, 1, 51)])
def test_bin_index_is_numpys_search_at_every_edge(edges: np.ndarray) -> None:
    rng = np.random.default_rng(1)
    e = edges[np.isfinite(edges)]
    values = np.concatenate(
        [
            rng.normal(0, 0.01, 20000),
            rng.standard_cauchy(20000) * 1e3,
            e,
            -e,
            np.nextafter(e, np.inf),
            np.nextafter(e, -np.inf),
            [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 5e-324, -5e-324, 1e308, -1e308],
        ]
    )
    want = np.clip(np.searchsorted(edges, values, side="right") - 1, 0, len(edges) - 2)
    np.testing.assert_array_equal(bin_index(values, edges), want)


def test_turns_that_do_not_fit_the_tables_column_are_refused():
    acc = MetricsAccumulator()
    lt, li = np.log(np.full(3, 0.5)), np.log(np.full(3, 0.4))
    with pytest.raises(ValueError, match="int16"):
        acc.add(lt, li, np.array([0]), None, np.array([0, 1, 40000]))
    with pytest.raises(ValueError, match="2 turns for 3 tokens"):
        acc.add(lt, li, np.array([0]), None, np.array([0, 1]))

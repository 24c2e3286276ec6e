"""Sequence-level bootstrap intervals (analysis.intervals) against the metrics pass itself, run
again on explicitly resampled token data, and their coverage on synthetic data with a known truth."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mismatch_probe.analysis.intervals import (
    BOOTSTRAP_METRICS,
    bootstrap_intervals,
    evaluate,
    paired_intervals,
)
from mismatch_probe.analysis.metrics import MetricsAccumulator
from mismatch_probe.analysis.sequences import SequenceIds, group_columns, sequence_table
from mismatch_probe.analysis.terms import segment_starts


def tokens(seed: int, n_seq: int = 40, zero_prob: bool = False):
    """Model tokens of ``n_seq`` single-turn sequences: (sample_id, logp_train, logp_infer)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, n_seq)
    sample = np.repeat(np.arange(n_seq), lengths)
    li = np.log(rng.beta(2, 0.6, len(sample)))
    lt = np.minimum(li + rng.normal(0, 0.08, len(sample)) * rng.random(len(sample)) ** 3, 0.0)
    if zero_prob:
        lt[3] = -np.inf
    return sample, lt, li


def columns_of(sample, lt, li):
    ids, acc = SequenceIds(), MetricsAccumulator()
    starts = segment_starts(sample)
    ids.add(sample, None, starts)
    acc.add(lt, li, starts)
    return group_columns(sequence_table({"all": (ids, acc)}), "all"), acc.metrics()


def test_with_every_sequence_drawn_once_each_metric_is_the_metrics_pass():
    cols, metrics = columns_of(*tokens(0))
    estimates = bootstrap_intervals(cols, n_boot=1)
    for key, interval in estimates.items():
        assert interval.estimate == pytest.approx(metrics[key], rel=1e-12, abs=1e-15), key


@pytest.mark.parametrize("seed", [1, 2])
def test_a_replicate_is_the_metrics_pass_over_the_resampled_sequences(seed):
    """Counts drawn by hand; the token data repeated that many times (each copy its own sequence)
    and run through MetricsAccumulator: the bootstrap's sufficient statistics give the same."""
    sample, lt, li = tokens(seed)
    cols, _ = columns_of(sample, lt, li)
    n = len(cols["n_tokens"])
    counts = np.random.default_rng(seed).multinomial(n, np.full(n, 1 / n))
    starts = np.append(segment_starts(sample), len(sample))
    parts = [(s, c) for s in range(n) for c in range(counts[s])]
    rs = np.concatenate([np.full(starts[s + 1] - starts[s], i) for i, (s, _) in enumerate(parts)])
    idx = np.concatenate([np.arange(starts[s], starts[s + 1]) for s, _ in parts])
    acc = MetricsAccumulator()
    acc.add(lt[idx], li[idx], segment_starts(rs))
    expect = acc.metrics()
    got = evaluate(counts[None, :].astype(np.float64), cols, list(BOOTSTRAP_METRICS))[0]
    for j, key in enumerate(BOOTSTRAP_METRICS):
        assert got[j] == pytest.approx(expect[key], rel=1e-10, abs=1e-15), key


def test_an_infinite_sequence_makes_only_the_replicates_that_draw_it_infinite():
    cols, metrics = columns_of(*tokens(3, zero_prob=True))
    assert math.isinf(metrics["k3_kl"])
    weights = np.ones((2, len(cols["n_tokens"])))
    weights[1, 0] = 0.0  # sequence 0 holds the p_train = 0 token
    weights[1, 1] = 2.0
    k3 = evaluate(weights, cols, ["k3_kl"])[:, 0]
    assert math.isinf(k3[0]) and math.isfinite(k3[1])
    interval = bootstrap_intervals(cols, ["k3_kl"], n_boot=200)["k3_kl"]
    assert math.isinf(interval.estimate) and math.isinf(interval.high) and not math.isnan(interval.low)


def test_empty_runs_bad_levels_and_unpaired_data():
    cols, _ = columns_of(*tokens(4))
    empty = {k: v[:0] for k, v in cols.items()}
    assert bootstrap_intervals(empty, ["k3_kl"]) == {"k3_kl": None}
    with pytest.raises(ValueError, match="level"):
        bootstrap_intervals(cols, level=95)
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_intervals(cols, n_boot=0)
    other, _ = columns_of(*tokens(5))
    with pytest.raises(ValueError, match="same sequences"):
        paired_intervals(cols, other)
    a = bootstrap_intervals(cols, ["k3_kl"], n_boot=300, seed=7)
    assert a == bootstrap_intervals(cols, ["k3_kl"], n_boot=300, seed=7, chunk=64)  # chunking changes nothing


def synthetic_sequences(rng, n: int, k3_mean: float):
    """Sequences whose tokens' K3 are exponential with mean ``k3_mean``: the population k3_kl (a
    ratio of means) is exactly ``k3_mean``; max |dp| is uniform on [0, 0.4], mean 0.2."""
    n_tokens = rng.integers(1, 60, n).astype(np.float64)
    return {
        "n_tokens": n_tokens,
        "k3_sum": rng.gamma(n_tokens, k3_mean),
        "max_mismatch": rng.uniform(0, 0.4, n),
    }


def test_intervals_cover_the_truth_in_at_least_90_percent_of_200_trials():
    rng = np.random.default_rng(0)
    covered = {"k3_kl": 0, "seq_max_mismatch_mean": 0}
    for trial in range(200):
        cols = synthetic_sequences(rng, 150, 2e-3)
        got = bootstrap_intervals(cols, list(covered), n_boot=400, seed=trial)
        covered["k3_kl"] += got["k3_kl"].covers(2e-3)
        covered["seq_max_mismatch_mean"] += got["seq_max_mismatch_mean"].covers(0.2)
    assert covered["k3_kl"] >= 180 and covered["seq_max_mismatch_mean"] >= 180, covered


def test_paired_intervals_cover_a_known_difference_and_call_no_difference_within_noise():
    """Side b re-scores a's sequences with a setting that multiplies every token's K3 by 1.5 (plus
    per-sequence noise of mean 0): the truth is k3(b) - k3(a) = 0.5 * 2e-3, ratio 1.5."""
    rng = np.random.default_rng(1)
    covered_diff = covered_ratio = zero_within_noise = 0
    for trial in range(200):
        a = synthetic_sequences(rng, 150, 2e-3)
        noise = rng.normal(0, 0.02, 150) * a["k3_sum"]
        b = {**a, "k3_sum": 1.5 * a["k3_sum"] + noise}
        got = paired_intervals(a, b, ["k3_kl"], n_boot=400, seed=trial)["k3_kl"]
        covered_diff += got.difference.covers(1e-3)
        covered_ratio += got.ratio.covers(1.5)
        same = paired_intervals(a, {**a, "k3_sum": a["k3_sum"] + noise}, ["k3_kl"], n_boot=400, seed=trial)
        zero_within_noise += same["k3_kl"].difference.covers(0.0)
    assert covered_diff >= 180 and covered_ratio >= 180 and zero_within_noise >= 180, (
        covered_diff,
        covered_ratio,
        zero_within_noise,
    )


def test_pairing_removes_the_noise_the_two_sides_share():
    """A 2% effect on the same sequences: the two runs' own intervals overlap (compared unpaired it
    would read as noise), the paired difference excludes 0."""
    rng = np.random.default_rng(2)
    a = synthetic_sequences(rng, 300, 2e-3)
    b = {**a, "k3_sum": 1.02 * a["k3_sum"] + rng.normal(0, 1e-3, 300) * a["k3_sum"]}
    own_a = bootstrap_intervals(a, ["k3_kl"], n_boot=500)["k3_kl"]
    own_b = bootstrap_intervals(b, ["k3_kl"], n_boot=500, seed=1)["k3_kl"]
    assert own_b.low < own_a.high  # they overlap
    paired = paired_intervals(a, b, ["k3_kl"], n_boot=500)["k3_kl"]
    assert paired.difference.low > 0 and paired.ratio.covers(1.02) and paired.ratio.low > 1.0


def test_the_drawn_maximum_equals_a_max_over_every_drawn_sequence():
    """_drawn_max looks at the largest values first and further only for the rows that need it;
    with a head of 2 most rows take the long way, and every row matches the brute-force max."""
    from mismatch_probe.analysis.intervals import _drawn_max

    rng = np.random.default_rng(5)
    value = rng.uniform(0, 1, 300)
    value[[3, 7]] = np.nan  # missing: never the max
    value[9] = -np.inf
    weights = (rng.random((500, 300)) < 0.02).astype(np.float64)
    weights[0] = 0.0  # draws nothing
    weights[1] = 0.0
    weights[1, [3, 9]] = 1.0  # draws only a missing value and -inf
    order = np.flatnonzero(~np.isnan(value))
    order = order[np.argsort(-value[order], kind="stable")]
    for head in (2, 64):
        got = _drawn_max(weights, order, value[order], head=head)
        filled = np.where((weights > 0) & ~np.isnan(value), value, -np.inf).max(axis=1)
        want = np.where(np.isneginf(filled), np.nan, filled)
        np.testing.assert_array_equal(got, want)

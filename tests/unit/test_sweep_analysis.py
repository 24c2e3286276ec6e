"""What a sweep concludes (analysis.sweep, analysis.intervals.unpaired_intervals): effects against a
float64 recomputation, interval coverage on synthetic data with a known difference, the noise
floor, cost and the recommendation by hand, and the determinism comparison bit by bit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mismatch_probe.analysis.intervals import unpaired_intervals
from mismatch_probe.analysis.metrics import MetricsAccumulator
from mismatch_probe.analysis.sequences import SequenceIds, group_columns, sequence_table
from mismatch_probe.analysis.sweep import (
    COST_RESOLUTION,
    attribution,
    compare_logprobs,
    cost,
    effects,
    noise_floor,
    recommend,
)
from mismatch_probe.analysis.terms import segment_starts


def run_columns(sample, lt, li):
    ids, acc = SequenceIds(), MetricsAccumulator()
    starts = segment_starts(sample)
    ids.add(sample, None, starts)
    acc.add(lt, li, starts)
    return group_columns(sequence_table({"all": (ids, acc)}), "all")


def tokens(seed: int, n_seq: int = 60, scale: float = 0.05):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 40, n_seq)
    sample = np.repeat(np.arange(n_seq), lengths)
    li = np.log(rng.beta(2, 0.6, len(sample)))
    lt = np.minimum(li + rng.normal(0, scale, len(sample)) * rng.random(len(sample)) ** 2, 0.0)
    return sample, lt, li


def k3_float64(lt, li) -> float:
    """K3 = exp(d) - 1 - d with d = log p_train - log p_infer, over tokens, in float64 (ARCHITECTURE.md, Metrics)."""
    d = np.asarray(lt, np.float64) - np.asarray(li, np.float64)
    return float(np.mean(np.expm1(d) - d))


def test_paired_effect_is_the_float64_difference_and_ratio_of_the_two_scorings():
    sample, lt, li = tokens(0)
    rng = np.random.default_rng(1)
    lt_b = np.minimum(li + 3 * (lt - li) + rng.normal(0, 1e-3, len(li)), 0.0)  # the same tokens, re-scored
    a, b = run_columns(sample, lt, li), run_columns(sample, lt_b, li)
    found = effects(a, b, paired=True, n_boot=300)
    truth_a, truth_b = k3_float64(lt, li), k3_float64(lt_b, li)
    diff, ratio = found["k3_kl"]["difference"], found["k3_kl"]["ratio"]
    assert diff[0] == pytest.approx(truth_b - truth_a, rel=1e-10)
    assert ratio[0] == pytest.approx(truth_b / truth_a, rel=1e-10)
    assert diff[1] <= diff[0] <= diff[2] and ratio[1] <= ratio[0] <= ratio[2]
    assert found["k3_kl"]["paired"] and not found["k3_kl"]["within_noise"]  # ~9x: far outside noise
    # max |p_train - p_infer| over tokens, by hand
    pmax = float(np.max(np.abs(np.exp(lt_b) - np.exp(li))))
    assert found["prob_diff_max"]["difference"][0] + float(np.max(np.abs(np.exp(lt) - np.exp(li)))) == pytest.approx(
        pmax, rel=1e-12
    )
    mult = float(np.mean(np.exp(np.abs(lt_b.astype(np.float64) - li))))
    assert found["mult_prob_error"]["ratio"][0] * float(np.mean(np.exp(np.abs(lt - li)))) == pytest.approx(
        mult, rel=1e-12
    )


def test_a_reference_setting_that_changes_nothing_is_within_noise():
    sample, lt, li = tokens(2)
    a = run_columns(sample, lt, li)
    found = effects(a, a, paired=True, n_boot=200)
    assert all(e["within_noise"] for e in found.values())
    assert found["k3_kl"]["ratio"] == [1.0, 1.0, 1.0]


def test_unpaired_intervals_cover_the_true_difference_in_at_least_90_percent_of_200_trials():
    """Synthetic runs whose true K3 is known: per-sequence K3 sums drawn around k * n_tokens. The
    point's truth is 1.5x the baseline's; the baseline has three repeats (independent draws)."""
    base_k3, factor = 2e-4, 1.5

    def draw(rng, k3):
        n_tokens = rng.integers(5, 60, 120)
        return {
            "n_tokens": n_tokens,
            "k3_sum": rng.gamma(2.0, k3 * n_tokens / 2.0),  # mean k3 * n_tokens
        }

    covered_diff = covered_ratio = 0
    for trial in range(200):
        rng = np.random.default_rng(1000 + trial)
        repeats = [draw(rng, base_k3) for _ in range(3)]
        point = draw(rng, factor * base_k3)
        (found,) = [unpaired_intervals(repeats, point, ["k3_kl"], n_boot=300, seed=trial)["k3_kl"]]
        covered_diff += found.difference.covers((factor - 1) * base_k3)
        covered_ratio += found.ratio.covers(factor)
    assert covered_diff >= 180 and covered_ratio >= 180, (covered_diff, covered_ratio)


def test_unpaired_interval_is_wider_when_the_repeats_disagree():
    rng = np.random.default_rng(5)
    n = rng.integers(5, 60, 200)

    def run(k3):
        return {"n_tokens": n, "k3_sum": rng.gamma(2.0, k3 * n / 2.0)}

    point = run(2e-4)
    calm = unpaired_intervals([run(2e-4), run(2e-4), run(2e-4)], point, ["k3_kl"], n_boot=400)["k3_kl"]
    noisy = unpaired_intervals([run(1e-4), run(2e-4), run(4e-4)], point, ["k3_kl"], n_boot=400)["k3_kl"]
    width = lambda i: i.difference.high - i.difference.low
    assert width(noisy) > 1.5 * width(calm)


def test_noise_floor_by_hand():
    floor = noise_floor([{"k3_kl": 1e-4}, {"k3_kl": 2e-4}, {"k3_kl": 3e-4}, {"k3_kl": None}], ["k3_kl", "missing"])
    f = floor["k3_kl"]
    assert f["n_repeats"] == 3 and f["mean"] == pytest.approx(2e-4)
    assert f["std"] == pytest.approx(1e-4) and f["relative_std"] == pytest.approx(0.5)
    assert f["max_over_min"] == pytest.approx(3.0)
    assert floor["missing"] == {"values": [None, None, None, None], "n_repeats": 0}
    assert "std" not in noise_floor([{"k3_kl": 1e-4}], ["k3_kl"])["k3_kl"]  # one repeat: no spread


def test_cost_is_the_larger_slowdown_of_engine_and_reference():
    base = [
        {"engine_tokens_per_s": 200.0, "reference_tokens_per_s": 1000.0},
        {"engine_tokens_per_s": 180.0, "reference_tokens_per_s": 1100.0},
        {"engine_tokens_per_s": 220.0, "reference_tokens_per_s": 900.0},
    ]
    c = cost({"engine_tokens_per_s": 150.0, "reference_tokens_per_s": 800.0}, base)
    assert c["engine_relative"] == pytest.approx(0.75) and c["reference_relative"] == pytest.approx(0.8)
    assert c["cost"] == pytest.approx(0.25)  # median 200 -> 150 on the engine; 1000 -> 800 on the reference
    # no slower than the slowest repeat (less the resolution): timing noise, no cost
    within = cost({"engine_tokens_per_s": 180.0 * (1 - COST_RESOLUTION / 2), "reference_tokens_per_s": 950.0}, base)
    assert within["cost"] == 0.0 and within["engine_relative"] < 1.0
    assert cost({"engine_tokens_per_s": 400.0, "reference_tokens_per_s": 2000.0}, base)["cost"] == 0.0  # faster
    assert cost({"engine_tokens_per_s": None, "reference_tokens_per_s": 900.0}, base)["cost"] is None
    # a reference-only change: the engine side is the baseline's own, whatever its timing says
    ref_only = cost({"engine_tokens_per_s": 100.0, "reference_tokens_per_s": 500.0}, base, changed={"reference"})
    assert ref_only["engine_relative"] == pytest.approx(0.5) and ref_only["cost"] == pytest.approx(0.5)
    assert cost({"engine_tokens_per_s": 100.0, "reference_tokens_per_s": 500.0}, base, changed=())["cost"] == 0.0


def _p(name, gate, c, k3=1e-5, status="ok", settings=None):
    return {
        "name": name,
        "status": status,
        "gate": gate,
        "cost": c,
        "metrics": {"k3_kl": k3},
        "settings": settings or {name: True},
    }


def test_recommendation_is_the_baseline_when_it_passes():
    rec = recommend([_p("baseline", "PASS", 0.0), _p("a", "PASS", 0.0)])
    assert rec["point"] == "baseline" and rec["passes"] and rec["settings"] == {}


def test_recommendation_is_the_cheapest_passing_change_with_ties_to_the_lower_metric():
    points = [
        _p("baseline", "FAIL", 0.0),
        _p("fast-fail", "FAIL", 0.0),
        _p("dear", "PASS", 0.30),
        _p("cheap", "WARN", 0.04, k3=3e-6),
        _p("cheap-better", "PASS", 0.04, k3=1e-6),
        _p("unknown", "PASS", None),
        _p("refused", None, None, status="refused"),
    ]
    rec = recommend(points)
    assert rec["point"] == "cheap-better" and rec["passes"] and rec["cost"] == 0.04
    assert set(rec["passing"]) == {"dear", "cheap", "cheap-better", "unknown"}
    assert set(rec["failing"]) == {"baseline", "fast-fail"}
    only_unknown = recommend([_p("baseline", "FAIL", 0.0), _p("unknown", "PASS", None)])
    assert only_unknown["point"] == "unknown"  # unknown cost is last, but still a recommendation
    none = recommend([_p("baseline", "FAIL", 0.0), _p("a", "FAIL", 0.0)])
    assert none["point"] is None and not none["passes"]


def test_attribution_puts_effects_outside_noise_first_largest_first():
    def point(name, ratio, noise):
        return {"name": name, "delta_vs_baseline": {"k3_kl": {"ratio": [ratio, ratio, ratio], "within_noise": noise}}}

    rows = attribution(
        [point("small", 1.2, False), point("none", 1.01, True), point("big", 0.1, False), {"name": "refused"}]
    )
    assert [r["name"] for r in rows] == ["big", "small", "none"]


def test_compare_logprobs_is_bitwise():
    a = [np.array([-0.5, -1.0, 0.0], np.float32), np.array([-2.0], np.float32)]
    b = [
        np.array([-0.5, np.nextafter(np.float32(-1.0), np.float32(0)), -0.0], np.float32),
        np.array([-2.0], np.float32),
    ]
    c = compare_logprobs(a, b)
    assert c["n_tokens"] == 4
    assert c["bitwise_equal_share"] == pytest.approx(0.5)  # -0.0 is not the bits of 0.0
    assert c["max_abs_delta"] == pytest.approx(
        float(np.float32(-1.0) - np.nextafter(np.float32(-1.0), np.float32(0))) * -1
    )
    assert compare_logprobs(a, a) == {"n_tokens": 4, "bitwise_equal_share": 1.0, "max_abs_delta": 0.0}
    assert compare_logprobs([], [])["bitwise_equal_share"] is None
    with pytest.raises(ValueError):
        compare_logprobs(a, a[:1])


def test_unpaired_estimate_is_against_the_mean_of_the_repeats():
    sample, lt, li = tokens(7)
    sample2, lt2, li2 = tokens(8)
    r1, r2 = run_columns(sample, lt, li), run_columns(sample2, lt2, li2)
    found = unpaired_intervals([r1, r2], r1, ["k3_kl"], n_boot=200)["k3_kl"]
    mean = (k3_float64(lt, li) + k3_float64(lt2, li2)) / 2
    assert found.difference.estimate == pytest.approx(k3_float64(lt, li) - mean, rel=1e-9)
    assert math.isclose(found.ratio.estimate, k3_float64(lt, li) / mean, rel_tol=1e-9)

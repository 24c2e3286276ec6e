"""Adaptive sample size (--precision): K3's interval after a round against a percentile bootstrap
written out here in float64, the relative half-width and the samples it asks for worked by hand, each
budget's cap, the rounds' shards, and the report's table and figure of an adaptive run."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from mismatch_probe.analysis.intervals import Interval, run_intervals
from mismatch_probe.analysis.precision import (
    MAX_GROWTH,
    ROUND_MARGIN,
    Budget,
    Spent,
    k3_interval,
    next_round,
    outcome_line,
    relative_half_width,
    samples_needed,
    sequence_k3,
)
from mismatch_probe.analysis.terms import segment_starts, sequence_terms, token_terms
from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.pipeline.adaptive import budget_of, first_round, round_shards
from mismatch_probe.pipeline.runs import SampleRef, shard_samples


def _tokens(rng, n_seq: int, max_len: int = 30):
    lengths = rng.integers(1, max_len, n_seq)
    sample_id = np.repeat(np.arange(n_seq), lengths)
    li = np.log(rng.uniform(0.01, 1.0, len(sample_id)))
    lt = li + rng.normal(0, 0.05, len(sample_id))
    return lt, li, sample_id, lengths


def test_sequence_k3_is_each_sequences_sum_of_exp_delta_minus_1_minus_delta():
    lt, li, sid, lengths = _tokens(np.random.default_rng(1), 20)
    k3_sum, n_tokens = sequence_k3(lt, li, sid)
    assert n_tokens.tolist() == lengths.tolist()
    for s in range(20):
        d = [float(a) - float(b) for a, b in zip(lt[sid == s], li[sid == s])]
        expected = sum(math.expm1(x) - x for x in d)
        assert k3_sum[s] == pytest.approx(expected, rel=1e-12)
    empty = sequence_k3(np.zeros(0), np.zeros(0), np.zeros(0, np.int64))
    assert len(empty[0]) == len(empty[1]) == 0


def test_k3_interval_is_the_percentile_bootstrap_over_sequences_and_the_runs_own():
    """Written out: 2,000 draws of the n sequences with replacement (seed 0), K3 of each draw as
    sum(k3) / sum(tokens), the 2.5th and 97.5th percentiles (nearest). The same interval as
    run.json's ``intervals`` gives K3 once the run is analyzed."""
    lt, li, sid, _ = _tokens(np.random.default_rng(2), 150)
    k3_sum, n_tokens = sequence_k3(lt, li, sid)
    found = k3_interval(k3_sum, n_tokens)
    n = len(k3_sum)
    draws = np.random.default_rng(0).integers(0, n, (2000, n))
    replicates = k3_sum[draws].sum(axis=1) / n_tokens[draws].sum(axis=1)
    lo, hi = np.quantile(replicates, [0.025, 0.975], method="nearest")
    assert found.estimate == pytest.approx(k3_sum.sum() / n_tokens.sum(), rel=1e-12)
    assert found.low == pytest.approx(lo, rel=1e-12) and found.high == pytest.approx(hi, rel=1e-12)
    # every metric's interval from the same draws, as the analyze stage computes them
    full = run_intervals(sequence_terms(token_terms(lt, li), lt, li, segment_starts(sid))._asdict())
    assert full is not None  # the same numbers up to the last bit (the matrix product sums in blocks)
    assert full["metrics"]["k3_kl"] == pytest.approx([found.estimate, found.low, found.high], rel=1e-12)


def test_the_relative_half_width_shrinks_as_one_over_root_n():
    lt, li, sid, _ = _tokens(np.random.default_rng(3), 400)
    k3_sum, n_tokens = sequence_k3(lt, li, sid)
    r1 = relative_half_width(k3_interval(k3_sum[:100], n_tokens[:100]))
    r4 = relative_half_width(k3_interval(k3_sum, n_tokens))
    assert r4 == pytest.approx(r1 / 2, rel=0.35)  # 4x the sequences: half the width, up to sampling noise


def test_relative_half_width_by_hand_and_its_edges():
    assert relative_half_width(Interval(2e-4, 1.8e-4, 2.3e-4)) == pytest.approx(0.125, rel=1e-12)
    assert relative_half_width(Interval(0.0, 0.0, 0.0)) == 0.0  # identical sides: nothing left to sample
    assert math.isinf(relative_half_width(Interval(0.0, 0.0, 1e-9)))
    assert math.isnan(relative_half_width(Interval(math.inf, 1.0, math.inf)))  # a p = 0 token


@pytest.mark.parametrize(
    ("n", "relative", "target", "expected"),
    [(64, 0.2, 0.1, 256), (64, 0.15, 0.1, 144), (100, 0.101, 0.1, 103), (64, 0.05, 0.1, 64), (7, math.nan, 0.1, None)],
)
def test_samples_needed_is_n_times_the_squared_ratio_rounded_up(n, relative, target, expected):
    assert samples_needed(n, relative, target) == expected


def test_next_round_met_grows_at_most_3x_in_whole_groups():
    budget = Budget(10_000)
    assert next_round(0.08, 0.1, Spent(64, 900, 3.0), budget) == (0, None, 64, True)
    # 100 x 1.5^2 = 225 needed, drawn with the 20% margin: 270 in all, 170 more -> whole groups of 4: 172
    assert ROUND_MARGIN == 1.2
    assert next_round(0.15, 0.1, Spent(100, 900, 3.0), budget, n_per_prompt=4) == (172, None, 225, False)
    # ceil(100 x 1.3^2) = 169 needed: ceil(202.8) = 203 in all, 103 more -> whole groups of 3: 105
    assert next_round(0.13, 0.1, Spent(100, 900, 3.0), budget, n_per_prompt=3) == (105, None, 169, False)
    # needs 6,400: capped at 3x the 64 so far
    assert next_round(1.0, 0.1, Spent(64, 900, 3.0), budget).samples == MAX_GROWTH * 64


def test_each_budget_caps_the_round_by_this_runs_cost_per_sample():
    spent = Spent(samples=100, tokens=2_000, seconds=10.0)  # 20 tokens and 0.1 s a sample
    assert next_round(0.2, 0.1, spent, Budget(150), n_per_prompt=4).samples == 48  # 50 left, whole groups
    # 1,000 tokens left / 20 a sample = 50 samples
    assert next_round(0.2, 0.1, spent, Budget(10_000, tokens=3_000)).samples == 50
    # 2 s left / 0.1 s a sample = 20 samples
    assert next_round(0.2, 0.1, spent, Budget(10_000, seconds=12.0)).samples == 20
    spent_all = next_round(0.2, 0.1, spent, Budget(102, tokens=3_000), n_per_prompt=4)
    assert spent_all == (0, "the budget max_samples = 102 is spent", 400, False)
    tokens = next_round(0.2, 0.1, spent, Budget(10_000, tokens=2_010))
    assert tokens.stop == "the budget token_budget = 2010 is spent" and tokens.needed == 400
    infinite = next_round(math.nan, 0.1, spent, Budget(10_000))
    assert infinite.samples == 0 and not infinite.met and infinite.needed is None and "infinite" in infinite.stop


def test_rounds_are_sharded_each_on_its_own_and_past_the_prompts_start_again():
    # 3 prompts x n = 2: round 1 is samples 0-5; rounds of 4 and 6 more answer the prompts again
    shards = shard_samples(16, 2, 4, n_prompts=3, rounds=[6, 4, 6])
    assert [[s.sample_id for s in shard] for shard in shards] == [
        [0, 1, 2, 3],
        [4, 5],
        [6, 7, 8, 9],
        [10, 11, 12, 13],
        [14, 15],
    ]
    assert [s.prompt_index for shard in shards for s in shard] == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2, 0, 0, 1, 1]
    # adding a round leaves the shards of the earlier ones as they were
    assert shard_samples(10, 2, 4, n_prompts=3, rounds=[6, 4]) == shards[:3]
    assert [list(r) for r in round_shards([6, 4, 6], 4)] == [[0, 1], [2], [3, 4]]
    # without rounds: the one round of a fixed-size run, as before
    assert shard_samples(5, 1, 2) == [
        [SampleRef(0, 0), SampleRef(1, 1)],
        [SampleRef(2, 2), SampleRef(3, 3)],
        [SampleRef(4, 4)],
    ]


def _spec(**sampling):
    return ProbeSpec.model_validate({"model": "m", "prompts": "p.jsonl", "sampling": {"n": 4, **sampling}})


def test_the_budget_defaults_to_ten_first_rounds_and_a_low_max_samples_trims_the_first():
    assert budget_of(_spec(precision=0.1), 32) == Budget(1280, None, None)
    assert first_round(_spec(precision=0.1), 32) == 128
    assert first_round(_spec(precision=0.1, max_samples=50), 32) == 48  # whole groups of n = 4
    assert first_round(_spec(precision=0.1, max_samples=2), 32) == 4  # at least one group


@pytest.mark.parametrize("budget", ["max_samples", "token_budget", "time_budget"])
def test_a_budget_without_precision_is_refused(budget):
    with pytest.raises(ValidationError, match=f"sampling.{budget} is a budget of the adaptive sample size"):
        _spec(**{budget: 10})


def _state(met, stop=None, more=None):
    row = {"round": 2, "samples_total": 300, "k3_kl": 5.69e-5, "relative_half_width": 0.0998}
    return {"target": 0.1, "rounds": [row, row], "met": met, "stop": stop, "more_samples_needed": more}


def test_the_outcome_in_one_line():
    assert outcome_line(_state(True)) == "precision met: K3 5.69e-05 ±9.98% on 300 samples in 2 rounds (target ±10%)"
    assert outcome_line(_state(False, "the budget max_samples = 300 is spent", 420)) == (
        "precision not met: K3 5.69e-05 ±9.98% on 300 samples in 2 rounds (target ±10%): "
        "the budget max_samples = 300 is spent; 420 more samples estimated"
    )
    assert outcome_line(_state(None)).startswith("precision so far: ")


def test_an_adaptive_runs_report_has_its_rounds_in_a_table_a_figure_and_the_outcome(tmp_path):
    from pathlib import Path

    from report_runs import synthetic_run
    from test_figures import assert_inert_svg

    from mismatch_probe.report.figures import run_figures
    from mismatch_probe.report.markdown import render_run
    from mismatch_probe.report.run_view import run_view

    record, dist = synthetic_run(2000)
    plain = [f.info.id for f in run_figures(record, dist)]
    assert "precision_rounds" not in plain and run_view(record, Path(tmp_path), dist).precision is None
    rounds = [
        {"round": 1, "samples": 64, "samples_total": 64, "tokens_total": 900, "seconds_total": 2.0, "k3_kl": 6e-5,
         "low": 4.5e-5, "high": 7.4e-5, "relative_half_width": 0.2417, "samples_needed": 374, "met": False},
        {"round": 2, "samples": 192, "samples_total": 256, "tokens_total": 3500, "seconds_total": 6.5, "k3_kl": 5.5e-5,
         "low": 4.9e-5, "high": 6.1e-5, "relative_half_width": 0.109, "samples_needed": 305, "met": False},
    ]  # fmt: skip
    record.precision = {
        "target": 0.1, "level": 0.95, "rounds": rounds, "met": False,
        "stop": "the budget max_samples = 256 is spent", "samples_needed": 305, "more_samples_needed": 49,
        "budget": {"max_samples": 256, "token_budget": None, "time_budget": None},
    }  # fmt: skip
    figures = {f.info.id: f for f in run_figures(record, dist)}
    assert list(figures) == [*plain, "precision_rounds"]
    assert_inert_svg(figures["precision_rounds"].svg)
    view = run_view(record, Path(tmp_path), dist)
    assert view.precision is not None and [r.cells[:3] for r in view.precision.rows] == [
        ["1", "64", "64"],
        ["2", "192", "256"],
    ]
    assert view.precision_outcome == (
        "precision not met: K3 5.5e-05 ±10.9% on 256 samples in 2 rounds (target ±10%): "
        "the budget max_samples = 256 is spent; 49 more samples estimated"
    )
    assert "Precision not met: K3 5.5e-05 ±10.9% on 256 samples" in render_run(view)  # the section's lead

"""The checks every imported sample passes (dumps/samples.py) and the format registry, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_probe.dumps import get_format
from mismatch_probe.dumps.base import pick_step
from mismatch_probe.dumps.samples import DumpSample, infer_turns, prompt_key, scatter_to_full, to_rollout
from mismatch_probe.errors import ConfigError

NAN = np.nan


def sample(**kw) -> DumpSample:
    base = {
        "where": "dump.pt, sample 7",
        "token_ids": np.array([5, 6, 7, 8, 9, 10]),
        "model_mask": np.array([0, 0, 1, 1, 0, 1]),
        "logp_engine": np.array([-0.5, -0.25, -1.5]),
    }
    return DumpSample(**(base | kw))


def test_turns_are_runs_of_model_tokens():
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=bool)
    assert infer_turns(mask).tolist() == [-1, -1, 0, 0, -1, -1, 1, -1, 2, 2]
    assert infer_turns(np.zeros(3, bool)).tolist() == [-1, -1, -1]
    assert infer_turns(np.array([0, 1, 1, 1], bool)).tolist() == [-1, 0, 0, 0]


def test_log_probs_one_per_model_token_or_one_per_token():
    mask = np.array([0, 1, 0, 1], dtype=bool)
    np.testing.assert_array_equal(scatter_to_full([-1.0, -2.0], mask, "x", "w"), [NAN, -1.0, NAN, -2.0])
    np.testing.assert_array_equal(scatter_to_full([9, -1.0, 9, -2.0], mask, "x", "w"), [9, -1.0, 9, -2.0])
    with pytest.raises(ConfigError, match=r"^w: 3 engine log-probs for 2 model tokens \(4 tokens in all\)"):
        scatter_to_full([-1.0, -2.0, -3.0], mask, "engine log-probs", "w")


def test_a_checked_sample_is_the_rollout_the_engine_would_have_written():
    checked = to_rollout(sample(logp_trainer=np.array([-0.4, -0.3, -1.0])), 3, vocab_size=11)
    r = checked.rollout
    assert r.sample_id == 3 and r.token_ids.dtype == np.int32 and r.token_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert r.is_model_token.tolist() == [False, False, True, True, False, True]
    assert r.turn.tolist() == [-1, -1, 0, 0, -1, 1]
    np.testing.assert_array_equal(r.logp_infer, np.array([NAN, NAN, -0.5, -0.25, NAN, -1.5], np.float32))
    np.testing.assert_array_equal(checked.logp_trainer, np.array([NAN, NAN, -0.4, -0.3, NAN, -1.0], np.float32))
    assert r.prompt_id == prompt_key(r.token_ids, r.is_model_token) and r.finish_reason == "unknown"


def test_a_log_prob_rounded_just_above_zero_is_zero():
    r = to_rollout(sample(logp_engine=np.array([2e-4, -0.25, -1.5])), 0, vocab_size=11).rollout
    assert r.logp_infer[2] == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"token_ids": np.array([5, 6, 7, 8, 11, 10])},
            r"token id 11 is outside the checkpoint's vocabulary \(0..10\)",
        ),
        ({"token_ids": np.array([5, 6, -1, 8, 9, 10])}, r"token id -1 is outside"),
        ({"token_ids": np.array([5, 6, 7.5, 8, 9, 10])}, r"token ids are not all integers"),
        ({"token_ids": np.array([5, 6, None, 8, 9, 10], dtype=object)}, r"token ids are not all integers"),
        ({"model_mask": np.array([0, 1, 1, 0, 1])}, r"the model-token mask has 5 entries for 6 tokens"),
        (
            {"model_mask": np.array([1, 0, 1, 1, 0, 0]), "logp_engine": np.array([-1.0, -1, -1])},
            r"the first token is marked",
        ),
        ({"logp_engine": np.array([-0.5, -0.25])}, r"2 engine log-probs for 3 model tokens"),
        ({"logp_engine": np.array([-0.5, NAN, -1.5])}, r"the engine log-prob of the token at position 3 is nan"),
        ({"logp_engine": np.array([-0.5, -0.25, 0.3])}, r"the engine log-prob of the token at position 5 is 0.3"),
        ({"logp_trainer": np.array([-0.5, -np.inf, -1.5])}, r"the trainer log-prob of the token at position 3 is -inf"),
        ({"turn": np.array([-1, -1, 0, -1, -1, 1])}, r"a model token has turn -1"),
        ({"turn": np.array([0, 0, 0])}, r"3 turn ids for 6 tokens"),
        ({"experts": np.zeros((4, 2, 2))}, r"routed experts have shape \[4, 2, 2\]; expected \[5 or 6 positions"),
        ({"experts": np.full((5, 2, 2), 8)}, r"routed expert ids span 8..8; the checkpoint has 8 experts"),
    ],
)
def test_a_bad_sample_is_refused_naming_it(change, message):
    with pytest.raises(ConfigError, match=r"^dump.pt, sample 7: " + message) as err:
        to_rollout(sample(**change), 0, vocab_size=11, num_experts=8)
    assert err.value.exit_code == 2


def test_given_turns_are_kept_and_tool_tokens_get_minus_one():
    r = to_rollout(sample(turn=np.array([4, 4, 0, 0, 4, 0])), 0, vocab_size=11).rollout
    assert r.turn.tolist() == [-1, -1, 0, 0, -1, 0]  # one turn, as the dump says (no tool call between)


def test_the_routing_behind_a_token_is_that_of_the_input_before_it():
    experts = np.arange(5 * 2 * 2).reshape(5, 2, 2)[:, :, ::-1]  # row i: input position i, ids unsorted
    r = to_rollout(sample(experts=experts), 0, vocab_size=11, num_experts=64).rollout
    # model tokens at 2, 3, 5 -> rows 1, 2, 4, each layer's ids sorted
    np.testing.assert_array_equal(r.experts_infer, np.sort(experts[[1, 2, 4]], axis=-1))
    assert r.experts_infer.dtype == np.int16
    full = np.concatenate([experts, experts[-1:]])  # one row per token: the last is never an input
    np.testing.assert_array_equal(
        to_rollout(sample(experts=full), 0, vocab_size=11).rollout.experts_infer, r.experts_infer
    )


def test_samples_of_one_prompt_share_a_prompt_key():
    a = prompt_key(np.array([1, 2, 3, 9]), np.array([0, 0, 0, 1], bool))
    assert a == prompt_key(np.array([1, 2, 3, 4, 4]), np.array([0, 0, 0, 1, 1], bool))
    assert a != prompt_key(np.array([1, 2, 4, 9]), np.array([0, 0, 0, 1], bool))


def test_formats_by_name_and_alias():
    assert get_format("NeMo_RL").name == get_format("nemo").name == "nemo-rl"
    with pytest.raises(ConfigError, match=r"unknown dump format 'slim' \(did you mean 'slime'\?\)"):
        get_format("slim")
    with pytest.raises(ConfigError, match=r"choose one of slime, nemo-rl, verl, generic"):
        get_format("openrlhf")


def test_a_step_is_picked_or_asked_for(tmp_path):
    grouped = {3: [tmp_path / "3.pt"], 7: [tmp_path / "7.pt"]}
    with pytest.raises(ConfigError, match=r"holds x of 2 steps \(3, 7\) \(pass --step N"):
        pick_step(grouped, None, tmp_path, "x", one_run="-")
    assert pick_step(grouped, 7, tmp_path, "x", one_run="-") == (7, tmp_path / "7.pt")
    assert pick_step({3: grouped[3]}, None, tmp_path, "x", one_run="-")[0] == 3
    with pytest.raises(ConfigError, match=r"has no x of step 5 \(its steps: 3, 7\)"):
        pick_step(grouped, 5, tmp_path, "x", one_run="-")
    two_runs = {3: [tmp_path / "a" / "3.pt", tmp_path / "b" / "3.pt"]}
    with pytest.raises(ConfigError, match=r"holds step 3 of 2 runs: .*a/3.pt, .*b/3.pt \(pick one\)"):
        pick_step(two_runs, None, tmp_path, "x", one_run="pick one")

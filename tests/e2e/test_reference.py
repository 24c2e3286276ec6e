"""The training-style reference forward, for real on the fixture."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DENSE, MOE
from reference_checks import RAW, independent, make_rollouts

from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.errors import DataError
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference.scorer import ReferenceScorer


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_fp32_logprobs_and_entropy_match_independent_forward(model, packing):
    rollouts = make_rollouts()
    scorer = ReferenceScorer(model, ReferenceSpec(dtype="float32", packing=packing, micro_batch_size=3))
    scores = scorer.score(rollouts, RAW)
    lps, ents = scores.logp, scores.entropy
    want_lp, want_ent = independent(model, rollouts)
    for r, lp, ent, wl, we in zip(rollouts, lps, ents, want_lp, want_ent):
        assert np.isnan(lp[~r.is_model_token]).all() and np.isnan(ent[~r.is_model_token]).all()
        assert np.allclose(lp[r.is_model_token], wl, atol=2e-5)
        assert np.allclose(ent[r.is_model_token], we, atol=2e-5)
    scorer.close()


def test_packed_and_padded_agree_in_fp32():
    rollouts = make_rollouts(8, seed=1)
    packed = ReferenceScorer(DENSE, ReferenceSpec(dtype="float32", packing=True, max_tokens_per_micro_batch=64))
    padded = ReferenceScorer(DENSE, ReferenceSpec(dtype="float32", packing=False, micro_batch_size=4))
    a = packed.score(rollouts, RAW).logp
    b = padded.score(rollouts, RAW).logp
    for x, y in zip(a, b):
        assert np.allclose(x, y, atol=1e-5, equal_nan=True)


def test_token_budget_splits_packed_micro_batches():
    scorer = ReferenceScorer(
        DENSE, ReferenceSpec(dtype="float32", packing=True, micro_batch_size=10, max_tokens_per_micro_batch=40)
    )
    rollouts = make_rollouts(6, seed=2)
    batches = list(scorer.micro_batches(rollouts))
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or sum(len(rollouts[i].token_ids) for i in b) <= 40


def test_processed_semantics_score_the_tempered_distribution():
    rollouts = make_rollouts(3, seed=3)
    scorer = ReferenceScorer(DENSE, ReferenceSpec(dtype="float32"))
    lps = scorer.score(rollouts, LogprobSemantics("processed", temperature=0.7)).logp
    want, _ = independent(DENSE, rollouts, temperature=0.7)
    for r, lp, w in zip(rollouts, lps, want):
        assert np.allclose(lp[r.is_model_token], w, atol=2e-5)


def test_bf16_reference_and_fp32_logits():
    rollouts = make_rollouts(4, seed=4)
    exact, _ = independent(DENSE, rollouts)
    errs = {}
    for fp32_logits in (False, True):
        s = ReferenceScorer(DENSE, ReferenceSpec(dtype="bfloat16", logits_fp32=fp32_logits))
        lps = s.score(rollouts, RAW).logp
        errs[fp32_logits] = max(np.abs(lp[r.is_model_token] - w).max() for r, lp, w in zip(rollouts, lps, exact))
        assert s.info()["logits_fp32"] is fp32_logits
    assert 1e-4 < errs[False] < 1.0  # bf16 is measurably off, not broken
    assert errs[True] != errs[False]


def test_first_token_cannot_be_a_model_token():
    r = make_rollouts(1)[0]
    r.is_model_token[0] = True
    scorer = ReferenceScorer(DENSE, ReferenceSpec(dtype="float32"))
    with pytest.raises(DataError, match="first token"):
        scorer.score([r], RAW)

"""The training-style reference forward, for real on the fixture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DENSE, MOE

from mismatch_probe.config.spec import ReferenceSpec
from mismatch_probe.engines import ScoreRequest
from mismatch_probe.errors import DataError
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference.scorer import ReferenceScorer
from mismatch_probe.table.tokens import Rollout

pytestmark = pytest.mark.slow
RAW = LogprobSemantics("raw")


def make_rollouts(n=5, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        n_prompt, n_resp = int(rng.integers(3, 20)), int(rng.integers(1, 30))
        ids = rng.integers(3, vocab, n_prompt + n_resp).astype(np.int32)
        model = np.r_[np.zeros(n_prompt, bool), np.ones(n_resp, bool)]
        if i == 2:  # a tool block in the middle of the response: not scored
            model[n_prompt + n_resp // 2 : n_prompt + n_resp // 2 + 2] = False
        turn = np.where(model, 0, -1).astype(np.int16)
        out.append(Rollout(i, f"p{i}", ids, turn, model, np.where(model, -1.0, np.nan).astype(np.float32), "stop"))
    return out


def independent(model_path, rollouts, dtype=torch.float32, temperature=None):
    """One sequence at a time through the model's own forward; log-softmax in float64."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).eval()
    lps, ents = [], []
    for r in rollouts:
        with torch.no_grad():
            logits = m(input_ids=torch.from_numpy(r.token_ids.astype(np.int64))[None]).logits[0].double()
        if temperature:
            logits = logits / temperature
        lp_all = torch.log_softmax(logits, -1)
        pos = np.flatnonzero(r.is_model_token)
        tgt = torch.from_numpy(r.token_ids[pos].astype(np.int64))
        lps.append(lp_all[pos - 1, tgt].numpy())
        ents.append(-(lp_all[pos - 1].exp() * lp_all[pos - 1]).sum(-1).numpy())
    return lps, ents


def check_engine_prefill_against_independent(engine, starts):
    """An engine's prefill log-probs of arbitrary, never sampled sequences (so it really re-runs them)
    against an fp32 HF forward, position by position from each request's start, to bf16 precision."""
    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, 900, size=n).astype(np.int32) for n in (12, 30, 7)]
    got = engine.prefill_logprobs([ScoreRequest(s, k) for s, k in zip(seqs, starts)])
    rollouts = [
        Rollout(i, "x", s, np.zeros(len(s), np.int16), np.arange(len(s)) >= k, np.zeros(len(s), np.float32), "stop")
        for i, (s, k) in enumerate(zip(seqs, starts))
    ]
    want, _ = independent(DENSE, rollouts)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.abs(g - w).max() < 0.25 and np.abs(g - w).mean() < 0.05  # bf16 weights vs fp32
        assert np.all(g < 0)


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

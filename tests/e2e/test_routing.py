"""MoE routing: the agreement metric by hand, and the recorded expert ids against the model's own
router logits (``output_router_logits``) on both sides."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import DENSE, MOE, SINGLE_TURN

from mismatch_probe.analysis.routing_agreement import RoutingAccumulator, compare_routing
from mismatch_probe.config.spec import EngineSpec, ReferenceSpec, SamplingSpec
from mismatch_probe.engines import GenerationRequest, load_engine
from mismatch_probe.modeling.loading import load_tokenizer, stop_token_ids
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.modeling.routing import RouterRecorder
from mismatch_probe.reference.scorer import ReferenceScorer
from mismatch_probe.rollout.prompts import tokenize_prompts
from mismatch_probe.table.tokens import Rollout


def test_routing_agreement_by_hand():
    # 3 tokens, 2 layers, top-2 (ids sorted per token and layer)
    ei = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [6, 7]]]).reshape(3, -1)
    et = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 3]], [[1, 3], [0, 7]]]).reshape(3, -1)
    lt = np.log([0.5, 0.4, 0.9])
    li = np.log([0.5, 0.2, 0.3])
    acc = RoutingAccumulator(n_layers=2, top_k=2)
    acc.add(compare_routing(ei[:2], et[:2], 2, 2), lt[:2], li[:2])  # streamed in two chunks
    acc.add(compare_routing(ei[2:], et[2:], 2, 2), lt[2:], li[2:])
    r = acc.result([3, 7])
    assert r["moe_layers"] == [3, 7]
    assert r["set_agreement_by_layer"] == pytest.approx([1 / 3, 2 / 3])
    # shared experts per layer: layer 0: 2, 1, 0 of 2; layer 1: 2, 2, 1 of 2
    assert r["overlap_by_layer"] == pytest.approx([3 / 6, 5 / 6])
    assert r["layers_differing_histogram"] == [1, 1, 1]
    assert r["tokens_with_flip_share"] == pytest.approx(2 / 3)
    assert r["agreed"]["n_tokens"] == 1 and r["agreed"]["abs_delta_mean"] == 0
    assert r["flipped"]["abs_delta_mean"] == pytest.approx((math.log(2) + math.log(3)) / 2)
    assert r["flipped"]["prob_diff_max"] == pytest.approx(0.6)


def router_topk(model, ids: np.ndarray, k: int) -> np.ndarray:
    """Independent: the model's own router logits, top-k, sorted; [tokens, layers, k]."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None], output_router_logits=True)
    return np.stack([lg.topk(k, dim=-1).indices.sort(-1).values.numpy() for lg in out.router_logits], axis=1)


def test_dense_model_has_no_routers():
    from transformers import AutoModelForCausalLM

    assert not RouterRecorder(AutoModelForCausalLM.from_pretrained(str(DENSE))).active


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_reference_routing_matches_router_logits(packing):
    rng = np.random.default_rng(0)
    rollouts = []
    for i in range(4):
        n_p, n_r = int(rng.integers(3, 12)), int(rng.integers(2, 20))
        ids = rng.integers(3, 1000, n_p + n_r).astype(np.int32)
        model = np.r_[np.zeros(n_p, bool), np.ones(n_r, bool)]
        rollouts.append(
            Rollout(
                i,
                str(i),
                ids,
                np.where(model, 0, -1).astype(np.int16),
                model,
                np.zeros(len(ids), np.float32),
                "stop",
                np.zeros((n_r, 4, 2), np.int16),
            )
        )
    scorer = ReferenceScorer(MOE, ReferenceSpec(dtype="float32", packing=packing, micro_batch_size=3))
    scores = scorer.score(rollouts, LogprobSemantics("raw"))
    for r, got in zip(rollouts, scores.experts):
        want = router_topk(scorer.model, r.token_ids, 2)[np.flatnonzero(r.is_model_token) - 1]
        assert got.shape == (r.n_model_tokens, 4, 2)
        assert np.array_equal(got, want)


def test_engine_routing_matches_router_logits():
    tok = load_tokenizer(MOE)
    prompts = tokenize_prompts(SINGLE_TURN, tok, max_prompts=4, max_model_len=1024, max_new_tokens=24)
    eng = load_engine("hf")(MOE, EngineSpec(dtype="float32", batch_size=4))
    outs = eng.generate(
        [GenerationRequest(p.token_ids, 24) for p in prompts],
        SamplingSpec(max_tokens=24),
        stop_token_ids=stop_token_ids(MOE, tok),
        seed=0,
    )
    assert eng.info()["routing"] == {"moe_layers": [0, 1, 2, 3], "top_k": 2, "num_experts": 8}
    for p, c in zip(prompts, outs):
        full = np.concatenate([p.token_ids, c.token_ids])
        want = router_topk(eng.model, full, 2)[len(p.token_ids) - 1 : len(full) - 1]
        assert c.experts.shape == (len(c.token_ids), 4, 2)
        assert np.array_equal(c.experts, want)
    eng.close()


def test_shared_experts_against_python_sets():
    from mismatch_probe.analysis.routing_agreement import shared_experts

    rng = np.random.default_rng(1)
    a = np.sort(np.stack([rng.choice(200, 8, replace=False) for _ in range(300)]), -1).reshape(50, 6, 8)
    b = np.sort(np.stack([rng.choice(200, 8, replace=False) for _ in range(300)]), -1).reshape(50, 6, 8)
    b[:10] = a[:10]  # some identical sets
    want = np.array([[len(set(x) & set(y)) for x, y in zip(ra, rb)] for ra, rb in zip(a, b)])
    assert np.array_equal(shared_experts(a, b), want)
    assert (shared_experts(a[:10], b[:10]) == 8).all()

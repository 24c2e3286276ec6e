"""Model-family conformance of the training side: every family of tests/tiny_models.py scored by
the reference (packed and padded, one process and the TP=2 / SP=2 layouts) and sampled by the HF
engine, in float32, against independent float64 computations. Each outcome is checked against
the committed supported-models table (tests/model_support.py).

Bounds: float32 forwards of one model agree to a few ulp of a log-prob (|log p| ~ 7 here, an
ulp ~ 5e-7); any real difference (a missed soft-cap, a leaked neighbour in a packed row, a
sliding window applied on the wrong side) is orders of magnitude larger (0.33 for gemma2's
soft-cap dropped by sdpa).
"""

from __future__ import annotations

import dataclasses
import functools

import model_support
import numpy as np
import pytest
import torch
from conftest import SINGLE_TURN
from layout_ranks import LAYOUTS, score_layouts
from model_support import Refused
from reference_checks import independent, make_rollouts
from tiny_models import FAMILIES

from mismatch_probe.analysis.routing_agreement import RoutingAccumulator, compare_routing
from mismatch_probe.analysis.terms import token_terms
from mismatch_probe.config.spec import EngineSpec, ReferenceSpec, SamplingSpec
from mismatch_probe.engines import GenerationRequest, ScoreRequest, load_engine
from mismatch_probe.engines.hf import HFEngine
from mismatch_probe.errors import ConfigError
from mismatch_probe.modeling.loading import load_tokenizer, stop_token_ids
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference.scorer import ReferenceScorer
from mismatch_probe.rollout.prompts import tokenize_prompts
from mismatch_probe.table.tokens import Rollout

RAW = LogprobSemantics("raw")
# 4 to 49 tokens (prompt and response), across the 16-token sliding windows; one with a tool block
ROLLOUTS = make_rollouts(6, seed=4)


def eager_model(path):
    """The model's own eager attention: transformers' reference implementation of every family."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def model_tokens(arrays, rollouts) -> np.ndarray:
    return np.concatenate([a[r.is_model_token] for a, r in zip(arrays, rollouts)]).astype(np.float64)


def moe_layer_count(path) -> int:
    from mismatch_probe.modeling.architecture import describe_checkpoint

    arch = describe_checkpoint(path)
    return arch["layers"] - arch["moe"].get("first_dense_layers", 0)


def with_routing(rollouts, n_layers: int, k: int):
    """The same rollouts carrying engine routing (placeholder ids), so the reference records its own."""
    return [
        dataclasses.replace(r, experts_infer=np.zeros((int(r.is_model_token.sum()), n_layers, k), np.int16))
        for r in rollouts
    ]


@functools.cache
def reference_scores(path, packing: bool):
    moe = FAMILIES[path.name.removeprefix("tiny-")].moe
    rollouts = with_routing(ROLLOUTS, moe_layer_count(path), 2) if moe else ROLLOUTS
    try:
        scorer = ReferenceScorer(path, ReferenceSpec(dtype="float32", logits_fp32=True, packing=packing, device="cpu"))
    except ConfigError as exc:
        raise Refused(exc.message) from None
    try:
        scores = scorer.score(rollouts, RAW)
        return model_tokens(scores.logp, rollouts), scores.experts, scorer.info()
    finally:
        scorer.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference(family, zoo):
    """Packed rows equal padded micro-batches, both equal the model's own eager forward one
    sequence at a time (float64 log-softmax); MoE: routing recorded per MoE layer, top-k wide."""
    path = zoo[family]

    def probe():
        packed, experts, info = reference_scores(path, True)
        padded, _, _ = reference_scores(path, False)
        want = np.concatenate(independent(path, ROLLOUTS, attn_implementation="eager")[0])
        print(
            f"{family}: {len(want)} tokens, attention {info['attention_kernel']}, packed vs padded "
            f"{np.abs(packed - padded).max():.2e}, vs eager float64 {np.abs(packed - want).max():.2e}"
        )
        np.testing.assert_allclose(packed, padded, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(packed, want, rtol=1e-6, atol=1e-5)
        if FAMILIES[family].moe:
            n_layers = moe_layer_count(path)
            n_experts = (
                FAMILIES[family].kwargs.get("num_experts")
                or FAMILIES[family].kwargs.get("num_local_experts")
                or FAMILIES[family].kwargs["n_routed_experts"]
            )
            for r, e in zip(ROLLOUTS, experts):
                assert e.shape == (r.is_model_token.sum(), n_layers, 2)
                assert (e >= 0).all() and (e < n_experts).all()
                assert (np.diff(e, axis=-1) > 0).all()  # k distinct experts, sorted

    model_support.run(family, "reference", probe)


def _hf_engine(path):
    try:
        return load_engine("hf")(path, EngineSpec(dtype="float32", batch_size=8))
    except ConfigError as exc:
        raise Refused(exc.message) from None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_engine(family, zoo):
    """The HF engine in fp32 against the reference in fp32 on the tokens it sampled: K3 <= 1e-9,
    its own prefill equal to its decode (K3 <= 1e-9), greedy decoding (KV cache) picking exactly
    the argmax of a full prefill at every step; MoE: the same experts on both sides (100%)."""
    path = zoo[family]

    def probe():
        tok = load_tokenizer(path)
        prompts = tokenize_prompts(SINGLE_TURN, tok, max_prompts=6, max_model_len=1024, max_new_tokens=40)
        stops = stop_token_ids(path, tok)
        reqs = [GenerationRequest(p.token_ids, 40) for p in prompts]
        engine = _hf_engine(path)
        try:
            sampled = engine.generate(
                reqs, SamplingSpec(temperature=1.0, max_tokens=40, seed=3), stop_token_ids=stops, seed=3
            )
            full = [np.concatenate([p.token_ids, c.token_ids]) for p, c in zip(prompts, sampled)]
            prefill = engine.prefill_logprobs([ScoreRequest(f, len(p.token_ids)) for f, p in zip(full, prompts)])
            greedy = engine.generate(reqs, SamplingSpec(temperature=0.0, max_tokens=24), stop_token_ids=stops, seed=0)
            routing = engine.info()["routing"]
        finally:
            engine.close()
        rollouts = []
        for i, (p, c, f) in enumerate(zip(prompts, sampled, full)):
            model = np.arange(len(f)) >= len(p.token_ids)
            logp = np.full(len(f), np.nan, np.float32)
            logp[model] = c.logprobs
            rollouts.append(
                Rollout(
                    i,
                    p.id,
                    f.astype(np.int32),
                    np.where(model, 0, -1).astype(np.int16),
                    model,
                    logp,
                    c.finish_reason,
                    c.experts,
                )
            )
        scorer = ReferenceScorer(path, ReferenceSpec(dtype="float32", logits_fp32=True, device="cpu"))
        scores = scorer.score(rollouts, RAW)
        scorer.close()
        infer = np.concatenate([c.logprobs for c in sampled]).astype(np.float64)
        train = model_tokens(scores.logp, rollouts)
        k3 = token_terms(train, infer).k3.mean()
        k3_prefill = token_terms(np.concatenate(prefill), infer).k3.mean()
        print(
            f"{family}: {len(infer)} sampled tokens, K3 engine vs reference {k3:.2e}, decode vs prefill {k3_prefill:.2e}"
        )
        assert len(infer) > 100
        assert k3 <= 1e-9 and k3_prefill <= 1e-9

        model = eager_model(path)
        for p, c in zip(prompts, greedy):
            ids = torch.from_numpy(np.concatenate([p.token_ids, c.token_ids]).astype(np.int64))[None]
            with torch.no_grad():
                argmax = model(input_ids=ids).logits[0, len(p.token_ids) - 1 : -1].argmax(-1).numpy()
            assert np.array_equal(argmax, c.token_ids), f"greedy decode left the prefill's argmax in {p.id}"

        if FAMILIES[family].moe:
            n_layers, k = len(routing["moe_layers"]), routing["top_k"]
            assert n_layers == moe_layer_count(path) and k == 2
            acc = RoutingAccumulator(n_layers=n_layers, top_k=k)
            for r, e, lp in zip(rollouts, scores.experts, scores.logp):
                assert e.shape == r.experts_infer.shape == (r.is_model_token.sum(), n_layers, k)
                lt, li = lp[r.is_model_token], r.logp_infer[r.is_model_token]
                acc.add(
                    compare_routing(r.experts_infer.reshape(len(e), -1), e.reshape(len(e), -1), n_layers, k), lt, li
                )
            assert acc.result(routing["moe_layers"])["set_agreement_mean"] == 1.0

    model_support.run(family, "hf", probe)


@pytest.fixture(scope="module")
def layouts(zoo):
    """Every family in both layouts, in one pair of spawned ranks (tests/families/layout_ranks.py)."""
    return score_layouts(zoo.all(), ROLLOUTS)


@pytest.mark.distributed
@pytest.mark.parametrize("column", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_layout(family, column, zoo, layouts):
    """TP=2 (transformers' plan via DTensor) and Ulysses SP=2 reproduce one process within
    float32 rounding, or are refused with the layout's own reason (heads that do not split, an
    attention without a tensor-parallel plan)."""
    path = zoo[family]

    def probe():
        status, value = layouts.get((family, column), ("error", "the ranks stopped before this family"))
        if status == "refused":
            raise Refused(value)
        assert status == "ok", value
        lp, parallel = value
        one, _, _ = reference_scores(path, True)
        print(f"{family} {column}: max |dlogp| vs one process {np.abs(lp - one).max():.2e} ({parallel.get('mesh')})")
        np.testing.assert_allclose(lp, one, rtol=1e-6, atol=1e-5)

    model_support.run(family, column, probe)


def test_flex_attention_refuses_attention_sinks_on_cpu_by_name(zoo):
    """transformers' flex_attention cannot run gpt-oss's attention sinks on CPU; the reference and
    the hf engine say so when they load, instead of a traceback at the first forward (on a CUDA
    device it runs them: tests/gpu)."""
    for load in (
        lambda: ReferenceScorer(
            zoo["gpt_oss"], ReferenceSpec(dtype="float32", device="cpu", attn_implementation="flex_attention")
        ),
        lambda: HFEngine(zoo["gpt_oss"], EngineSpec(name="hf", device="cpu", attn_implementation="flex_attention")),
    ):
        with pytest.raises(ConfigError, match="cannot run tiny-gpt_oss's attention sinks on CPU"):
            load()
    # a model without sinks loads with flex_attention on CPU
    ReferenceScorer(zoo["llama"], ReferenceSpec(dtype="float32", device="cpu", attn_implementation="flex_attention"))

"""The hf engine, for real on the fixture: sampled tokens, their log-probs, stopping, seeding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DENSE, MOE, SINGLE_TURN

from mismatch_probe.config.spec import EngineSpec, SamplingSpec
from mismatch_probe.engines import GenerationRequest, load_engine
from mismatch_probe.modeling.loading import load_tokenizer, stop_token_ids
from mismatch_probe.rollout.prompts import tokenize_prompts


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(DENSE)
    ps = tokenize_prompts(SINGLE_TURN, tok, max_prompts=6, max_model_len=1024, max_new_tokens=32)
    return [p.token_ids for p in ps], stop_token_ids(DENSE, tok)


def engine(model=DENSE, **kw):
    return load_engine("hf")(model, EngineSpec(dtype=kw.pop("dtype", "float32"), **kw))


def generate(eng, prompt_ids, stops, seed=0, max_tokens=32, **sampling):
    reqs = [GenerationRequest(p, max_tokens) for p in prompt_ids]
    return eng.generate(reqs, SamplingSpec(max_tokens=max_tokens, **sampling), stop_token_ids=stops, seed=seed)


def full_forward_logprobs(eng, prompt, completion, temperature=None):
    """Independent check: one unpadded, uncached forward over prompt+response, float64 softmax."""
    ids = torch.from_numpy(np.concatenate([prompt, completion.token_ids]).astype(np.int64))[None]
    with torch.no_grad():
        logits = eng.model(input_ids=ids).logits[0].double()
    if temperature:
        logits = logits / temperature
    lp = torch.log_softmax(logits, -1)
    start = len(prompt)
    rows = torch.arange(start - 1, start - 1 + len(completion.token_ids))
    return lp[rows, torch.from_numpy(completion.token_ids.astype(np.int64))].numpy()


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense", "moe"])
def test_raw_logprobs_match_a_full_forward(prompts, model):
    ids, stops = prompts
    eng = engine(model, batch_size=4)
    outs = generate(eng, ids, stops, seed=1)
    assert len(outs) == len(ids)
    for p, c in zip(ids, outs):
        assert len(c.token_ids) == len(c.logprobs) >= 1
        assert np.allclose(c.logprobs, full_forward_logprobs(eng, p, c), atol=1e-4)
    eng.close()


def test_processed_logprobs_follow_temperature(prompts):
    ids, stops = prompts
    eng = engine(logprobs_mode="processed")
    outs = generate(eng, ids[:3], stops, temperature=0.7)
    for p, c in zip(ids, outs):
        assert np.allclose(c.logprobs, full_forward_logprobs(eng, p, c, temperature=0.7), atol=1e-4)
        assert not np.allclose(c.logprobs, full_forward_logprobs(eng, p, c), atol=1e-3)
    eng.close()


def test_stop_token_and_length_limits(prompts):
    ids, stops = prompts
    eng = engine()
    long = generate(eng, ids, stops, max_tokens=64)
    assert any(c.finish_reason == "stop" for c in long)
    for c in long:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in stops and not np.isin(c.token_ids[:-1], stops).any()
    short = generate(eng, ids, stops, max_tokens=3)
    for c in short:
        assert len(c.token_ids) <= 3
        assert c.finish_reason == ("stop" if c.token_ids[-1] in stops else "length")
    eng.close()


def test_seed_makes_sampling_repeatable(prompts):
    ids, stops = prompts
    eng = engine(batch_size=2)
    a = generate(eng, ids, stops, seed=5)
    b = generate(eng, ids, stops, seed=5)
    c = generate(eng, ids, stops, seed=6)
    same = lambda x, y: all(np.array_equal(i.token_ids, j.token_ids) for i, j in zip(x, y))
    assert same(a, b)
    assert not same(a, c)
    eng.close()


def test_top_k_one_is_greedy(prompts):
    ids, stops = prompts
    eng = engine()
    greedy = generate(eng, ids, stops, temperature=0.0)
    top1 = generate(eng, ids, stops, top_k=1, seed=3)
    assert all(np.array_equal(g.token_ids, t.token_ids) for g, t in zip(greedy, top1))
    eng.close()


def test_bf16_engine_reports_its_settings(prompts):
    eng = engine(dtype="auto", attn_implementation="eager")
    info = eng.info()
    assert info["dtype"] == "bfloat16"  # the checkpoint's own dtype
    assert info["attn_implementation"] == "eager"
    assert next(eng.model.parameters()).dtype == torch.bfloat16
    eng.close()

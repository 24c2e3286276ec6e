"""Independent checks of log-probs: one sequence at a time through the model's own forward, in float64.
Shared by the reference, model-family, parallel-reference and engine tests."""

from __future__ import annotations

import numpy as np
import torch
from conftest import DENSE

from mismatch_probe.engines import ScoreRequest
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.table.tokens import Rollout

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


def independent(model_path, rollouts, dtype=torch.float32, temperature=None, attn_implementation=None):
    """One sequence at a time through the model's own forward; log-softmax in float64.
    ``attn_implementation``: transformers' default unless given ("eager" is every family's own)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation=attn_implementation)
    m.eval()
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

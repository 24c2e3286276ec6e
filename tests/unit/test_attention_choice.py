"""Which attention each side runs, and the masks and kernels the reference builds for packed rows,
against hand-written expectations (no model forward beyond a few-token tensor)."""

from __future__ import annotations

import json

import pytest
import torch

from mismatch_probe.errors import ConfigError
from mismatch_probe.modeling.loading import attention_softcap, choose_attention
from mismatch_probe.modeling.varlen_attention import _varlen_sdpa
from mismatch_probe.reference.parallel import packed_row_mask


def _checkpoint(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_soft_capped_attention_scores_run_eager(tmp_path):
    gemma2 = _checkpoint(
        tmp_path, model_type="gemma2", architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=50.0
    )
    assert attention_softcap({"attn_logit_softcapping": 50.0}) == 50.0
    assert attention_softcap({"text_config": {"attn_logit_softcapping": None}}) is None
    choice = choose_attention(gemma2, "auto", trust_remote_code=False)
    assert choice.used == "eager" and "attn_logit_softcapping=50" in choice.fallback_reason
    assert choose_attention(gemma2, "eager", trust_remote_code=False).used == "eager"
    with pytest.raises(ConfigError, match="ignores the cap"):
        choose_attention(gemma2, "sdpa", trust_remote_code=False)


def test_uncapped_models_keep_sdpa(tmp_path):
    llama = _checkpoint(tmp_path, model_type="llama", architectures=["LlamaForCausalLM"])
    assert choose_attention(llama, None, trust_remote_code=False).used == "sdpa"


def test_packed_row_mask_by_hand():
    # two sequences of 3 and 2 tokens, then 4 tokens with a window of 2
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])
    allowed = packed_row_mask(pos, None, torch.float32)[0, 0] == 0
    want = torch.zeros(9, 9, dtype=torch.bool)
    for a, b in ((0, 3), (3, 5), (5, 9)):
        for i in range(a, b):
            want[i, a : i + 1] = True
    assert torch.equal(allowed, want)
    windowed = packed_row_mask(pos, 2, torch.float32)[0, 0] == 0
    assert windowed[8].tolist() == [False] * 7 + [True, True]  # i - j < 2
    assert packed_row_mask(pos, None, torch.bfloat16).min() == torch.finfo(torch.bfloat16).min


def test_varlen_sdpa_takes_narrower_value_heads_and_refuses_soft_caps():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 4)  # latent attention: value heads narrower than query/key heads
    cu = torch.tensor([0, 2, 5])
    out, _ = _varlen_sdpa(None, q, k, v, None, cu_seq_lens_q=cu)
    assert out.shape == (1, 5, 2, 4)
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, 2:], k[:, :, 2:], v[:, :, 2:], is_causal=True)
    torch.testing.assert_close(out[:, 2:].transpose(1, 2), want)
    with pytest.raises(ValueError, match="soft-cap"):
        _varlen_sdpa(None, q, k, v, None, softcap=50.0)

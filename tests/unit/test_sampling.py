"""The processed distribution (temperature, top-k, top-p) against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from mismatch_probe.modeling.logprobs import LogprobSemantics, entropy_from_logprobs, logprobs_under, processed_logits


def probs_logits(*p):
    return torch.log(torch.tensor([p], dtype=torch.float32))


def kept(logits):
    return (processed_logits(*logits) > float("-inf"))[0].tolist()


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    out = processed_logits(logits, 0.5, 0, 1.0)
    assert torch.allclose(out, logits / 0.5)


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    assert kept((logits, 1.0, 2, 1.0)) == [False, True, False, False, True]


@pytest.mark.parametrize(
    "top_p, expect",
    [
        (0.8, [True, True, False]),  # ascending mass: 0.2 <= 0.2 dropped; 0.5 > 0.2 kept
        (0.79, [True, True, False]),
        (0.5, [True, False, False]),  # 0.2 and 0.2+0.3=0.5 <= 0.5 dropped
        (0.81, [True, True, True]),
        (1e-6, [True, False, False]),  # the most likely token is always kept
    ],
)
def test_top_p_boundaries_follow_vllm(top_p, expect):
    assert kept((probs_logits(0.5, 0.3, 0.2), 1.0, 0, top_p)) == expect


def test_processed_logprobs_renormalize_over_kept_tokens():
    logits = probs_logits(0.5, 0.3, 0.2)
    sem = LogprobSemantics("processed", temperature=1.0, top_k=2, top_p=1.0)
    lp = logprobs_under(logits, sem)[0]
    assert lp[0].item() == pytest.approx(math.log(0.5 / 0.8), rel=1e-6)
    assert lp[2].item() == float("-inf")
    raw = logprobs_under(logits, LogprobSemantics("raw", temperature=0.7, top_k=2))[0]
    assert raw[2].item() == pytest.approx(math.log(0.2), rel=1e-6)  # raw ignores sampling settings


def test_processed_with_temperature():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    lp = logprobs_under(logits, LogprobSemantics("processed", temperature=0.7))[0].double()
    z = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64) / 0.7
    assert torch.allclose(lp, z - torch.logsumexp(z, 0), atol=1e-6)


def test_entropy_ignores_filtered_tokens():
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    assert entropy_from_logprobs(lp).item() == pytest.approx(math.log(2))


def test_semantics_validation():
    with pytest.raises(ValueError):
        LogprobSemantics("scaled")
    assert not LogprobSemantics("processed", temperature=1.0).transforms_logits
    assert LogprobSemantics("processed", temperature=1.0, top_p=0.9).transforms_logits
    assert not LogprobSemantics("raw", temperature=0.5).transforms_logits

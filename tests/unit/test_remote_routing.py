"""Routed experts read from a vLLM or SGLang server's answers (the remote engine's dialects): the
request asks from the last prompt position, the answer's array (encoded by vLLM's own
``numpy2base64``, or as SGLang's tokenizer manager encodes it) becomes the probe's rows, and a
server that does not return them (or does not say) is named with the reason."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from mismatch_probe.config.spec import SamplingSpec
from mismatch_probe.engines.base import GenerationRequest
from mismatch_probe.engines.remote.dialect import ServerInfo
from mismatch_probe.engines.remote.openai import OpenAIDialect
from mismatch_probe.engines.remote.sglang import SGLangDialect
from mismatch_probe.engines.remote.swift import SwiftDialect
from mismatch_probe.engines.routed_experts import MoeLayout
from mismatch_probe.errors import EngineError

# 4 decoder layers, layers 1 and 3 MoE, top-2 of 8 experts
LAYOUT = MoeLayout(moe_layers=[1, 3], top_k=2, num_experts=8, num_hidden_layers=4)
PROMPT = np.array([5, 6, 7], np.int32)
SAMPLED = [11, 12, 13]


class _Where:
    def where(self, path):
        return "http://server" + path


def routed(rng) -> np.ndarray:
    """What an engine returns from the last prompt position: [prompt - 1 + sampled - 1 + 1 - start rows]
    = positions 2..4, every layer, unsorted top-k; dense layers' rows 0."""
    out = np.zeros((3, 4, 2), np.uint8)
    for p in range(3):
        for layer in (1, 3):
            out[p, layer] = rng.choice(8, 2, replace=False)
    return out


def test_vllm_routed_experts_become_the_rows_behind_each_sampled_token():
    from vllm.utils.serial_utils import numpy2base64

    dialect = OpenAIDialect()
    dialect.routing = LAYOUT
    request = GenerationRequest(PROMPT, 3)
    body = dialect.generate_body("m", request, SamplingSpec(), [], None)
    assert body["routed_experts_prompt_start"] == 2  # the last prompt position
    array = routed(np.random.default_rng(0))
    choice = {
        "token_ids": SAMPLED,
        "logprobs": {"tokens": [f"token_id:{t}" for t in SAMPLED], "token_logprobs": [-0.1, -0.2, -0.3]},
        "finish_reason": "length",
        "routed_experts": numpy2base64(array),
    }
    c = dialect.completion({"choices": [choice]}, request, "request 1")
    assert c.experts.dtype == np.int16 and c.experts.shape == (3, 2, 2)
    assert np.array_equal(c.experts, np.sort(array[:, [1, 3]], axis=-1))
    with pytest.raises(EngineError, match="returned routed experts for 2 positions, expected 3"):
        dialect.completion({"choices": [{**choice, "routed_experts": numpy2base64(array[:2])}]}, request, "r")
    with pytest.raises(EngineError, match="no routed experts, though the server runs with them on"):
        dialect.completion({"choices": [{**choice, "routed_experts": None}]}, request, "r")


def test_sglang_routed_experts_become_the_rows_behind_each_sampled_token():
    dialect = SGLangDialect.__new__(SGLangDialect)  # no checkpoint: the prefill reader is not used here
    dialect.routing = LAYOUT
    request = GenerationRequest(PROMPT, 3)
    body = dialect.generate_body("m", request, SamplingSpec(), [], None)
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 2
    array = routed(np.random.default_rng(1)).astype(np.int32)
    meta = {
        "output_token_logprobs": [[-0.1, 11, None], [-0.2, 12, None], [-0.3, 13, None]],
        "finish_reason": {"type": "length"},
        # srt/managers/tokenizer_manager.py: base64 of the flat int32 tensor's bytes
        "routed_experts": base64.b64encode(array.tobytes()).decode(),
    }
    c = dialect.completion({"output_ids": SAMPLED, "meta_info": meta}, request, "request 1")
    assert np.array_equal(c.experts, np.sort(array[:, [1, 3]], axis=-1))


def test_a_server_that_does_not_return_routing_or_does_not_say_is_named():
    where = _Where()
    on, off, unknown = (ServerInfo(model="m", names=set(), software="vllm", version="x") for _ in range(3))
    on.settings["return_routed_experts"] = True
    off.settings["return_routed_experts"] = False
    assert OpenAIDialect().routing_unavailable(on, where) is None
    assert "without --enable-return-routed-experts" in OpenAIDialect().routing_unavailable(off, where)
    assert "VLLM_SERVER_DEV_MODE=1" in OpenAIDialect().routing_unavailable(unknown, where)
    assert "one SGLang worker" in SGLangDialect.routing_unavailable(
        SGLangDialect.__new__(SGLangDialect), unknown, where
    )
    assert "enable_return_routed_experts" in SwiftDialect().routing_unavailable(on, where)

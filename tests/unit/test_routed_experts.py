"""engines/routed_experts.py: the routed experts vLLM and SGLang return, on synthetic arrays shaped
exactly as each engine returns them, and the MoE layer list against the reference's recorder."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import tiny_models
import torch
import transformers
from conftest import MOE

from mismatch_probe.engines.routed_experts import (
    checkpoint_config,
    decode_sglang_int32_b64,
    decode_vllm_npy_b64,
    moe_layers_from_config,
    moe_layout,
    rows_for_generated,
)
from mismatch_probe.errors import EngineError
from mismatch_probe.modeling.routing import RouterRecorder

N_LAYERS, TOP_K, N_EXPERTS = 4, 2, 8
MOE_LAYERS = [1, 3]  # layers 0 and 2 dense


def engine_routing(prompt_len: int, n_generated: int, start: int, dtype, *, seed: int = 0) -> np.ndarray:
    """What both engines return for one request: [prompt_len + n_generated - 1 - start, num_hidden_layers,
    top_k], positions from ``start``; a dense layer's rows 0; the k ids distinct, in no particular order.
    Position p, MoE layer l holds ids {(p + l) % E, (p + 3l + 1) % E}, reversed on odd positions."""
    positions = np.arange(start, prompt_len + n_generated - 1)
    out = np.zeros((len(positions), N_LAYERS, TOP_K), dtype=dtype)
    for row, p in enumerate(positions):
        for layer in MOE_LAYERS:
            a, b = (p + layer) % N_EXPERTS, (p + 3 * layer + 1) % N_EXPERTS
            if a == b:
                b = (b + 1) % N_EXPERTS
            out[row, layer] = (b, a) if p % 2 else (a, b)
    return out


def expected_rows(prompt_len: int, n_generated: int) -> np.ndarray:
    full = engine_routing(prompt_len, n_generated, 0, np.int32)
    return np.sort(full[prompt_len - 1 :][:, MOE_LAYERS], axis=-1).astype(np.int16)


def vllm_b64(array: np.ndarray) -> str:
    """vLLM's OpenAI server (vllm/utils/serial_utils.py: numpy2base64)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def sglang_b64(array: np.ndarray) -> str:
    """SGLang's meta_info["routed_experts"] (tokenizer_manager.py: b64encode(tensor.numpy().tobytes()))."""
    return base64.b64encode(array.astype(np.int32).tobytes()).decode("utf-8")


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_the_rows_behind_each_generated_token_from_the_last_prompt_position(dtype):
    prompt_len, n_gen = 7, 5
    routed = engine_routing(prompt_len, n_gen, prompt_len - 1, dtype)
    assert routed.shape == (n_gen, N_LAYERS, TOP_K)  # what start = prompt_len - 1 asks for
    rows = rows_for_generated(routed, prompt_len, prompt_len - 1, n_gen, MOE_LAYERS, top_k=TOP_K, num_experts=N_EXPERTS)
    assert rows.dtype == np.int16 and rows.shape == (n_gen, len(MOE_LAYERS), TOP_K)
    assert np.array_equal(rows, expected_rows(prompt_len, n_gen))
    assert (np.diff(rows, axis=-1) > 0).all()  # sorted per token, whatever order the kernel gave


def test_an_earlier_start_shared_by_a_batch_is_sliced_per_request():
    """SGLang takes one routed_experts_start_len for a whole batch: the shortest prompt's last position."""
    for prompt_len, n_gen in ((4, 3), (9, 6)):
        routed = engine_routing(prompt_len, n_gen, 3, np.int32)
        rows = rows_for_generated(routed, prompt_len, 3, n_gen, MOE_LAYERS)
        assert np.array_equal(rows, expected_rows(prompt_len, n_gen))


def test_one_generated_token_and_a_one_token_prompt():
    rows = rows_for_generated(engine_routing(1, 1, 0, np.uint8), 1, 0, 1, MOE_LAYERS)
    assert np.array_equal(rows, expected_rows(1, 1)) and rows.shape == (1, 2, 2)


def test_a_full_sequence_answer_is_refused_and_says_the_start_was_ignored():
    """Some SGLang builds ignore routed_experts_start_len and return every position (strands-sglang #72)."""
    full = engine_routing(7, 5, 0, np.int32)
    with pytest.raises(
        EngineError,
        match=r"returned routed experts for 11 positions \(the whole sequence from "
        r"position 0: it ignored the start\), expected 5: positions 6 to 10",
    ):
        rows_for_generated(full, 7, 6, 5, MOE_LAYERS, what="SGLang")


def test_a_wrong_length_is_refused_with_what_came_back():
    routed = engine_routing(7, 5, 6, np.uint8)
    with pytest.raises(EngineError, match=r"for 4 positions, expected 5") as err:
        rows_for_generated(routed[:4], 7, 6, 5, MOE_LAYERS)
    assert "\n" not in str(err.value)
    with pytest.raises(EngineError, match=r"for 5 positions, expected 4"):
        rows_for_generated(routed, 7, 6, 4, MOE_LAYERS)


def test_shapes_widths_and_ids_the_checkpoint_cannot_have_are_refused():
    routed = engine_routing(7, 5, 6, np.uint8)
    with pytest.raises(EngineError, match=r"shape \[5, 8\], not \[positions, layers, top_k\]"):
        rows_for_generated(routed.reshape(5, -1), 7, 6, 5, MOE_LAYERS)
    with pytest.raises(EngineError, match=r"for 2 layers; the checkpoint has MoE layer 3"):
        rows_for_generated(routed[:, :2], 7, 6, 5, MOE_LAYERS)
    with pytest.raises(EngineError, match=r"2 routed experts per token and layer; the checkpoint routes top-4"):
        rows_for_generated(routed, 7, 6, 5, MOE_LAYERS, top_k=4)
    with pytest.raises(EngineError, match=r"expert id 7 in an MoE layer; the checkpoint has 4 routed experts"):
        rows_for_generated(routed, 7, 6, 5, MOE_LAYERS, num_experts=4)
    padded = routed.astype(np.int32)
    padded[0, 1, 1] = -1  # SGLang pads fused shared-expert columns with -1
    with pytest.raises(EngineError, match=r"expert id -1"):
        rows_for_generated(padded, 7, 6, 5, MOE_LAYERS)
    with pytest.raises(EngineError, match=r"from position 7 cannot cover the last prompt position 6"):
        rows_for_generated(routed, 7, 7, 5, MOE_LAYERS)


def test_dense_layer_rows_are_dropped_whatever_they_hold():
    """A dense layer is never written: vLLM's buffer leaves zeros, SGLang's host cache whatever it held."""
    routed = engine_routing(7, 5, 6, np.int32)
    routed[:, [0, 2]] = np.array([999, -5])
    rows = rows_for_generated(routed, 7, 6, 5, MOE_LAYERS, num_experts=N_EXPERTS)
    assert np.array_equal(rows, expected_rows(7, 5))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_vllm_server_npy_base64_round_trip(dtype):
    routed = engine_routing(7, 5, 6, dtype)
    decoded = decode_vllm_npy_b64(vllm_b64(routed))
    assert decoded.dtype == dtype and np.array_equal(decoded, routed)
    rows = rows_for_generated(decoded, 7, 6, 5, MOE_LAYERS, top_k=TOP_K, num_experts=N_EXPERTS)
    assert np.array_equal(rows, expected_rows(7, 5))


def test_vllm_server_answers_that_are_not_an_npy_array_are_refused():
    with pytest.raises(EngineError, match="not base64"):
        decode_vllm_npy_b64("not base64!")
    with pytest.raises(EngineError, match="not a .npy array"):
        decode_vllm_npy_b64(base64.b64encode(b"\x00\x01\x02").decode())
    with pytest.raises(EngineError, match=r"float64 \[3, 2\], not integer"):
        decode_vllm_npy_b64(vllm_b64(np.zeros((3, 2))))
    with pytest.raises(EngineError, match="as NoneType, not a base64 string"):
        decode_vllm_npy_b64(None)  # type: ignore[arg-type]


def test_sglang_flat_int32_base64_round_trip():
    routed = engine_routing(7, 5, 6, np.int32)
    decoded = decode_sglang_int32_b64(sglang_b64(routed), N_LAYERS, TOP_K)
    assert decoded.shape == (5, N_LAYERS, TOP_K) and np.array_equal(decoded, routed)
    assert np.array_equal(decode_sglang_int32_b64(sglang_b64(routed).encode(), N_LAYERS, TOP_K), routed)
    rows = rows_for_generated(decoded, 7, 6, 5, MOE_LAYERS, top_k=TOP_K, num_experts=N_EXPERTS)
    assert np.array_equal(rows, expected_rows(7, 5))


def test_sglang_bytes_that_are_not_whole_rows_are_refused():
    routed = engine_routing(7, 5, 6, np.int32)
    with pytest.raises(
        EngineError,
        match=r"returned 160 bytes of routed experts, not a whole number of int32 rows "
        r"of 4 layers x top-3",
    ):
        decode_sglang_int32_b64(sglang_b64(routed), N_LAYERS, 3)
    with pytest.raises(EngineError, match="not base64"):
        decode_sglang_int32_b64("@@@", N_LAYERS, TOP_K)


# ---- the MoE layer list: the reference's recorder, on each family built small -------------------


def recorded_layers(config) -> list[int]:
    """RouterRecorder.layers of the family's model, built on the meta device (no weights)."""
    model_class = transformers.AutoModelForCausalLM.from_config
    with torch.device("meta"):
        model = model_class(config)
    return RouterRecorder(model).layers


def tiny_config(family: str, **overrides):
    fam = tiny_models.FAMILIES[family]
    return getattr(transformers, fam.config_class)(**{**tiny_models.COMMON, **fam.kwargs, **overrides})


CASES = [
    *[(f, {}) for f in tiny_models.MOE_FAMILIES],
    ("qwen3_moe", {"num_hidden_layers": 6, "mlp_only_layers": [0, 3], "decoder_sparse_step": 2}),
    ("deepseek_v3", {"num_hidden_layers": 5, "first_k_dense_replace": 2}),
    ("glm4_moe", {"num_hidden_layers": 4, "first_k_dense_replace": 0}),
]
OTHER_FAMILIES = [  # transformers' MoE families that tests/tiny_models.py does not build
    ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    ("Ernie4_5_MoeConfig", {"moe_num_experts": 4, "moe_k": 2, "moe_layer_start_index": 1, "moe_layer_interval": 1}),
    ("Glm4MoeLiteConfig", {"n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 2}),
    ("DeepseekV2Config", {"n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1}),
    ("MiniMaxConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
]


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_the_layer_list_is_the_reference_recorders_for_each_tiny_family(family, overrides):
    config = tiny_config(family, **overrides)
    layers = recorded_layers(config)
    assert layers, family
    assert moe_layers_from_config(config.to_dict()) == layers
    layout = moe_layout(config.to_dict())
    assert layout is not None and layout.moe_layers == layers and layout.top_k == config.num_experts_per_tok


@pytest.mark.parametrize(("config_class", "kwargs"), OTHER_FAMILIES, ids=[c for c, _ in OTHER_FAMILIES])
def test_the_layer_list_is_the_reference_recorders_for_other_moe_families(config_class, kwargs):
    small = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = getattr(transformers, config_class)(**{**small, "vocab_size": 128, "num_hidden_layers": 4, **kwargs})
    layers = recorded_layers(config)
    assert layers, config_class
    assert moe_layers_from_config(config.to_dict()) == layers
    layout = moe_layout(config.to_dict())
    assert layout is not None and layout.moe_layers == layers and layout.top_k == 2


def test_the_fixture_checkpoint_as_the_engines_read_it():
    config = checkpoint_config(MOE)
    layout = moe_layout(config)
    assert layout is not None
    assert layout.describe() == {"moe_layers": [0, 1, 2, 3], "top_k": 2, "num_experts": 8}
    assert layout.num_hidden_layers == 4


def test_dense_configs_and_multimodal_text_configs():
    assert moe_layers_from_config(tiny_config("qwen3").to_dict()) == []
    assert moe_layout({"num_hidden_layers": 2, "num_local_experts": 4}) is None  # no top-k
    nested = {
        "model_type": "x",
        "text_config": {
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
        },
    }
    assert moe_layers_from_config(nested) == [1, 2]
    llama4 = {"num_hidden_layers": 6, "num_local_experts": 4, "moe_layers": [1, 3, 5]}
    assert moe_layers_from_config(llama4) == [1, 3, 5]

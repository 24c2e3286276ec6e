"""The KV-cache size mismatch-probe gives vLLM's CPU build when the user sets none, and how an
engine's memory refusal is recognised: pure functions, checked against hand-computed numbers."""

from __future__ import annotations

import pytest

from mismatch_probe.engines.process import is_memory_refusal
from mismatch_probe.engines.vllm_args import CPU_KV_CACHE_SHARE, cpu_kv_cache_budget, kv_bytes_per_token

GiB = 2**30
QWEN3_8B = {
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "max_position_embeddings": 40960,
}


def test_bytes_per_token_by_hand():
    # K and V x 36 layers x 8 KV heads x 128 x 2 bytes = 147,456 (144 KiB)
    assert kv_bytes_per_token(QWEN3_8B, 2) == 2 * 36 * 8 * 128 * 2 == 147_456
    assert kv_bytes_per_token(QWEN3_8B, 2, tp=2) == 147_456 // 2  # KV heads split over ranks
    assert kv_bytes_per_token(QWEN3_8B, 2, tp=16) == 2 * 36 * 1 * 128 * 2  # fewer KV heads than ranks: replicated
    assert kv_bytes_per_token(QWEN3_8B, 1) == 147_456 // 2  # fp8 cache
    no_head_dim = {k: v for k, v in QWEN3_8B.items() if k != "head_dim"}
    assert kv_bytes_per_token(no_head_dim, 2) == 2 * 36 * 8 * (4096 // 32) * 2
    mla = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}  # DeepSeek-V3
    assert kv_bytes_per_token(mla, 2) == 61 * (512 + 64) * 2
    assert kv_bytes_per_token({"text_config": QWEN3_8B}, 2) == 147_456  # multimodal wrappers
    assert kv_bytes_per_token({"hidden_size": 64}, 2) is None


def test_a_small_model_gets_what_it_needs():
    cfg = {
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 1024,
    }
    b = cpu_kv_cache_budget(
        cfg, dtype_bytes=2, tp=1, max_num_seqs=256, max_model_len=None, available_bytes=8 * GiB, weights_bytes=GiB
    )
    assert b["bytes_per_token"] == 2048 and b["needed_bytes"] == 256 * 1024 * 2048 == 512 * 2**20
    assert b["kv_cache_memory_bytes"] == b["needed_bytes"] and b["tokens"] == 256 * 1024
    assert b["cap_bytes"] == int(CPU_KV_CACHE_SHARE * 7 * GiB)


def test_a_large_model_is_capped_by_free_memory_per_rank():
    b = cpu_kv_cache_budget(
        QWEN3_8B,
        dtype_bytes=2,
        tp=2,
        max_num_seqs=512,
        max_model_len=8192,
        available_bytes=100 * GiB,
        weights_bytes=16 * GiB,
    )
    assert b["needed_bytes"] == 73_728 * 512 * 8192  # 288 GiB: far over the node
    assert b["kv_cache_memory_bytes"] == b["cap_bytes"] == int(0.5 * 84 * GiB / 2)
    assert b["tokens"] == b["cap_bytes"] // 73_728
    # nothing free at all still gives vLLM a number (it then refuses, and we name our flags)
    empty = cpu_kv_cache_budget(
        QWEN3_8B, dtype_bytes=2, tp=1, max_num_seqs=1, max_model_len=None, available_bytes=GiB, weights_bytes=16 * GiB
    )
    assert empty["kv_cache_memory_bytes"] == 1 and empty["cap_bytes"] == 0


@pytest.mark.parametrize(
    "message, refusal",
    [
        # vLLM 0.32's CPU worker and KV-cache checks, verbatim
        (
            (
                "ValueError: Available memory on node 0 (6.9/8.46 GiB) on startup is less than desired CPU memory "
                "utilization (0.92, 7.79 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls ..."
            ),
            True,
        ),
        (
            (
                "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                "initializing the engine"
            ),
            True,
        ),
        (
            (
                "ValueError: To serve at least one request with the models's max seq len (1024), (0.5 GiB KV cache is "
                "needed, which is larger than the available KV cache memory (0.1 GiB)"
            ),
            True,
        ),
        ("RuntimeError: Engine core initialization failed. See root cause above.", False),
        ("ValueError: unknown quantization method 'int3'", False),
    ],
)
def test_memory_refusals_are_told_apart(message, refusal):
    assert is_memory_refusal(message) is refusal

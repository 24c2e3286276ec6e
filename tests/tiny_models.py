"""Tiny random checkpoints of popular model families, built at test time (nothing from a hub).

Each is a standard Hugging Face directory: the family's own ``transformers`` config class with a
few layers and 32-wide heads (hidden size 128), random weights from a fixed seed saved as safetensors, and the
fixture's tokenizer, chat template and generation config. ``build(family, out_dir)`` writes one;
``FAMILIES`` lists them with what makes each family itself (the quirk the conformance suite is
there to catch).

Heads are 32 wide (4 query heads, 2 key/value heads: hidden size 128), the smallest head size
vLLM's CPU attention kernels take, and hidden size = heads x head size, because some engines derive
the head size from it. Head counts follow the family's smallest real model where that matters for
layouts (gemma3-1b has 1 key/value head, so tensor parallelism over 2 ranks cannot split it).
deepseek_v3 has DeepSeek-V3's own latent sizes (kv_lora_rank 512 + rope 64: vLLM's CPU MLA kernel
takes only that sum) and routing settings (noaux_tc, sigmoid scores). The quirks are scaled so that
they bite at this size: gemma2's soft caps are far below its real
30/50 (random 64-wide logits never reach those), granite's multipliers and cohere's logit scale
are the real ones, and sliding windows are 16 tokens, shorter than the test sequences.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "models" / "tiny-qwen2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
VOCAB = 1024  # the fixture tokenizer's
WINDOW = 16  # sliding windows: shorter than the test sequences, so they cross it

COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,  # peaked enough that greedy decoding has no near-ties
    "eos_token_id": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
}


@dataclass(frozen=True)
class Family:
    name: str  # transformers' model_type
    config_class: str
    model_class: str
    kwargs: dict
    quirks: str  # what the family adds over a plain llama, for the test ids and docs
    moe: bool = False


def _attn(heads: int, kv: int, head_dim: int = 32, layers: int = 2, intermediate: int = 128) -> dict:
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,  # deepseek_v3 reads it as the rotary part of its query/key heads
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
    }


_ALTERNATING = ["sliding_attention", "full_attention"]

FAMILY_LIST = [
    Family("llama", "LlamaConfig", "LlamaForCausalLM", {**_attn(4, 2), "tie_word_embeddings": True}, "tied embeddings"),
    Family(
        "mistral",
        "MistralConfig",
        "MistralForCausalLM",
        {**_attn(4, 2), "sliding_window": WINDOW, "tie_word_embeddings": False},
        "sliding window on every layer",
    ),
    Family(
        "qwen2",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {**_attn(4, 2), "tie_word_embeddings": True},
        "q/k/v bias, tied embeddings",
    ),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {**_attn(4, 2), "tie_word_embeddings": False}, "q/k norm"),
    Family(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_attn(4, 2),
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
        "MoE top-2 of 8, q/k norm",
        moe=True,
    ),
    Family(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            **_attn(4, 2),
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "query_pre_attn_scalar": 32,
            # the real model's caps are 30 (logits) and 50 (attention scores); these bite at this size
            "final_logit_softcapping": 3.0,
            "attn_logit_softcapping": 2.0,
            # real gemma-2 configs carry the activation under both names; transformers 5 writes only
            # hidden_activation, and engines (SGLang) that read hidden_act would refuse the checkpoint
            "hidden_act": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
        },
        "logit and attention soft-capping, alternating sliding window, tied embeddings",
    ),
    Family(
        "gemma3_text",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **_attn(4, 1),
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "query_pre_attn_scalar": 32,
            "tie_word_embeddings": True,
        },
        "sliding/full layers with their own RoPE bases, q/k norm, 1 key/value head",
    ),
    Family(
        "phi3", "Phi3Config", "Phi3ForCausalLM", {**_attn(4, 4), "tie_word_embeddings": False}, "fused qkv and gate/up"
    ),
    Family(
        "olmo2",
        "Olmo2Config",
        "Olmo2ForCausalLM",
        {**_attn(4, 4), "tie_word_embeddings": False},
        "q/k norm over all heads, post-norms",
    ),
    Family(
        "granite",
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            **_attn(4, 2),
            "embedding_multiplier": 12.0,
            "logits_scaling": 16.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0078125,
            "tie_word_embeddings": True,
        },
        "logits divided by logits_scaling, embedding/residual/attention multipliers",
    ),
    Family(
        "cohere",
        "CohereConfig",
        "CohereForCausalLM",
        {**_attn(4, 2), "logit_scale": 0.0625, "tie_word_embeddings": True},
        "logits multiplied by logit_scale, parallel attention and MLP, LayerNorm",
    ),
    Family(
        "mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_attn(4, 2), "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64},
        "MoE top-2 of 4",
        moe=True,
    ),
    Family(
        "deepseek_v3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_attn(4, 4, head_dim=64, layers=3),
            "q_lora_rank": 32,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "topk_method": "noaux_tc",  # what vLLM reads to route as transformers does (bias-corrected)
            "scoring_func": "sigmoid",
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "tie_word_embeddings": False,
        },
        "multi-head latent attention, grouped top-2 of 8 with a shared expert, first layer dense",
        moe=True,
    ),
    Family(
        "glm4_moe",
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {
            **_attn(4, 2, layers=3),
            "attention_bias": True,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "tie_word_embeddings": False,
        },
        "partial RoPE, top-2 of 8 with a shared expert, first layer dense",
        moe=True,
    ),
    Family(
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **_attn(4, 2, intermediate=64),
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 32,
                "truncate": False,
            },
            "tie_word_embeddings": False,
        },
        "attention sinks, alternating sliding window, MoE top-2 of 4",
        moe=True,
    ),
]
FAMILIES: dict[str, Family] = {f.name: f for f in FAMILY_LIST}
MOE_FAMILIES = [f.name for f in FAMILY_LIST if f.moe]


def build(family: str, out_dir: Path, *, seed: int = 0, **overrides) -> Path:
    """Write the tiny checkpoint of ``family`` to ``out_dir`` (fp32 safetensors, fixture tokenizer);
    ``overrides``: config values over the family's (docs/engine-findings/ varies one)."""
    import torch
    import transformers

    fam = FAMILIES[family]
    config = getattr(transformers, fam.config_class)(**{**COMMON, **fam.kwargs, **overrides})
    model_class: Callable = getattr(transformers, fam.model_class)
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    model.config.dtype = "float32"
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(FIXTURE / name, out_dir / name)
    return out_dir


def build_all(root: Path, families: list[str] | None = None) -> dict[str, Path]:
    return {name: build(name, root / f"tiny-{name}") for name in families or FAMILIES}


if __name__ == "__main__":  # python tests/tiny_models.py FAMILY OUT_DIR: one checkpoint (docs/engine-findings/)
    import sys

    if len(sys.argv) != 3 or sys.argv[1] not in FAMILIES:
        raise SystemExit(f"usage: python tests/tiny_models.py FAMILY OUT_DIR  (FAMILY: {', '.join(FAMILIES)})")
    print(build(sys.argv[1], Path(sys.argv[2])))

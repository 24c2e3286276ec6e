"""Tiny random checkpoints of other model families, built at test time (nothing from a hub).

Each is a standard Hugging Face directory: the family's own config class with a few layers and
hidden size 64, random weights from a fixed seed saved as safetensors, and the fixture's
tokenizer, chat template and generation config. ``build(family, out_dir)`` writes one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "models" / "tiny-qwen2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
VOCAB = 1024  # the fixture tokenizer's


def _gpt_oss():
    """gpt-oss: attention sinks (no SDPA kernel in transformers), alternating sliding-window and
    full attention, a MoE MLP. The window is small so that test sequences cross it."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 32,
            "truncate": False,
        },
        initializer_range=0.1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return config, GptOssForCausalLM


FAMILIES = {"gpt_oss": _gpt_oss}


def build(family: str, out_dir: Path, *, seed: int = 0) -> Path:
    import torch

    config, model_class = FAMILIES[family]()
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    model.config.dtype = "float32"
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(FIXTURE / name, out_dir / name)
    return out_dir

"""Loading Hugging Face checkpoints from a local directory, shared by the hf engine and the reference.

Nothing is downloaded: the model must be a local directory. ``trust_remote_code`` stays off
unless the user asks for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError

TORCH_DTYPES = ("float32", "bfloat16", "float16")


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"model path {str(p)!r} does not exist", hint="give a local Hugging Face checkpoint directory")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model path {str(p)!r} has no config.json; is it a Hugging Face checkpoint directory?")
    return p


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path / 'config.json'} is not valid JSON ({exc})") from None


def checkpoint_dtype(path: Path) -> str:
    """The dtype the checkpoint declares (``dtype`` or legacy ``torch_dtype``); float32 if none."""
    cfg = read_config(path)
    text_cfg = cfg.get("text_config") or {}
    value = cfg.get("dtype") or cfg.get("torch_dtype") or text_cfg.get("dtype") or text_cfg.get("torch_dtype")
    return value if value in TORCH_DTYPES else "float32"


def max_model_len(path: Path, tokenizer=None) -> int:
    cfg = read_config(path)
    text_cfg = cfg.get("text_config") or {}
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = cfg.get(key) or text_cfg.get(key)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**9:
        return limit
    raise ConfigError(f"cannot tell the context length of {path}: config.json has no max_position_embeddings")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but torch sees no CUDA device", hint="use device = 'cpu' or 'auto'")
    return device


def resolve_dtype(dtype: str, model_path: Path) -> str:
    return checkpoint_dtype(model_path) if dtype == "auto" else dtype


def load_tokenizer(model_path: Path, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except Exception as exc:  # the message names the missing file or class
        raise ConfigError(f"cannot load the tokenizer from {model_path}: {exc}") from None


def load_causal_lm(model_path: Path, *, dtype: str, attn_implementation: str, device: str, trust_remote_code: bool):
    """A causal LM in eval mode on ``device`` with ``dtype`` weights."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bars are the ones on screen
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path),
            dtype=getattr(torch, dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    except (ImportError, ValueError) as exc:
        # e.g. flash_attention_2 not installed, or an architecture that needs remote code
        raise ConfigError(f"cannot load {model_path} with attn_implementation={attn_implementation!r}: {exc}") from None
    return model.to(device).eval()


def stop_token_ids(model_path: Path, tokenizer) -> list[int]:
    """EOS ids from generation_config.json and the tokenizer (deduplicated, in that order)."""
    ids: list[int] = []
    gen_cfg = model_path / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    eos = read_config(model_path).get("eos_token_id")
    ids.extend(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    out = list(dict.fromkeys(i for i in ids if i is not None))
    if not out:
        raise ConfigError(f"{model_path}: no EOS token in generation_config.json, config.json or the tokenizer")
    return out


def free_accelerator_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

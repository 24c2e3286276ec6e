"""Loading Hugging Face checkpoints from a local directory, shared by the hf engine and the reference.

Nothing is downloaded: the model must be a local directory. ``trust_remote_code`` stays off
unless the user asks for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ConfigError

TORCH_DTYPES = ("float32", "bfloat16", "float16")


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            f"model path {str(p)!r} does not exist", hint="give a local Hugging Face checkpoint directory"
        )
    if not (p / "config.json").is_file():
        raise ConfigError(f"model path {str(p)!r} has no config.json; is it a Hugging Face checkpoint directory?")
    check_weight_files(p)
    return p


def check_engine_checkpoint(checkpoint: str | Path, model_path: Path, tokenizer, *, trust_remote_code: bool) -> Path:
    """engine.checkpoint: a checkpoint directory whose tokenizer maps every token as the model's
    does (the engine gets the model's token ids; a different vocabulary would score other tokens)."""
    path = check_model_dir(checkpoint)
    theirs = load_tokenizer(path, trust_remote_code=trust_remote_code)
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"engine.checkpoint {str(path)!r} has another vocabulary than the model {str(model_path)!r}",
            hint="give an export of the model itself (the same tokenizer), e.g. a quantized one",
        )
    return path


def check_sync_start(start: str | Path, model_path: Path) -> Path:
    """sync.start_from: the weights before the step, into which the engine syncs the model's, so
    the same architecture, vocabulary and tensors (names and shapes, read from the safetensors
    headers) as the model. Another checkpoint would start an engine whose update fails midway."""
    from safetensors import safe_open

    path = Path(start)
    hint = "give the model's own weights from before a training step, or sync.start_from = 'perturbed'"
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ConfigError(
            f"sync.start_from {str(start)!r} is not a checkpoint directory (config.json and *.safetensors files)",
            hint=hint,
        )
    mine, theirs = read_config(model_path), read_config(path)

    def kind(cfg: dict) -> str:
        return "/".join(cfg.get("architectures") or []) or str(cfg.get("model_type"))

    if any(mine.get(key) != theirs.get(key) for key in ("architectures", "model_type")):
        raise ConfigError(
            f"sync.start_from {str(path)!r} is a {kind(theirs)} checkpoint, the model {str(model_path)!r} a "
            f"{kind(mine)}: the engine could not take the model's weights",
            hint=hint,
        )

    def vocab(cfg: dict) -> object:
        return text_setting(cfg, "vocab_size")

    if vocab(mine) != vocab(theirs):
        raise ConfigError(
            f"sync.start_from {str(path)!r} has a vocabulary of {vocab(theirs)} tokens, the model {vocab(mine)}",
            hint=hint,
        )

    def shapes(directory: Path) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for f in sorted(directory.glob("*.safetensors")):
            with safe_open(str(f), framework="np") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                    out[name] = tuple(handle.get_slice(name).get_shape())
        return out

    model_shapes, start_shapes = shapes(model_path), shapes(path)
    differ = [
        f"{name} {start_shapes.get(name, 'absent')} (model: {model_shapes.get(name, 'absent')})"
        for name in sorted(set(model_shapes) | set(start_shapes))
        if model_shapes.get(name) != start_shapes.get(name)
    ]
    if differ:
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise ConfigError(
            f"sync.start_from {str(path)!r} holds other tensors than the model: {'; '.join(differ[:3])}{more}",
            hint=hint,
        )
    return path


def checkpoint_quantization(path: Path) -> dict | None:
    """What a checkpoint's config.json declares about its quantization (``quantization_config``):
    the method, its format and, per group of layers, the weights' and activations' number format
    and scale granularity, and the layers left unquantized. None for a checkpoint that declares none."""
    declared = read_config(path).get("quantization_config")
    if not isinstance(declared, dict):
        return None

    def number(args: dict | None) -> str | None:
        if not args:
            return None
        kind = {"int": "int", "float": "fp"}.get(str(args.get("type")), str(args.get("type")))
        how = "dynamic" if args.get("dynamic") else "static"
        group = f", groups of {args['group_size']}" if args.get("group_size") else ""
        symmetric = "symmetric" if args.get("symmetric", True) else "asymmetric"
        return f"{kind}{args.get('num_bits')} per {args.get('strategy')}{group}, {symmetric}, {how} scales"

    out: dict = {"method": declared.get("quant_method")}
    for key in ("format", "fmt", "weight_block_size", "bits", "group_size", "activation_scheme"):
        if declared.get(key) is not None:
            out[key] = declared[key]
    groups = declared.get("config_groups")
    if isinstance(groups, dict):
        out["groups"] = {
            name: {
                "targets": g.get("targets"),
                "weights": number(g.get("weights")),
                "activations": number(g.get("input_activations")) or "not quantized",
            }
            for name, g in groups.items()
            if isinstance(g, dict)
        }
    ignored = declared.get("ignore") or declared.get("modules_to_not_convert")
    if ignored:
        out["not_quantized"] = list(ignored)
    if declared.get("kv_cache_scheme"):
        out["kv_cache"] = number(declared["kv_cache_scheme"])
    return out


def check_weight_files(path: Path) -> None:
    """Every safetensors file's header parses and its data covers what the header declares, and
    every shard the index names is there: a damaged checkpoint is bad input, found here in
    milliseconds (headers only) rather than by an engine after it has started."""
    from safetensors import SafetensorError, safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ConfigError(f"{index} is not a valid safetensors index ({exc})") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ConfigError(
                f"{index} names {len(missing)} weight file(s) that are not there, e.g. {missing[0]}",
                hint="finish copying or downloading the checkpoint",
            )
    files = sorted(path.glob("*.safetensors"))
    if not files and not any(path.glob("pytorch_model*.bin")):
        raise ConfigError(
            f"model path {str(path)!r} has no weights (*.safetensors or pytorch_model*.bin)",
            hint="give a checkpoint directory with its weight files",
        )
    for f in files:
        try:
            with safe_open(str(f), framework="np"):  # parses the header and checks the file's size
                pass
        except (SafetensorError, OSError) as exc:
            raise ConfigError(
                f"{f} is not a readable safetensors file ({exc})",
                hint="the file is damaged or incomplete: copy or download it again",
            ) from None


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path / 'config.json'} is not valid JSON ({exc})") from None


def text_setting(config: dict, key: str) -> Any:
    """A language model's setting from its config.json (``vocab_size``, ``num_hidden_layers``): at the
    top, or in ``text_config`` where a multimodal checkpoint keeps its text model's; None when absent."""
    value, text = config.get(key), config.get("text_config")
    return value if value is not None or not isinstance(text, dict) else text.get(key)


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


# Any of these makes a directory a tokenizer's: the fast tokenizer, its config, or a slow
# tokenizer's vocabulary (BPE, WordPiece, SentencePiece, tiktoken).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "merges.txt",
)


def load_tokenizer(model_path: Path, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    missing_hint = (
        "copy the tokenizer files of the checkpoint these weights came from into the directory "
        "(usually tokenizer.json and tokenizer_config.json)"
    )
    if not any((model_path / f).is_file() for f in TOKENIZER_FILES) and not any(model_path.glob("*.tiktoken")):
        # transformers would build an empty tokenizer from config.json alone and fail much later
        raise ConfigError(
            f"model path {str(model_path)!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)",
            hint=missing_hint,
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except Exception as exc:  # the message names the missing file or class
        raise ConfigError(f"cannot load the tokenizer from {model_path}: {exc}") from None
    if len(tokenizer) <= 1:
        raise ConfigError(f"the tokenizer in {model_path} has an empty vocabulary", hint=missing_hint)
    return tokenizer


@dataclass(frozen=True)
class AttentionChoice:
    """The attention implementation a side runs with, and why, for run.json and the report."""

    requested: str  # "auto" or what the user set
    used: str
    fallback_reason: str | None = None  # set when "auto" could not use the default (sdpa)

    def record(self) -> dict:
        return {
            "attn_implementation": self.used,
            "attn_implementation_requested": self.requested,
            **({"attn_fallback": self.fallback_reason} if self.fallback_reason else {}),
        }


def causal_lm_class(model_path: Path, *, trust_remote_code: bool):
    """The class ``AutoModelForCausalLM`` would instantiate for this checkpoint, or None if that
    cannot be told without loading it (then transformers decides at load time)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
        auto_map = getattr(config, "auto_map", None) or {}
        if trust_remote_code and "AutoModelForCausalLM" in auto_map:
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            return get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(model_path))
        return AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:  # an unknown architecture fails at load time, with transformers' own message
        return None


# what each attn_implementation needs the model class to declare
_SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
}


# attention implementations that run a model's soft-capped attention scores (gemma2's
# attn_logit_softcapping): transformers' sdpa path takes the cap and ignores it
_SOFTCAP_ATTENTION = ("eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def attention_softcap(config: dict) -> float | None:
    """The cap on attention scores (``attn_logit_softcapping``) ``config`` (config.json) sets, if any."""
    cfg = config.get("text_config") or config
    value = cfg.get("attn_logit_softcapping")
    return float(value) if isinstance(value, int | float) and value > 0 else None


def choose_attention(model_path: Path, requested: str | None, *, trust_remote_code: bool) -> AttentionChoice:
    """``auto`` (or unset) is SDPA where the architecture supports it and eager attention where it
    does not (gpt-oss's attention sinks, for one, have no SDPA kernel in transformers; eager runs
    them exactly, on every device), or where SDPA would silently run another model (gemma2's
    soft-capped attention scores: transformers' SDPA path drops the cap). An explicit choice that
    does not run the architecture is refused here, before anything loads."""
    requested = requested or "auto"
    cls = causal_lm_class(model_path, trust_remote_code=trust_remote_code)
    name = cls.__name__ if cls is not None else "this architecture"
    softcap = attention_softcap(read_config(model_path))
    softcap_reason = (
        f"{name} soft-caps attention scores (attn_logit_softcapping={softcap:g}), which transformers' sdpa ignores"
        if softcap
        else None
    )

    def supports(impl: str) -> bool:
        if softcap and impl not in _SOFTCAP_ATTENTION:
            return False
        return cls is None or impl not in _SUPPORT_FLAGS or bool(getattr(cls, _SUPPORT_FLAGS[impl], False))

    if requested == "auto":
        if supports("sdpa"):
            return AttentionChoice(requested, "sdpa")
        why = softcap_reason or f"{name} does not support sdpa in transformers (_supports_sdpa = False)"
        return AttentionChoice(requested, "eager", f"{why}; eager attention runs it exactly")
    if not supports(requested):
        if softcap_reason and requested not in _SOFTCAP_ATTENTION:
            raise ConfigError(
                f"attn_implementation={requested!r} cannot run {name}: it soft-caps attention scores "
                f"(attn_logit_softcapping={softcap:g}) and {requested!r} ignores the cap",
                hint="use 'auto' or 'eager' (or flex_attention / flash_attention_2, which apply it)",
            )
        raise ConfigError(
            f"{name} does not support attn_implementation={requested!r} in transformers",
            hint="use 'auto' (sdpa where supported, else eager) or 'eager'",
        )
    return AttentionChoice(requested, requested)


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
        raise ConfigError(
            f"cannot load {model_path} with attn_implementation={attn_implementation!r}: {exc}",
            hint="attn_implementation = 'auto' picks one the architecture supports",
        ) from None
    model = model.to(device).eval()
    # transformers' flex_attention cannot return the log-sum-exp on CPU, which attention sinks
    # (gpt-oss's per-head `sinks`) need: it would fail at the first forward with a traceback
    if (
        attn_implementation == "flex_attention"
        and str(device) == "cpu"
        and any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules())
    ):
        raise ConfigError(
            f"attn_implementation='flex_attention' cannot run {model_path.name}'s attention sinks on CPU "
            "(transformers' flex_attention refuses them there)",
            hint="use 'auto' or 'eager' on CPU; flex_attention runs them on a CUDA device",
        )
    return model


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

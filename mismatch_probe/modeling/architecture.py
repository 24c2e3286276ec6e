"""What a checkpoint's architecture does beyond a plain decoder, for run.json and the environment card.

Families differ in ways that move log-probs if one side misses them: logits soft-capped (gemma2)
or scaled (cohere multiplies, granite divides), attention scores soft-capped (gemma2), attention
sinks (gpt-oss), sliding-window layers, tied input/output embeddings, MoE routing with shared
experts or grouped top-k, latent attention (deepseek_v3). :func:`describe_architecture` reads
them from the resolved config (``transformers``' config object, defaults filled in) and the
checkpoint's weight names, and says, for each, how the reference runs it. Pure: no weights load.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _get(cfg: Any, *names: str) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _sliding(cfg: Any) -> dict | None:
    window = _get(cfg, "sliding_window")
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    n_layers = _get(cfg, "num_hidden_layers") or 0
    types = list(_get(cfg, "layer_types") or [])
    if types:
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif (max_window := _get(cfg, "max_window_layers")) is not None and _get(cfg, "use_sliding_window"):
        layers = [i for i in range(n_layers) if i >= max_window]  # qwen2-style: the layers from max_window_layers on
    else:
        layers = list(range(n_layers))
    if not layers:
        return None
    return {"size": int(window), "layers": layers, "of_layers": n_layers}


def _moe(cfg: Any) -> dict | None:
    experts = _get(cfg, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = _get(cfg, "num_experts_per_tok", "moe_topk")
    if not experts or not top_k:
        return None
    out: dict[str, Any] = {"routed_experts": int(experts), "top_k": int(top_k)}
    if shared := _get(cfg, "n_shared_experts", "num_shared_experts"):
        out["shared_experts"] = int(shared)
    elif _get(cfg, "shared_expert_intermediate_size"):
        out["shared_experts"] = 1
    if dense := _get(cfg, "first_k_dense_replace"):
        out["first_dense_layers"] = int(dense)
    if (groups := _get(cfg, "n_group")) and int(groups) > 1:
        out["grouped_routing"] = {"groups": int(groups), "top_groups": int(_get(cfg, "topk_group") or 1)}
    if (scale := _get(cfg, "routed_scaling_factor")) not in (None, 1, 1.0):
        out["routed_scaling_factor"] = float(scale)
    return out


def describe_architecture(config: Any, weight_names: Iterable[str] = ()) -> dict:
    """The architecture and its quirks: ``config`` is a transformers config (or anything with the
    same attributes), ``weight_names`` the checkpoint's tensor names. ``quirks`` are one line each,
    saying what the model does and how the reference runs it."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    names = list(weight_names)
    architectures = _get(config, "architectures") or []
    heads, kv_heads = _get(cfg, "num_attention_heads"), _get(cfg, "num_key_value_heads")
    desc: dict[str, Any] = {
        "model_type": _get(config, "model_type"),
        "architecture": architectures[0] if architectures else None,
        "layers": _get(cfg, "num_hidden_layers"),
        "hidden_size": _get(cfg, "hidden_size"),
        "vocab_size": _get(cfg, "vocab_size"),
        "attention_heads": heads,
        "kv_heads": kv_heads or heads,
    }
    quirks: list[str] = []
    if (softcap := _get(cfg, "final_logit_softcapping")) is not None:
        desc["final_logit_softcapping"] = float(softcap)
        quirks.append(f"logits soft-capped at {softcap:g} (c*tanh(x/c)); the reference applies it after its LM head")
    if (scale := _get(cfg, "logit_scale")) is not None:
        desc["logit_scale"] = float(scale)
        quirks.append(f"logits multiplied by logit_scale {scale:g}; the reference applies it after its LM head")
    if (scaling := _get(cfg, "logits_scaling")) is not None and scaling != 1:
        desc["logits_scaling"] = float(scaling)
        quirks.append(f"logits divided by logits_scaling {scaling:g}; the reference applies it after its LM head")
    if (attn_cap := _get(cfg, "attn_logit_softcapping")) is not None:
        desc["attn_logit_softcapping"] = float(attn_cap)
        quirks.append(
            f"attention scores soft-capped at {attn_cap:g} (auto attention is eager: transformers' sdpa ignores the cap)"
        )
    if any(name.endswith(".sinks") for name in names):
        desc["attention_sinks"] = True
        quirks.append("attention sinks, a learned logit per head (auto attention is eager: sdpa has no sink term)")
    if sliding := _sliding(cfg):
        desc["sliding_window"] = sliding
        which = (
            "every layer"
            if len(sliding["layers"]) == sliding["of_layers"]
            else f"{len(sliding['layers'])} of {sliding['of_layers']} layers ({', '.join(map(str, sliding['layers']))})"
        )
        quirks.append(f"sliding-window attention ({sliding['size']} tokens) on {which}")
    if kv_lora := _get(cfg, "kv_lora_rank"):
        desc["latent_attention"] = {"kv_lora_rank": int(kv_lora), "q_lora_rank": _get(cfg, "q_lora_rank")}
        quirks.append(f"multi-head latent attention (kv_lora_rank {kv_lora}); value heads narrower than query heads")
    rope = _get(cfg, "rope_parameters") or {}
    partial = _get(cfg, "partial_rotary_factor") or (
        rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    )
    if partial is not None and float(partial) < 1:
        desc["partial_rotary_factor"] = float(partial)
        quirks.append(f"rotary embedding on {float(partial):.0%} of each head")
    tied = _tied(cfg, names)
    desc["tied_embeddings"] = tied
    if tied:
        quirks.append("tied input/output embeddings (the LM head is the embedding matrix)")
    if moe := _moe(cfg):
        desc["moe"] = moe
        line = f"MoE: top-{moe['top_k']} of {moe['routed_experts']} routed experts"
        if "shared_experts" in moe:
            line += f", {moe['shared_experts']} shared expert(s) on every token"
        if "first_dense_layers" in moe:
            line += f", first {moe['first_dense_layers']} layer(s) dense"
        if "grouped_routing" in moe:
            g = moe["grouped_routing"]
            line += f", grouped routing (top {g['top_groups']} of {g['groups']} groups)"
        quirks.append(line)  # whether the run compared the routing is the run's to say (report/labels.py)
    desc["quirks"] = quirks
    return desc


def _tied(cfg: Any, names: list[str]) -> bool:
    """Tied when the config says so; a checkpoint without an output-embedding tensor is tied too."""
    if getattr(cfg, "tie_word_embeddings", None) is not None:
        return bool(cfg.tie_word_embeddings)
    return bool(names) and not any(n.endswith("lm_head.weight") for n in names)


def checkpoint_weight_names(model_path: Path) -> list[str]:
    """Tensor names from the safetensors headers (no data is read)."""
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as handle:
            names.extend(handle.keys())
    return names


def describe_checkpoint(model_path: Path, *, trust_remote_code: bool = False) -> dict | None:
    """:func:`describe_architecture` of a local checkpoint; None when transformers cannot read
    its config (the engines then say why, with their own messages)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code)
    except Exception:
        return None
    return describe_architecture(config, checkpoint_weight_names(model_path))

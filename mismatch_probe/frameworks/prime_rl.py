"""prime-rl: the ``rl`` entrypoint's TOML (``uv run rl @ configs/.../rl.toml``, one file with
``[trainer]``, ``[orchestrator]`` and ``[inference]`` tables, or one file per component with
``--trainer @ train.toml``, ``--orchestrator @ orch.toml``, ``--inference @ infer.toml``) and its
``--key value`` overrides (dashes or underscores), later ones winning, as pydantic-settings reads
them. Defaults and code read at prime-rl ``559b447`` (docs/frameworks/prime-rl.md cites the same
commit); ``configs/...`` paths are under ``packages/prime-rl-configs/src/prime_rl/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe.errors import ConfigError
from mismatch_probe.frameworks.base import SKIP, Found, FrameworkConfig, Origin, Rule
from mismatch_probe.frameworks.sources import flatten, parse_scalar, read_structured

COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"

_CFG = "packages/prime-rl-configs/src/prime_rl/configs"
I = "inference."
VL = "inference.vllm."
SAMP = "orchestrator.train.sampling."
TM = "trainer.model."

DEFAULTS: dict[str, tuple[Any, str]] = {
    "model.name": ("Qwen/Qwen3-0.6B", f"{_CFG}/rl.py:124"),
    VL + "dtype": ("auto", f"{_CFG}/inference.py:60"),
    VL + "max_model_len": (None, f"{_CFG}/inference.py:63"),
    VL + "enforce_eager": (False, f"{_CFG}/inference.py:66"),
    VL + "tensor_parallel_size": (1, f"{_CFG}/inference.py:84"),
    VL + "data_parallel_size": (1, f"{_CFG}/inference.py:87"),
    VL + "gpu_memory_utilization": (0.9, f"{_CFG}/inference.py:102"),
    VL + "enable_prefix_caching": (None, f"{_CFG}/inference.py:105"),
    VL + "quantization": (None, f"{_CFG}/inference.py:108"),
    VL + "logprobs_mode": ("processed_logprobs", f"{_CFG}/inference.py:611-613"),
    I + "enable_fp32_lm_head": (True, f"{_CFG}/inference.py:466"),
    "orchestrator.group_size": (1, f"{_CFG}/orchestrator.py:517"),
    SAMP + "temperature": (1.0, f"{_CFG}/orchestrator.py:47"),
    SAMP + "max_completion_tokens": (None, f"{_CFG}/orchestrator.py:50"),
    TM + "attn": ("auto", f"{_CFG}/trainer.py:185"),
    TM + "cp": (1, f"{_CFG}/trainer.py:224"),
    TM + "cp_style": ("ring", f"{_CFG}/trainer.py:227"),
    TM + "optimization_dtype": ("float32", f"{_CFG}/trainer.py:233"),
    TM + "reduce_dtype": ("float32", f"{_CFG}/trainer.py:236"),
}

ENGINE_PINS = {"vllm": "vllm>=0.26.0, locked 0.26.0+cu129 (pyproject.toml:21,224-227; uv.lock:7629-7631)"}
MODEL_KEYS = ("model.name", TM + "name", VL + "model")
# prime-rl trains on verifiers environments, named by id, not on a dataset file
DATASET_KEYS: tuple[str, ...] = ()
PROMPT_KEY_KEYS: tuple[str, ...] = ()

_HEAD = "src/prime_rl/inference/patches.py:658-719"
_TRAINER_HEAD = "src/prime_rl/trainer/models/layers/lm_head.py:134-135"
_ATTN = {"flash_attention_2": "flash_attention_2", "flash_attention_3": "flash_attention_3", "sdpa": "sdpa"}
_ATTN |= {"eager": "eager", "flex_attention": "flex_attention"}


def _optional(convert):
    """A pass-through key vLLM leaves to its own default when unset."""
    return lambda v: SKIP if v is None else convert(v)


def _logprobs_mode(value: Any) -> Any:
    return {"processed_logprobs": "processed", "raw_logprobs": "raw"}.get(str(value), SKIP)


RULES: list[Rule] = [
    Rule("engine.name", code_at=f"{_CFG}/inference.py:446", value="vllm", note="vLLM is prime-rl's only engine"),
    Rule("engine.dtype", (VL + "dtype",), str),
    Rule("engine.max_model_len", (VL + "max_model_len",), _optional(int)),
    Rule("engine.enforce_eager", (VL + "enforce_eager",), bool),
    Rule("engine.tensor_parallel_size", (VL + "tensor_parallel_size",), int),
    Rule("engine.data_parallel_size", (VL + "data_parallel_size",), int),
    Rule("engine.gpu_memory_utilization", (VL + "gpu_memory_utilization",), float),
    Rule("engine.prefix_caching", (VL + "enable_prefix_caching",), _optional(bool)),
    Rule("engine.quantization", (VL + "quantization",), _optional(str)),
    Rule("engine.logprobs_mode", (VL + "logprobs_mode",), _logprobs_mode),
    # vLLM arguments [inference.vllm] passes through by vLLM's name (configs/inference.py:42-56)
    Rule("engine.kv_cache_dtype", (VL + "kv_cache_dtype",), _optional(str)),
    Rule("engine.max_num_seqs", (VL + "max_num_seqs",), _optional(int)),
    Rule("engine.max_num_batched_tokens", (VL + "max_num_batched_tokens",), _optional(int)),
    Rule("engine.chunked_prefill", (VL + "enable_chunked_prefill",), _optional(bool)),
    Rule("engine.cascade_attn", (VL + "disable_cascade_attn",), _optional(lambda v: not bool(v))),
    Rule("engine.record_routing", (VL + "enable_return_routed_experts",), _optional(bool)),
    Rule("sampling.temperature", (SAMP + "temperature",), float),
    Rule(
        "sampling.top_p",
        code_at=f"{_CFG}/orchestrator.py:62",
        value=1.0,
        note="fixed for training; a top_k in the checkpoint's generation_config.json still applies",
    ),
    Rule("sampling.n", ("orchestrator.group_size",), int),
    Rule("sampling.max_tokens", (SAMP + "max_completion_tokens",), _optional(int), note="tokens per turn"),
    # the trainer: FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16) (src/prime_rl/trainer/model.py:824)
    Rule("reference.fsdp", code_at="src/prime_rl/trainer/model.py:824", value=True),
    Rule("reference.fsdp_param_dtype", code_at="src/prime_rl/trainer/model.py:824", value="bfloat16"),
    Rule("reference.dtype", (TM + "optimization_dtype",), str, note="the master weights"),
    Rule("reference.fsdp_reduce_dtype", (TM + "reduce_dtype",), str),
    Rule(
        "reference.attn_implementation",
        (TM + "attn",),
        lambda v: _ATTN.get(str(v), SKIP),
        note="auto is FA3 on Hopper, FA4 on Blackwell (no probe kernel for FA4)",
    ),
    Rule(
        "reference.sequence_parallel_size",
        (TM + "cp", TM + "cp_style"),
        lambda cp, style: int(cp) if style == "ulysses" or int(cp) == 1 else SKIP,
    ),
    Rule(
        "reference.logprobs",
        code_at="src/prime_rl/trainer/rl/train.py:415-441",
        value="temperature",
        note="the trainer divides the logits by each token's temperature",
    ),
    Rule(
        "reference.logits_fp32",
        code_at=_TRAINER_HEAD,
        value=False,
        note="the trainer's LM head is a bf16 matmul, cast to float32 after it",
    ),
]

# [inference] enable_fp32_lm_head (a prime-rl patch of vLLM, no probe key) is the risk
# one-sided-fp32-head (facts below), not a line of its own here
UNMIRRORABLE: dict[str, str] = {
    I + "enable_fp32_router_logits": "fp32 MoE gate of DeepSeek-family models, a prime-rl patch of vLLM: no probe key",
    TM
    + "cp_style": "ring attention context parallelism has no probe key (Ulysses maps to reference.sequence_parallel_size)",
    TM + "cp": "ring attention context parallelism has no probe key",
    TM + "impl": "prime-rl's own model code: the probe's reference is transformers",
    "trainer.matmul_precision": "TF32 matmuls in the trainer: run.json's numerics records the probe's own",
    "trainer.loss.dppo_mask_low": "masks by p_train - p_infer, not by a ratio: no [corrections] key (prob_diff_* metrics read it)",
    "trainer.loss.dppo_mask_high": "masks by p_train - p_infer, not by a ratio: no [corrections] key (prob_diff_* metrics read it)",
    "orchestrator.max_off_policy_steps": "asynchronous staleness is not part of a probe; import and timeline see it",
    SAMP + "extra_body": "forwarded to vLLM as is: pass what it sets with the matching sampling flags",
    "inference.weight_broadcast.type": "how weights reach the engine is a [sync] setting (sync.transfer), not compare's",
}
# the engine's arguments, whose keys no rule reads are listed as not mirrored
WATCHED = (VL,)
NOT_SETTINGS = frozenset({VL + "model", VL + "seed", VL + "tool_call_parser", VL + "reasoning_parser"})

_SECTIONS = ("trainer", "orchestrator", "inference")


def read(inputs: list[str]) -> FrameworkConfig:
    """``inputs``: ``@ file.toml`` / ``@file.toml`` / a bare ``file.toml`` (the rl config),
    ``--trainer @ f.toml`` (a component's file under its table) and ``--key.sub value`` overrides."""
    config = FrameworkConfig("prime-rl", COMMIT, DEFAULTS)
    words = [w for w in inputs if w not in ("uv", "run", "rl")]
    i = 0
    while i < len(words):
        word = words[i]
        section = ""
        if word.startswith("--") and word[2:] in _SECTIONS and i + 1 < len(words) and words[i + 1].startswith("@"):
            section, i = word[2:], i + 1
            word = words[i]
        if word.startswith("@") or word.endswith(".toml"):
            name = word.lstrip("@").strip() or (words[i + 1] if i + 1 < len(words) else "")
            if word == "@":
                i += 1
            _load(config, name, section)
            i += 1
            continue
        if word.startswith("--"):
            key, eq, value = word[2:].partition("=")
            if not eq:
                if i + 1 < len(words) and not words[i + 1].startswith("--"):
                    value, i = words[i + 1], i + 1
                else:
                    value = "true"  # a bare boolean flag
            config.set(key.replace("-", "_"), parse_scalar(value), "command line")
            i += 1
            continue
        raise ConfigError(
            f"{word!r} is neither a TOML config nor one of prime-rl's key overrides",
            hint="give prime-rl's rl.toml and its overrides as its rl command takes them (orchestrator.group-size 8, dashed)",
        )
    return config


def _load(config: FrameworkConfig, name: str, section: str) -> None:
    path = Path(name)
    if path.suffix != ".toml":
        raise ConfigError(f"{name}: prime-rl's configs are TOML", hint="give the rl.toml (or a component's .toml)")
    config.files.append(name)
    tree = read_structured(path)
    for key, value in flatten({section: tree} if section else tree):
        config.set(key, value, name)


def facts(config: FrameworkConfig) -> dict[str, Found]:
    found = config.get(I + "enable_fp32_lm_head")
    if found is None:
        return {}
    out = {"engine_lm_head_fp32": Found(bool(found.value), found.origin)}
    if found.value:
        out["evidence:one-sided-fp32-head"] = Found(
            f"prime-rl {found.origin}: the engine's LM head is a bf16 x bf16 -> fp32 GEMM ({_HEAD}); "
            f"the trainer's is a bf16 matmul cast to float32 after it ({_TRAINER_HEAD})",
            Origin(found.origin.key, found.origin.file, found.origin.default_at, "prime-rl"),
        )
    return out

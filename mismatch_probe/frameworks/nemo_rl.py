"""NeMo-RL: a YAML config with its ``defaults:`` chain, plus Hydra ``key=value`` overrides, as
``uv run examples/run_grpo.py --config FILE key=value ...`` takes them (``examples/run_grpo.py:57-96``:
``load_config`` then ``parse_hydra_overrides``). Defaults and code read at NeMo-RL ``7ea279a``
(docs/frameworks/nemo-rl.md cites the same commit); paths below are in that repository.

``load_config`` (``nemo_rl/utils/config.py:51-97``) loads each ``defaults:`` file first, its path
relative to the child's directory, then merges the child over it (OmegaConf.merge: mappings merge,
anything else replaces; a mapping marked ``_override_: true`` replaces the parent's whole). What a
file inherits through ``defaults:`` is the config's default, cited by the parent's file:line; what
the named file and the overrides set is the user's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from mismatch_probe.errors import ConfigError
from mismatch_probe.frameworks.base import SKIP, Found, FrameworkConfig, Origin, Rule, dtype_name
from mismatch_probe.frameworks.sources import hydra_override, read_structured, resolve_interpolations

COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"

P = "policy."
G = "policy.generation."
V = "policy.generation.vllm_cfg."
S = "policy.generation.sglang_cfg."
_BASE = "examples/configs/grpo_math_1B.yaml"  # run_grpo.py's config when --config is not given (:81-84)
_WORKER = "nemo_rl/models/generation/vllm/vllm_worker.py"
_SETUP = "nemo_rl/models/automodel/setup.py"
_TRAIN = "nemo_rl/models/automodel/train.py"
_LOSS = "nemo_rl/algorithms/loss/loss_functions.py"

# the base GRPO config, for a config whose defaults chain leaves a key out
DEFAULTS: dict[str, tuple[Any, str]] = {
    "grpo.num_generations_per_prompt": (16, f"{_BASE}:4"),
    "grpo.seq_logprob_error_threshold": (None, f"{_BASE}:50"),
    "loss_fn.use_importance_sampling_correction": (False, f"{_BASE}:93"),
    "loss_fn.truncated_importance_sampling_type": (None, f"{_BASE}:97"),
    "loss_fn.truncated_importance_sampling_ratio": (None, f"{_BASE}:98"),
    "loss_fn.truncated_importance_sampling_ratio_min": (None, f"{_BASE}:100"),
    "loss_fn.force_on_policy_ratio": (False, f"{_BASE}:103"),
    P + "model_name": ("Qwen/Qwen2.5-1.5B", f"{_BASE}:126"),
    P + "max_total_sequence_length": (512, f"{_BASE}:136"),
    P + "precision": ("bfloat16", f"{_BASE}:137"),
    P + "dtensor_cfg.enabled": (True, f"{_BASE}:143"),
    P + "dtensor_cfg.sequence_parallel": (False, f"{_BASE}:145"),
    P + "dtensor_cfg.tensor_parallel_size": (1, f"{_BASE}:147"),
    P + "dtensor_cfg.context_parallel_size": (1, f"{_BASE}:148"),
    P + "megatron_cfg.enabled": (False, f"{_BASE}:172"),
    P + "megatron_cfg.tensor_model_parallel_size": (1, f"{_BASE}:216"),
    P + "megatron_cfg.pipeline_model_parallel_size": (1, f"{_BASE}:219"),
    P + "megatron_cfg.context_parallel_size": (1, f"{_BASE}:222"),
    P + "sequence_packing.enabled": (True, f"{_BASE}:332"),
    G + "backend": ("vllm", f"{_BASE}:369"),
    G + "max_new_tokens": ("${policy.max_total_sequence_length}", f"{_BASE}:370"),
    G + "temperature": (1.0, f"{_BASE}:371"),
    G + "top_p": (1.0, f"{_BASE}:372"),
    G + "top_k": (None, f"{_BASE}:373"),
    V + "async_engine": (False, f"{_BASE}:412"),
    V + "precision": ("${policy.precision}", f"{_BASE}:413"),
    V + "kv_cache_dtype": ("auto", f"{_BASE}:414"),
    V + "logprobs_mode": ("processed_logprobs", f"{_BASE}:415"),
    V + "tensor_parallel_size": (1, f"{_BASE}:416"),
    V + "pipeline_parallel_size": (1, f"{_BASE}:417"),
    V + "expert_parallel_size": (1, f"{_BASE}:418"),
    V + "gpu_memory_utilization": (0.6, f"{_BASE}:419"),
    V + "max_model_len": ("${policy.max_total_sequence_length}", f"{_BASE}:420"),
    V + "enforce_eager": (False, f"{_BASE}:424"),
    V + "use_deep_gemm": (False, f"{_BASE}:426"),
    V + "num_last_layers_in_bf16": (0, f"{_BASE}:427"),
    V + "num_first_layers_in_bf16": (0, f"{_BASE}:428"),
    G + "colocated.enabled": (True, f"{_BASE}:439"),
    "data.train.dataset_name": ("OpenMathInstruct-2", f"{_BASE}:456"),
    "data.default.prompt_file": ("examples/prompts/cot.txt", f"{_BASE}:462"),
    "data.default.system_prompt_file": (None, f"{_BASE}:463"),
}

ENGINE_PINS = {
    "vllm": "vllm==0.25.1 (pyproject.toml:138-150)",
    "sglang": "sglang==0.5.12.post1 (pyproject.toml:157-160)",
}
MODEL_KEYS = (P + "model_name",)
# a local file (ResponseDataset's data_path) before a Hub dataset's name
DATASET_KEYS = ("data.train.data_path", "data.train.dataset_name")
# the train dataset's own key, else the one every dataset defaults to (grpo_math_1B.yaml:478-481)
PROMPT_KEY_KEYS = ("data.train.input_key", "data.default.input_key")


def _backend(config: FrameworkConfig) -> str:
    return str(config.value(G + "backend"))


def _on(backend: str):
    """A rule's ``when``: generation runs on ``backend`` (NeMo-RL reads that backend's table only)."""
    return lambda config: _backend(config) == backend


def _dtensor(config: FrameworkConfig) -> bool:
    return not config.value(P + "megatron_cfg.enabled") and bool(config.value(P + "dtensor_cfg.enabled"))


def _logprobs_mode(value: Any) -> Any:
    # vLLM's *_logits modes hand back logits, not log-probs: the probe has no such mode
    return {"processed_logprobs": "processed", "raw_logprobs": "raw"}.get(str(value), SKIP)


def _opt(convert):
    """A conversion of a key SGLang leaves to its own default when null (``max_running_requests: null``)."""
    return lambda v: SKIP if v is None else convert(v)


def _top_k(value: Any) -> int:
    return -1 if value is None else int(value)  # null top-k is -1 (vllm_worker.py:648)


def _correction(kind: str, bound: str):
    """The probe threshold of NeMo-RL's truncated IS of type ``kind`` (loss_functions.py:597-660):
    ``tis`` clamps token weights to [min, max], ``icepop`` masks tokens outside [min, max],
    ``seq-mask-tis`` masks sequences whose geometric-mean ratio is outside [min, max]."""

    def convert(enabled: Any, kind_set: Any, high: Any, low: Any) -> Any:
        if not enabled or kind_set != kind:
            return SKIP
        if bound == "high":
            return float(high) if high is not None else SKIP
        if bound == "low":
            return float(low) if low is not None else SKIP
        # geo_eps: the probe's bounds are 1 ± eps, so only symmetric ones map
        if high is None or low is None or abs((1.0 - float(low)) - (float(high) - 1.0)) > 1e-9:
            return SKIP
        return float(high) - 1.0

    return convert


_IS_KEYS = (
    "loss_fn.use_importance_sampling_correction",
    "loss_fn.truncated_importance_sampling_type",
    "loss_fn.truncated_importance_sampling_ratio",
    "loss_fn.truncated_importance_sampling_ratio_min",
)


def _attn(packing: Any, cp: Any) -> Any:
    # setup.py:321-325: FA2 for packed rows on one CP rank, SDPA with context parallelism, else
    # transformers' own choice (None)
    if cp is not None and int(cp) > 1:
        return "sdpa"
    return "flash_attention_2" if packing else SKIP


RULES: list[Rule] = [
    Rule("engine.name", (G + "backend",), lambda v: v if v in ("vllm", "sglang") else SKIP),
    # vLLM: llm_kwargs of vllm_worker.py:570-601
    Rule("engine.dtype", (V + "precision",), dtype_name, when=_on("vllm")),
    Rule("engine.tensor_parallel_size", (V + "tensor_parallel_size",), int, when=_on("vllm")),
    Rule("engine.pipeline_parallel_size", (V + "pipeline_parallel_size",), int, when=_on("vllm")),
    Rule("engine.gpu_memory_utilization", (V + "gpu_memory_utilization",), float, when=_on("vllm")),
    Rule("engine.enforce_eager", (V + "enforce_eager",), bool, when=_on("vllm")),
    Rule("engine.max_model_len", (V + "max_model_len",), int, when=_on("vllm")),
    Rule("engine.kv_cache_dtype", (V + "kv_cache_dtype",), str, when=_on("vllm")),
    Rule("engine.logprobs_mode", (V + "logprobs_mode",), _logprobs_mode, when=_on("vllm")),
    Rule(
        "engine.prefix_caching",
        code_at=f"{_WORKER}:84-88,580",
        value=True,
        note="unset: on for compute capability >= 8, the GPUs the probe runs vLLM on",
        when=_on("vllm"),
    ),
    Rule("engine.prefix_caching", (V + "enable_prefix_caching",), bool, when=_on("vllm")),
    Rule("engine.record_routing", (V + "enable_return_routed_experts",), bool, when=_on("vllm")),
    Rule(
        "engine.cascade_attn",
        (G + "vllm_kwargs.disable_cascade_attn",),
        lambda v: not bool(v),
        when=_on("vllm"),
    ),
    # SGLang: sglang_cfg is SGLang's ServerArgs by name (sglang/config.py:79-151)
    Rule("engine.dtype", (S + "dtype",), _opt(dtype_name), when=_on("sglang")),
    Rule("engine.tensor_parallel_size", (S + "tp_size",), _opt(int), when=_on("sglang")),
    Rule("engine.pipeline_parallel_size", (S + "pp_size",), _opt(int), when=_on("sglang")),
    Rule("engine.data_parallel_size", (S + "dp_size",), _opt(int), when=_on("sglang")),
    Rule("engine.gpu_memory_utilization", (S + "mem_fraction_static",), _opt(float), when=_on("sglang")),
    Rule("engine.enforce_eager", (S + "disable_cuda_graph",), _opt(bool), when=_on("sglang")),
    Rule("engine.max_model_len", (S + "context_length",), _opt(int), when=_on("sglang")),
    Rule("engine.max_num_seqs", (S + "max_running_requests",), _opt(int), when=_on("sglang")),
    Rule("engine.kv_cache_dtype", (S + "kv_cache_dtype",), _opt(str), when=_on("sglang")),
    Rule("engine.attention_backend", (S + "attention_backend",), _opt(str), when=_on("sglang")),
    Rule("engine.chunked_prefill", (S + "chunked_prefill_size",), _opt(lambda v: int(v) != -1), when=_on("sglang")),
    Rule("engine.prefix_caching", (S + "disable_radix_cache",), _opt(lambda v: not bool(v)), when=_on("sglang")),
    # sampling: vllm_worker.py:640-660 (SGLang: sglang_generation.py, the same fields)
    Rule("sampling.temperature", (G + "temperature",), float),
    Rule("sampling.top_p", (G + "top_p",), float),
    Rule("sampling.top_k", (G + "top_k",), _top_k),
    Rule("sampling.n", ("grpo.num_generations_per_prompt",), int),
    Rule(
        "sampling.max_tokens",
        (G + "max_new_tokens",),
        int,
        note=f"capped at the context left after the prompt ({_WORKER}:69-81)",
    ),
    # the trainer: DTensor (FSDP2 through Automodel) unless megatron_cfg.enabled
    Rule(
        "reference.dtype",
        code_at=f"{_SETUP}:330",
        value="float32",
        note="master weights are loaded in float32",
        when=_dtensor,
    ),
    Rule("reference.fsdp", code_at=f"{_SETUP}:481-490", value=True, when=_dtensor),
    Rule(
        "reference.fsdp_param_dtype",
        (P + "precision",),
        dtype_name,
        note=f"FSDP2 MixedPrecisionPolicy(param_dtype) ({_SETUP}:285-289,484-485)",
        when=_dtensor,
    ),
    Rule("reference.fsdp_reduce_dtype", code_at=f"{_SETUP}:486", value="float32", when=_dtensor),
    Rule("reference.fsdp_output_dtype", code_at=f"{_SETUP}:487", value="float32", when=_dtensor),
    Rule("reference.tensor_parallel_size", (P + "dtensor_cfg.tensor_parallel_size",), int, when=_dtensor),
    Rule(
        "reference.tensor_parallel_size",
        (P + "megatron_cfg.tensor_model_parallel_size",),
        int,
        note="the probe runs a DTensor plan, not Megatron's kernels",
        when=lambda config: bool(config.value(P + "megatron_cfg.enabled")),
    ),
    Rule("reference.packing", (P + "sequence_packing.enabled",), bool),
    Rule(
        "reference.attn_implementation",
        (P + "sequence_packing.enabled", P + "dtensor_cfg.context_parallel_size"),
        _attn,
        note=f"{_SETUP}:321-325",
        when=_dtensor,
    ),
    Rule(
        "reference.attn_implementation",
        (P + "dtensor_cfg.automodel_kwargs.attn_implementation",),
        str,
        note=f"the recipe's wins ({_SETUP}:691-704)",
        when=_dtensor,
    ),
    Rule(
        "reference.logprobs",
        code_at=f"{_TRAIN}:180-215,385,834-837",
        value="processed",
        note="logits / T, then the sampling's top-k / top-p, then log_softmax",
    ),
    Rule(
        "reference.logits_fp32",
        code_at=f"{_TRAIN}:834",
        value=False,
        note="the LM head runs in the param dtype; its logits are cast to float32 after it",
    ),
    Rule("corrections.token_tis", _IS_KEYS, _correction("tis", "high")),
    Rule("corrections.token_mask_high", _IS_KEYS, _correction("icepop", "high")),
    Rule("corrections.token_mask_low", _IS_KEYS, _correction("icepop", "low")),
    Rule("corrections.geo_eps", _IS_KEYS, _correction("seq-mask-tis", "eps")),
]

UNMIRRORABLE: dict[str, str] = {
    G + "backend": "the probe's in-process engines are vllm and sglang (not NeMo-RL's megatron, trtllm or dynamo)",
    V + "precision": "fp8 runs NeMo-RL's own FP8 setup (vllm_worker.py:476-489), not 1:1 with engine.quantization",
    V + "expert_parallel_size": "the probe has no expert-parallel setting for the engine",
    V + "async_engine": "the probe drives the engine itself",
    V + "use_deep_gemm": "DeepGEMM is NeMo-RL's FP8 path; the probe has no setting for it",
    V + "num_last_layers_in_bf16": "NeMo-RL's FP8 setup keeps layers in bf16; the probe has no setting for it",
    V + "num_first_layers_in_bf16": "NeMo-RL's FP8 setup keeps layers in bf16; the probe has no setting for it",
    S + "ep_size": "the probe has no expert-parallel setting for the engine",
    S + "disable_piecewise_cuda_graph": "SGLang's piecewise CUDA graphs have no probe key (pass engine.extra_args)",
    G + "colocated.enabled": "how weights reach the engine is a [sync] setting (sync.transfer), not compare's",
    P
    + "dtensor_cfg.context_parallel_size": "PyTorch context parallelism has no probe key (the reference has Ulysses SP)",
    P + "dtensor_cfg.sequence_parallel": "DTensor sequence parallelism (of a TP plan) has no probe key",
    P + "megatron_cfg.enabled": "the probe's reference is transformers with a DTensor plan, not Megatron's kernels",
    P + "megatron_cfg.context_parallel_size": "Megatron context parallelism has no probe key",
    P + "megatron_cfg.pipeline_model_parallel_size": "the reference has no pipeline parallelism",
    "grpo.seq_logprob_error_threshold": (
        "masks sequences by their multiplicative error (grpo.py:2513-2555); no correction of the probe's, "
        "its mult_prob_error metric is the token mean of the same quantity"
    ),
    "loss_fn.force_on_policy_ratio": "skips the trainer's log-prob pass (grpo.py:3242-3249): the run never sees the mismatch",
    "loss_fn.truncated_importance_sampling_ratio_min": "a TIS lower bound (tis) or asymmetric bounds (seq-mask-tis) have no probe key",
}
# the engines' tables, whose keys no rule reads are listed as not mirrored
WATCHED = (V, S, G + "vllm_kwargs.")
# what those tables hold that is logging, ports, memory or process layout, not numerics
NOT_SETTINGS = frozenset(
    {V + k for k in ("use_tqdm", "enable_vllm_metrics_logger", "vllm_metrics_logger_interval", "skip_tokenizer_init")}
    | {V + k for k in ("http_refit_api_key_env_var", "http_refit_server_port", "zmq_refit_server_port")}
    | {V + "reset_encoder_cache_after_weight_update"}
    | {S + k for k in ("model_path", "random_seed", "allow_auto_truncate", "skip_server_warmup")}
    | {S + "sglang_server_config." + k for k in ("needs_offload", "cpu_weight_backup", "sglang_server_concurrency")}
    | {S + "sglang_server_config." + k for k in ("pause_generation_mode", "num_gpus", "num_gpus_per_engine")}
    | {S + "sglang_router_config.use_external_router"}
)


def read(inputs: list[str]) -> FrameworkConfig:
    """``inputs``: the YAML config (``--config FILE`` or the file alone) with its ``defaults:`` chain,
    and overrides as typed (``policy.generation.temperature=0.7``), later ones winning."""
    config = FrameworkConfig("nemo-rl", COMMIT, DEFAULTS)
    for item in inputs:
        if item == "--config":
            continue
        if item.startswith("--config="):
            item = item.split("=", 1)[1]
        path = Path(item)
        if path.suffix in (".yaml", ".yml") or path.is_file():
            config.files.append(item)
            _load(config, path, item, user=True, seen=())
            continue
        override = hydra_override(item)
        if override is None:
            raise ConfigError(
                f"{item!r} is neither a YAML config nor a key=value override",
                hint="give NeMo-RL's YAML config and its overrides, e.g. policy.generation.temperature=0.7",
            )
        op, key, value = override
        if op == "delete":
            _drop(config, key)
        else:
            for k, v in _flatten(value, key):
                _set(config, k, v, Origin(k, file="command line", framework="nemo-rl"))
    resolve_interpolations(config)
    for key in (UNMIRRORABLE.keys() & DEFAULTS.keys()) - {k for rule in RULES for k in rule.keys}:
        found = config.get(key)
        if found is not None and found.origin.from_user and found.value == DEFAULTS[key][0]:
            # NeMo-RL's own default (an engine on, a feature off) leaves nothing the probe would miss: a
            # config that restates it (grpo_math_1B.yaml itself) is not listed as not mirrored
            config.replace(key, found.value, _default(config, key))
    return config


def _default(config: FrameworkConfig, key: str) -> Origin:
    return Origin(key, default_at=f"{DEFAULTS[key][1]} @ {config.commit[:7]}", framework=config.framework)


def _load(config: FrameworkConfig, path: Path, shown: str, *, user: bool, seen: tuple[Path, ...]) -> None:
    """``load_config_with_inheritance`` (config.py:51-97): the parents, in order, then the file."""
    resolved = path.resolve()
    if resolved in seen:
        raise ConfigError(f"{shown}: its defaults chain comes back to itself", hint="remove the cycle from defaults:")
    tree = read_structured(path)
    parents = tree.pop("defaults", None)
    for parent in [parents] if isinstance(parents, str) else parents or []:
        parent_path = Path(str(parent)) if str(parent).startswith("/") else path.parent / str(parent)
        if not parent_path.is_file():
            raise ConfigError(
                f"{shown}: its defaults file {parent} is not at {parent_path}",
                hint="keep the config in its NeMo-RL checkout, beside the files its defaults: names",
            )
        _load(config, parent_path, os.path.normpath(parent_path), user=False, seen=(*seen, resolved))
    lines = _lines(path)
    for key, value in _flatten(tree):
        if user:
            origin = Origin(key, file=shown, framework="nemo-rl")
        else:
            # inherited through defaults: the config's default, where its parent sets it
            origin = Origin(key, default_at=f"{shown}:{lines.get(key, '?')}", framework="nemo-rl")
        _set(config, key, value, origin)


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Leaves by dotted key; a mapping marked ``_override_`` replaces its parent's (config.py:39-45),
    which a ``None`` leaf at its key says before its own leaves."""
    if isinstance(tree, dict) and tree:
        out: list[tuple[str, Any]] = []
        if tree.get("_override_"):
            out.append((prefix, _REPLACE))
        for k, v in tree.items():
            if k != "_override_":
                out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return [(prefix, tree)] if prefix else []


_REPLACE = object()


def _drop(config: FrameworkConfig, key: str) -> None:
    present = config.keys()  # a list: FrameworkConfig is not iterable
    for k in present:
        if k == key or k.startswith(key + "."):
            config.delete(k)


def _set(config: FrameworkConfig, key: str, value: Any, origin: Origin) -> None:
    """OmegaConf.merge of one leaf: a mapping below ``key`` or a leaf above it is replaced."""
    if value is _REPLACE:
        _drop(config, key)
        return
    present = config.keys()  # a list: FrameworkConfig is not iterable
    for k in present:
        if k.startswith(key + ".") or key.startswith(k + "."):
            config.delete(k)
    config.replace(key, value, origin)


def _lines(path: Path) -> dict[str, int]:
    """Each leaf's 1-based line in a YAML file, for the origin of what a child inherits."""
    out: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                walk(v, f"{prefix}.{k.value}" if prefix else str(k.value))
        elif prefix:
            out[prefix] = node.start_mark.line + 1

    try:
        walk(yaml.compose(path.read_text(encoding="utf-8")), "")
    except yaml.YAMLError:
        pass  # read_structured has refused it already
    return out


def facts(config: FrameworkConfig) -> dict[str, Found]:
    """The dataset layout the config gives: the prompt_file's template (math_hf_data_processor puts
    each problem through it, nemo_rl/data/processors.py:396-413) and the system prompt file, read
    where NeMo-RL reads them, relative to the directory it runs in."""
    out: dict[str, Found] = {}
    for fact, key in (("dataset_input_template", "prompt_file"), ("dataset_system_prompt", "system_prompt_file")):
        found = config.get(f"data.train.{key}") or config.get(f"data.default.{key}")
        if found is None or not found.value:
            continue
        path = Path(str(found.value))
        if path.is_file():
            out[fact] = Found(path.read_text(encoding="utf-8"), found.origin)
    return out

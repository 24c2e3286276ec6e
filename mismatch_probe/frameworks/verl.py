"""verl: Hydra YAML (``ppo_trainer.yaml`` and the files its defaults list composes) plus ``key=value``
overrides, as ``python3 -m verl.trainer.main_ppo`` takes them on its command line or in a launch
script. Defaults and code read at verl ``b178a3c`` (docs/frameworks/verl.md cites the same commit);
paths below are in that repository."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe.errors import ConfigError
from mismatch_probe.frameworks.base import SKIP, Found, FrameworkConfig, Origin, Rule, dtype_name
from mismatch_probe.frameworks.sources import (
    flatten,
    hydra_override,
    read_structured,
    resolve_interpolations,
    shell_words,
)

COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"

R = "actor_rollout_ref.rollout."
A = "actor_rollout_ref.actor."
M = "actor_rollout_ref.model."
_ROLLOUT = "verl/trainer/config/rollout/rollout.yaml"
_DATA = "verl/trainer/config/data/legacy_data.yaml"
_MODEL = "verl/trainer/config/model/hf_model.yaml"
_ACTOR = "verl/trainer/config/actor/dp_actor.yaml"
_FSDP = "verl/trainer/config/engine/fsdp.yaml"
_CORR = "verl/trainer/config/algorithm/rollout_correction.yaml"

# ppo_trainer.yaml's defaults list puts each file under its key (ppo_trainer.yaml:12-37)
DEFAULTS: dict[str, tuple[Any, str]] = {
    R + "mode": ("async", f"{_ROLLOUT}:8"),
    R + "temperature": (1.0, f"{_ROLLOUT}:11"),
    R + "top_k": (-1, f"{_ROLLOUT}:14"),
    R + "top_p": (1.0, f"{_ROLLOUT}:17"),
    R + "dtype": ("bfloat16", f"{_ROLLOUT}:29"),
    R + "gpu_memory_utilization": (0.5, f"{_ROLLOUT}:32"),
    R + "enforce_eager": (False, f"{_ROLLOUT}:38"),
    R + "free_cache_engine": (True, f"{_ROLLOUT}:47"),
    R + "tensor_model_parallel_size": (2, f"{_ROLLOUT}:50"),
    R + "data_parallel_size": (1, f"{_ROLLOUT}:53"),
    R + "expert_parallel_size": (1, f"{_ROLLOUT}:56"),
    R + "pipeline_model_parallel_size": (1, f"{_ROLLOUT}:59"),
    R + "max_num_batched_tokens": (8192, f"{_ROLLOUT}:62"),
    R + "max_model_len": (None, f"{_ROLLOUT}:65"),
    R + "max_num_seqs": (256, f"{_ROLLOUT}:68"),
    R + "enable_chunked_prefill": (True, f"{_ROLLOUT}:71"),
    R + "enable_prefix_caching": (True, f"{_ROLLOUT}:74"),
    R + "logprobs_mode": ("processed_logprobs", f"{_ROLLOUT}:77"),
    R + "do_sample": (True, f"{_ROLLOUT}:105"),
    R + "n": (1, f"{_ROLLOUT}:108"),
    R + "calculate_log_probs": (False, f"{_ROLLOUT}:206"),
    R + "enable_rollout_routing_replay": (False, f"{_ROLLOUT}:303"),
    R + "quantization": (None, f"{_ROLLOUT}:350"),
    "data.train_files": ("~/data/rlhf/gsm8k/train.parquet", f"{_DATA}:11"),
    "data.prompt_key": ("prompt", f"{_DATA}:27"),
    "data.max_prompt_length": (512, f"{_DATA}:35"),
    "data.max_response_length": (512, f"{_DATA}:39"),
    M + "path": ("~/models/deepseek-llm-7b-chat", f"{_MODEL}:10"),
    M + "use_remove_padding": (True, f"{_MODEL}:40"),
    A + "strategy": ("fsdp", f"{_ACTOR}:26"),
    A + "ulysses_sequence_parallel_size": (1, f"{_ACTOR}:34"),
    A + "fsdp_config.model_dtype": ("fp32", f"{_FSDP}:33"),
    A + "fsdp_config.dtype": ("bfloat16", f"{_FSDP}:63"),
    "algorithm.rollout_correction.rollout_is": (None, f"{_CORR}:6"),
    "algorithm.rollout_correction.rollout_is_threshold": (2.0, f"{_CORR}:9"),
    "algorithm.rollout_correction.rollout_rs": (None, f"{_CORR}:12"),
}

ENGINE_PINS = {
    "vllm": "vllm>=0.8.5,<=0.12.0 (setup.py:52)",
    "sglang": "sglang[srt,openai]==0.5.6 (setup.py:54-58)",
}
MODEL_KEYS = (M + "path",)
DATASET_KEYS = ("data.train_files",)
PROMPT_KEY_KEYS = ("data.prompt_key",)

_ENGINES = ("vllm", "sglang")


def _engine(config: FrameworkConfig) -> str:
    return str(config.value(R + "name"))


def _logprobs_mode(value: Any) -> Any:
    # vLLM's *_logits modes hand back logits, not log-probs: the probe has no such mode
    return {"processed_logprobs": "processed", "raw_logprobs": "raw"}.get(str(value), SKIP)


def _temperature(temperature: Any, do_sample: Any) -> Any:
    return 0.0 if do_sample is False else float(temperature)


def _response_length(max_response_length: Any, response_length: Any) -> Any:
    # rollout.response_length is ${oc.select:data.max_response_length,512} (rollout.yaml:25)
    return int(response_length if response_length is not None else max_response_length)


def _correction(kind: str):
    def convert(rollout_is: Any, threshold: Any) -> Any:
        return float(threshold) if rollout_is == kind and threshold is not None else SKIP

    return convert


def _on(engine: str):
    """A rule's ``when``: the rollout runs ``engine`` (verl passes the key to that engine only)."""
    return lambda config: _engine(config) == engine


RULES: list[Rule] = [
    Rule("engine.name", (R + "name",), lambda v: v if v in _ENGINES else SKIP),
    Rule("engine.dtype", (R + "dtype",), dtype_name),
    Rule(
        "engine.tensor_parallel_size",
        (R + "tensor_model_parallel_size",),
        int,
        note="SGLang's tp_size is this x data_parallel_size (async_sglang_server.py:256,265)",
    ),
    Rule("engine.data_parallel_size", (R + "data_parallel_size",), int),
    Rule("engine.pipeline_parallel_size", (R + "pipeline_model_parallel_size",), int),
    Rule("engine.gpu_memory_utilization", (R + "gpu_memory_utilization",), float),
    Rule("engine.enforce_eager", (R + "enforce_eager",), bool),
    Rule("engine.chunked_prefill", (R + "enable_chunked_prefill",), bool, when=_on("vllm")),
    Rule("engine.prefix_caching", (R + "enable_prefix_caching",), bool, when=_on("vllm")),
    Rule("engine.max_num_seqs", (R + "max_num_seqs",), int),
    Rule("engine.max_num_batched_tokens", (R + "max_num_batched_tokens",), int, when=_on("vllm")),
    Rule("engine.max_model_len", (R + "max_model_len",), lambda v: int(v) if v is not None else None),
    Rule("engine.logprobs_mode", (R + "logprobs_mode",), _logprobs_mode, when=_on("vllm")),
    Rule("engine.quantization", (R + "quantization",), lambda v: str(v) if v else None),
    Rule(
        "engine.cascade_attn",
        (R + "engine_kwargs.vllm.disable_cascade_attn",),
        lambda v: not bool(v),
        when=_on("vllm"),
    ),
    Rule(
        "engine.attention_backend",
        code_at="verl/workers/rollout/sglang_rollout/async_sglang_server.py:235,276",
        convert=lambda c: (
            "fa3" if _engine(c) == "sglang" and c.get(R + "engine_kwargs.sglang.attention_backend") is None else SKIP
        ),
        note="verl's default for SGLang",
    ),
    Rule("engine.attention_backend", (R + "engine_kwargs.sglang.attention_backend",), str, when=_on("sglang")),
    Rule("sampling.temperature", (R + "temperature", R + "do_sample"), _temperature),
    Rule("sampling.top_p", (R + "top_p",), float),
    Rule("sampling.top_k", (R + "top_k",), int),
    Rule("sampling.n", (R + "n",), int),
    Rule("sampling.max_tokens", ("data.max_response_length", R + "response_length"), _response_length),
    Rule(
        "reference.dtype",
        (A + "fsdp_config.model_dtype",),
        dtype_name,
        note="the actor's master weights (fsdp_workers.py:324-326)",
    ),
    Rule("reference.fsdp", (A + "strategy",), lambda v: str(v) in ("fsdp", "fsdp2")),
    Rule(
        "reference.fsdp_param_dtype",
        (A + "fsdp_config.dtype",),
        dtype_name,
        note="FSDP param_dtype (fsdp_workers.py:493-503)",
    ),
    Rule(
        "reference.fsdp_param_dtype",
        (A + "fsdp_config.mixed_precision.param_dtype",),
        dtype_name,
        note="overrides fsdp_config.dtype (fsdp_workers.py:493-497)",
    ),
    Rule("reference.sequence_parallel_size", (A + "ulysses_sequence_parallel_size",), int),
    Rule("reference.packing", (M + "use_remove_padding",), bool),
    Rule(
        "reference.attn_implementation",
        code_at="verl/workers/fsdp_workers.py:331",
        value="flash_attention_2",
        note="verl's actor attention unless override_config sets it",
    ),
    Rule("reference.attn_implementation", (M + "override_config.attn_implementation",), str),
    Rule(
        "reference.logprobs",
        code_at="verl/workers/actor/dp_actor.py:259,368",
        value="temperature",
        note="the actor computes log_softmax(logits / T)",
    ),
    Rule(
        "reference.tensor_parallel_size",
        (A + "strategy", A + "megatron.tensor_model_parallel_size"),
        lambda strategy, tp: int(tp) if strategy == "megatron" and tp is not None else SKIP,
        note="the probe runs a DTensor plan, not Megatron's kernels",
    ),
    Rule(
        "corrections.token_tis",
        ("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold"),
        _correction("token"),
    ),
    Rule(
        "corrections.seq_tis",
        ("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold"),
        _correction("sequence"),
    ),
]

UNMIRRORABLE: dict[str, str] = {
    R + "name": "the probe's in-process engines are vllm and sglang",
    R + "multi_turn.enable": (
        "verl's multi-turn rollout runs its own tools; the probe's --max-turns replays recorded "
        "conversations or its own tools (set it yourself)"
    ),
    R + "multi_turn.max_assistant_turns": "see multi_turn.enable",
    R + "expert_parallel_size": "the probe has no expert-parallel setting for the engine",
    R + "free_cache_engine": "sleep/wake between rollouts is weight sync's cycle (sync.sleep_level), not compare's",
    R + "calculate_log_probs": "the probe always records the engine's log-probs",
    R
    + "enable_rollout_routing_replay": "routing replay: the probe records routing and replays it on MoE models by default",
    R + "mode": "the probe drives the engine itself (verl's async agent loop is not mirrored)",
    R + "checkpoint_engine.backend": "how weights reach the engine: a [sync] setting (sync.transfer), not compare's",
    A
    + "megatron.context_parallel_size": "Megatron context parallelism has no probe key (the reference has Ulysses SP)",
    A + "megatron.pipeline_model_parallel_size": "the reference has no pipeline parallelism",
    "algorithm.rollout_correction.bypass_mode": (
        "bypass mode: the rollout's own log-probs are old_log_probs (ray_trainer.py:1486-1499), so verl "
        "itself never sees the mismatch the probe measures"
    ),
    "algorithm.rollout_correction.rollout_rs": "verl's rejection-sampling criteria have no 1:1 probe key",
    "algorithm.rollout_correction.rollout_rs_threshold": "verl's rejection-sampling criteria have no 1:1 probe key",
}
# settings of the rollout and the actor's precision whose keys no rule reads are listed as not mirrored
WATCHED = (R, A + "fsdp_config.", M + "override_config.", "algorithm.rollout_correction.")
# what those prefixes hold that is batching, memory or bookkeeping, not numerics
NOT_SETTINGS = frozenset(
    {
        R + "log_prob_micro_batch_size_per_gpu",
        R + "log_prob_use_dynamic_bsz",
        R + "log_prob_max_token_len_per_gpu",
        R + "prompt_length",
        R + "load_format",
        R + "layered_summon",
        A + "fsdp_config.param_offload",
        A + "fsdp_config.optimizer_offload",
        A + "fsdp_config.offload_policy",
        A + "fsdp_config.fsdp_size",
        A + "fsdp_config.forward_prefetch",
        A + "fsdp_config.wrap_policy.min_num_params",
    }
)

_MAIN = "verl.trainer.main_ppo"


def read(inputs: list[str]) -> FrameworkConfig:
    """``inputs``: YAML files (merged in order), launch scripts (their ``key=value`` overrides) and
    overrides as typed (``actor_rollout_ref.rollout.n=5``); later ones win, as on verl's command line."""
    config = FrameworkConfig("verl", COMMIT, DEFAULTS)
    for item in inputs:
        override = hydra_override(item) if "=" in item or item.startswith("~") else None
        if override is not None and not Path(item).is_file():
            _apply(config, override, "command line")
            continue
        path = Path(item)
        config.files.append(item)
        if path.suffix in (".yaml", ".yml", ".json"):
            tree = read_structured(path)
            tree.pop("defaults", None)  # Hydra's composition list: verl's own files are DEFAULTS
            tree.pop("hydra", None)
            for key, value in flatten(tree):
                config.set(key, value, item)
        else:
            words = shell_words(path)
            if _MAIN not in words:
                raise ConfigError(
                    f"{item}: no `python3 -m {_MAIN}` command in it", hint="give verl's launch script or its YAML"
                )
            for word in words[words.index(_MAIN) + 1 :]:
                if (o := hydra_override(word)) is not None and "." in o[1]:
                    _apply(config, o, item)
    resolve_interpolations(config)
    if config.value(R + "name") in (None, "???"):
        raise ConfigError(
            "the config does not set actor_rollout_ref.rollout.name (verl requires it: rollout.yaml:5 is ???)",
            hint="add actor_rollout_ref.rollout.name=vllm (or sglang) to the inputs",
        )
    return config


def _apply(config: FrameworkConfig, override: tuple[str, str, Any], where: str) -> None:
    op, key, value = override
    if op == "delete":
        config.delete(key)
    elif isinstance(value, dict):
        for k, v in flatten(value, key):
            config.set(k, v, where)
    else:
        config.set(key, value, where)


def facts(config: FrameworkConfig) -> dict[str, Found]:
    out: dict[str, Found] = {}
    found = config.get(R + "logprobs_mode")
    if found is not None and str(found.value).endswith("_logits"):
        out["evidence:logprobs-temperature"] = Found(
            f"verl {found.value}: vLLM returns logits, not log-probs ({found.origin})",
            Origin(found.origin.key, found.origin.file, found.origin.default_at, "verl"),
        )
    return out

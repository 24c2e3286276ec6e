"""ms-swift: the flags of ``swift rlhf --rlhf_type grpo`` and, for ``--vllm_mode server``, of the
``swift rollout`` server it samples from, in launch scripts (one may hold both commands), in a file
of the arguments, or as typed. Its dataclass arguments take ``--name value`` (``--use_vllm true``);
a dash in a name is read as an underscore. Flags of ``swift rollout`` are keyed ``swift rollout
--name``. Defaults and code read at ms-swift ``3602360`` (docs/frameworks/ms-swift.md cites the same
commit); paths below are in that repository."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe.errors import ConfigError
from mismatch_probe.frameworks.base import SKIP, Found, FrameworkConfig, Rule, dtype_name
from mismatch_probe.frameworks.cli_flags import flag, read_flags

COMMIT = "3602360a562313afbf2ef6065fdf61f271a2c5b9"

_VLLM = "swift/rlhf_trainers/args_mixin.py"  # VllmArguments, then the trainer's RolloutTrainerArgumentsMixin
_RLHF = "swift/arguments/rlhf_args.py"
_TEMPLATE = "swift/arguments/base_args/template_args.py"
_MODEL = "swift/arguments/base_args/model_args.py"
_MIXIN = "swift/rlhf_trainers/rollout_mixin.py"
_ROLLOUT = "swift/pipelines/infer/rollout.py"
SERVER = "swift rollout "  # the key prefix of the rollout server's flags
_IS = "--rollout_importance_sampling_"

# the vLLM settings both commands read, with VllmArguments' defaults (what `swift rollout` runs with)
_SERVER_DEFAULTS: dict[str, tuple[Any, str]] = {
    "--vllm_gpu_memory_utilization": (0.9, f"{_VLLM}:37"),
    "--vllm_tensor_parallel_size": (1, f"{_VLLM}:38"),
    "--vllm_pipeline_parallel_size": (1, f"{_VLLM}:39"),
    "--vllm_max_num_seqs": (256, f"{_VLLM}:41"),
    "--vllm_max_model_len": (None, f"{_VLLM}:42"),
    "--vllm_enforce_eager": (False, f"{_VLLM}:44"),
    "--vllm_enable_prefix_caching": (None, f"{_VLLM}:47"),
    "--vllm_quantization": (None, f"{_VLLM}:49"),
    "--vllm_disable_cascade_attn": (False, f"{_VLLM}:51"),
    "--vllm_engine_kwargs": (None, f"{_VLLM}:54"),
    "--vllm_data_parallel_size": (1, f"{_VLLM}:56"),
    "--torch_dtype": (None, f"{_MODEL}:74"),
}

DEFAULTS: dict[str, tuple[Any, str]] = {
    **{SERVER + k: v for k, v in _SERVER_DEFAULTS.items()},
    **_SERVER_DEFAULTS,
    # the trainer's own defaults where they differ (RolloutTrainerArgumentsMixin)
    "--vllm_max_num_seqs": (None, f"{_VLLM}:172"),
    "--vllm_enable_prefix_caching": (True, f"{_VLLM}:173"),
    "--top_k": (-1, f"{_VLLM}:162"),
    "--top_p": (1.0, f"{_VLLM}:163"),
    "--use_vllm": (False, f"{_VLLM}:169"),
    "--vllm_mode": (None, f"{_VLLM}:170"),
    _IS + "mode": (None, f"{_VLLM}:478-479"),
    _IS + "threshold": (2.0, f"{_VLLM}:480"),
    "--num_generations": (8, f"{_RLHF}:163"),
    "--max_completion_length": (512, f"{_RLHF}:241"),
    "--temperature": (0.9, f"{_RLHF}:257"),
    "--attn_impl": (None, f"{_MODEL}:79"),
    "--padding_free": (False, f"{_TEMPLATE}:139"),
    "--sequence_parallel_size": (1, f"{_TEMPLATE}:141"),
}

ENGINE_PINS = {
    "vllm": "vllm>=0.5.1, no upper pin (requirements/install_all.sh:4; README.md:154 recommends 0.11.0/0.23.0)"
}
MODEL_KEYS = ("--model",)
DATASET_KEYS = ("--dataset",)


def _mode(config: FrameworkConfig) -> str | None:
    return str(config.value("--vllm_mode")) if flag(config.value("--use_vllm")) else None


def _on(mode: str):
    """A rule's ``when``: the rollout runs in ``mode`` (colocate: the trainer's flags; server: swift rollout's)."""
    return lambda config: _mode(config) == mode


def _vllm(probe_key: str, name: str, convert: Any, *, server_only: bool = False, note: str = "") -> list[Rule]:
    """``--vllm_<name>`` as the colocated engine reads it from the trainer's flags, and as `swift
    rollout` reads it from its own."""
    rules = [Rule(probe_key, (SERVER + name,), convert, note=note, when=_on("server"))]
    if not server_only:
        rules.insert(0, Rule(probe_key, (name,), convert, note=note, when=_on("colocate")))
    return rules


def _is(kind: str):
    def convert(mode: Any, threshold: Any) -> Any:
        return float(threshold) if mode == kind else SKIP

    return convert


def _max_tokens(response_length: Any, max_new_tokens: Any, max_completion_length: Any) -> int:
    # the first of the three that is set (rlhf_args.py:470-472)
    return int(next(v for v in (response_length, max_new_tokens, max_completion_length) if v is not None))


def _attn(value: Any) -> Any:
    # 'flash_attn' is the old name of flash_attention_2 (model_args.py:34-38); None: sdpa or eager by model
    return {"flash_attn": "flash_attention_2"}.get(str(value), str(value)) if value is not None else SKIP


RULES: list[Rule] = [
    Rule(
        "engine.name",
        ("--use_vllm", "--vllm_mode"),
        lambda use_vllm, mode: "vllm" if flag(use_vllm) else "hf",
        note="colocated in each training process, or the swift rollout server; without vLLM, transformers' generate",
    ),
    *_vllm(
        "engine.dtype",
        "--torch_dtype",
        dtype_name,
        note="the model's torch_dtype (rollout_mixin.py:508; rollout.py:802)",
    ),
    *_vllm("engine.tensor_parallel_size", "--vllm_tensor_parallel_size", int),
    *_vllm("engine.pipeline_parallel_size", "--vllm_pipeline_parallel_size", int, server_only=True),
    *_vllm(
        "engine.data_parallel_size",
        "--vllm_data_parallel_size",
        int,
        server_only=True,
        note="swift rollout's worker processes, each a replica",
    ),
    *_vllm("engine.gpu_memory_utilization", "--vllm_gpu_memory_utilization", float),
    *_vllm("engine.max_model_len", "--vllm_max_model_len", lambda v: int(v) if v is not None else None),
    *_vllm("engine.max_num_seqs", "--vllm_max_num_seqs", lambda v: int(v) if v is not None else None),
    *_vllm("engine.prefix_caching", "--vllm_enable_prefix_caching", lambda v: flag(v) if v is not None else None),
    *_vllm("engine.enforce_eager", "--vllm_enforce_eager", flag),
    *_vllm("engine.cascade_attn", "--vllm_disable_cascade_attn", lambda v: not flag(v)),
    *_vllm("engine.quantization", "--vllm_quantization", lambda v: str(v) if v else None, server_only=True),
    *_vllm("engine.extra_args", "--vllm_engine_kwargs", lambda v: dict(v) if isinstance(v, dict) and v else None),
    Rule(
        "engine.distributed_executor_backend",
        code_at=f"{_MIXIN}:523",
        value="external_launcher",
        note="the colocated engine runs in each training process",
        when=_on("colocate"),
    ),
    Rule(
        "engine.logprobs_mode",
        code_at=f"{_MIXIN}:499; {_ROLLOUT}:815",
        value="processed",
        note="processed_logprobs on vLLM >= 0.10.2",
        when=lambda config: _mode(config) is not None,
    ),
    Rule("sampling.temperature", ("--temperature",), float),
    Rule("sampling.top_p", ("--top_p",), float),
    Rule("sampling.top_k", ("--top_k",), int),
    Rule("sampling.n", ("--num_generations",), int, note="sent as separate n = 1 requests"),
    Rule("sampling.max_tokens", ("--response_length", "--max_new_tokens", "--max_completion_length"), _max_tokens),
    Rule("reference.dtype", ("--torch_dtype",), dtype_name),
    Rule("reference.attn_implementation", ("--attn_impl",), _attn),
    Rule("reference.packing", ("--padding_free",), flag),
    Rule(
        "reference.sequence_parallel_size",
        ("--sequence_parallel_size",),
        int,
        note="the probe runs Ulysses; which kind ms-swift runs was not checked",
    ),
    Rule(
        "reference.logprobs",
        code_at="swift/rlhf_trainers/grpo_trainer.py:1571",
        value="temperature",
        note="logits.div_(temperature): top-k and top-p are not applied",
    ),
    Rule("corrections.token_tis", (_IS + "mode", _IS + "threshold"), _is("token_truncate")),
    Rule(
        "corrections.token_mask_high",
        (_IS + "mode", _IS + "threshold"),
        _is("token_mask"),
        note="ms-swift masks above only (grpo_trainer.py:2355-2357)",
    ),
]

UNMIRRORABLE: dict[str, str] = {
    _IS + "mode": (
        "ms-swift's sequence ratio is the geometric mean of the token ratios, one-sided (grpo_trainer.py:2311-2326); "
        "the probe's seq_tis / seq_mis use the product"
    ),
    "--vllm_server_host": (
        "the swift rollout server's address: to probe the running server, set engine.url = http://HOST:PORT "
        'and engine.api = "swift" (docs/frameworks/ms-swift.md)'
    ),
    "--vllm_server_port": "see --vllm_server_host",
    "--vllm_server_base_url": "see --vllm_server_host",
    "--min_p": "a further logits processor: the probe has no min_p",
    "--repetition_penalty": "a further logits processor: the probe has no repetition penalty",
    "--vllm_enable_lora": "vLLM loads the trained LoRA adapter: the probe compares one merged checkpoint",
    SERVER + "--vllm_enable_lora": "see --vllm_enable_lora",
    "--vllm_enable_expert_parallel": "the probe has no expert-parallel setting for the engine",
    SERVER + "--vllm_enable_expert_parallel": "see --vllm_enable_expert_parallel",
    "--vllm_speculative_config": "speculative decoding: the probe's engine samples without a draft model",
    SERVER + "--vllm_speculative_config": "see --vllm_speculative_config",
    "--multi_turn_scheduler": "ms-swift's multi-turn scheduler: the probe's --max-turns drives turns itself",
    SERVER + "--multi_turn_scheduler": "see --multi_turn_scheduler; a server started with it is refused",
    "--async_generate": "samples from the previous step's weights: the probe samples one checkpoint",
}
# the rollout's settings whose keys no rule reads are listed as not mirrored
WATCHED = ("--vllm_", SERVER + "--vllm_", _IS)
# what those prefixes hold that is memory, addressing or bookkeeping, not numerics
NOT_SETTINGS = frozenset(
    {
        "--vllm_server_timeout",
        "--vllm_server_group_port",
        "--vllm_limit_mm_per_prompt",
        SERVER + "--vllm_limit_mm_per_prompt",
        "--vllm_mm_processor_cache_gb",
        SERVER + "--vllm_mm_processor_cache_gb",
        SERVER + "--vllm_use_async_engine",
        "--vllm_max_lora_rank",
        SERVER + "--vllm_max_lora_rank",
    }
)

_ENTRIES = ("swift rlhf", "swift rollout")


def _key(flag_name: str, entry: str) -> str:
    name = "--" + flag_name[2:].replace("-", "_")
    return SERVER + name if entry == "swift rollout" else name


def read(inputs: list[str]) -> FrameworkConfig:
    """``inputs``: ms-swift launch scripts (``swift rlhf``, and ``swift rollout`` for the server mode),
    files of the trainer's arguments, and its flags as typed; later ones win."""
    config = FrameworkConfig("ms-swift", COMMIT, DEFAULTS)
    read_flags(config, inputs, entries=_ENTRIES, booleans=frozenset(), key=_key, what="ms-swift")
    if flag(config.value("--use_vllm")) and config.value("--vllm_mode") not in ("colocate", "server"):
        # rlhf_args.py:446-447
        raise ConfigError(
            "--use_vllm true without --vllm_mode (ms-swift requires it: colocate or server)",
            hint="add --vllm_mode colocate (or server) to the inputs",
        )
    return config


def facts(config: FrameworkConfig) -> dict[str, Found]:
    out: dict[str, Found] = {}
    system = config.get("--system")
    if system is not None and isinstance(system.value, str):
        # a .txt path is read as the system prompt (template_args.py:158-162), relative to where swift runs
        text: str | None = system.value
        if system.value.endswith(".txt"):
            path = Path(system.value)
            text = path.read_text(encoding="utf-8") if path.is_file() else None
        if text:
            out["dataset_system_prompt"] = Found(text, system.origin)
    return out

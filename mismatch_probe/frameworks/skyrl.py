"""SkyRL: ``key=value`` overrides of its typed config (``SkyRLTrainConfig.from_cli_overrides``, OmegaConf's
dotlist over the dataclasses' defaults), as ``uv run ... -m skyrl.train.entrypoints.main_base`` takes
them on its command line or in a launch script (examples/train/*/run_*.sh), and YAML files of the same
keys. Defaults and code read at NovaSky-AI/SkyRL ``a956457`` (skyrl 0.3.0, the commit
docs/frameworks/skyrl.md cites); paths below are in that repository. At that commit the defaults are
the dataclasses in skyrl/train/config/config.py (the Hydra ``ppo_base_config.yaml`` of skyrl-train is
gone, #1684), and the older ``skyrl_train.entrypoints`` module names are read the same way."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ConfigError
from mismatch_probe.frameworks.base import SKIP, Found, FrameworkConfig, Origin, Rule, dtype_name
from mismatch_probe.frameworks.sources import flatten, hydra_override, parse_scalar, read_structured, shell_words

COMMIT = "a9564572eb8e91076be43c1bd5e4615e3de17265"

IE = "generator.inference_engine."
SP = "generator.sampling_params."
T = "trainer."
P = "trainer.policy."
OPC = "trainer.algorithm.off_policy_correction."
_CFG = "skyrl/train/config/config.py"
_SERVERS = "skyrl/backends/skyrl_train/inference_servers/utils.py"
_WRAPPER = "skyrl/backends/skyrl_train/workers/model_wrapper.py"
_FSDP = "skyrl/backends/skyrl_train/distributed/fsdp_strategy.py"

DEFAULTS: dict[str, tuple[Any, str]] = {
    "data.train_data": (["~/data/gsm8k/train.parquet"], f"{_CFG}:76"),
    P + "model.path": ("Qwen/Qwen2.5-1.5B-Instruct", f"{_CFG}:608"),
    P + "fsdp_config.mixed_precision": (None, f"{_CFG}:238"),
    P + "sequence_parallel_size": (1, f"{_CFG}:613"),
    P + "megatron_config.tensor_model_parallel_size": (1, f"{_CFG}:449"),
    "trainer.placement.colocate_all": (True, f"{_CFG}:586"),
    "trainer.algorithm.temperature": (None, f"{_CFG}:843"),
    OPC + "tis_ratio_type": (None, f"{_CFG}:794"),
    OPC + "token_tis_ratio_clip_high": (2.0, f"{_CFG}:797"),
    OPC + "sequence_tis_ratio_clip_high": (5.0, f"{_CFG}:799"),
    OPC + "sequence_mask_metric": (None, f"{_CFG}:801"),
    OPC + "geo_mask_high": (1.01, f"{_CFG}:803"),
    OPC + "geo_mask_low": (0.99, f"{_CFG}:805"),
    OPC + "product_mask_high": (2.0, f"{_CFG}:807"),
    OPC + "product_mask_low": (0.5, f"{_CFG}:809"),
    OPC + "outlier_token_is_threshold_low": (None, f"{_CFG}:811"),
    OPC + "outlier_token_is_threshold_high": (None, f"{_CFG}:813"),
    OPC + "token_mask_is_threshold_low": (None, f"{_CFG}:815"),
    OPC + "token_mask_is_threshold_high": (None, f"{_CFG}:817"),
    SP + "max_generate_length": (1024, f"{_CFG}:999"),
    SP + "temperature": (1.0, f"{_CFG}:1004"),
    SP + "top_p": (1.0, f"{_CFG}:1007"),
    SP + "min_p": (0.0, f"{_CFG}:1009"),
    SP + "top_k": (-1, f"{_CFG}:1011"),
    IE + "model_dtype": ("bfloat16", f"{_CFG}:1099"),
    IE + "run_engines_locally": (True, f"{_CFG}:1103"),
    IE + "backend": ("vllm", f"{_CFG}:1109"),
    IE + "tensor_parallel_size": (1, f"{_CFG}:1119"),
    IE + "pipeline_parallel_size": (1, f"{_CFG}:1121"),
    IE + "expert_parallel_size": (1, f"{_CFG}:1123"),
    IE + "data_parallel_size": (1, f"{_CFG}:1127"),
    IE + "enable_prefix_caching": (True, f"{_CFG}:1134"),
    IE + "enable_chunked_prefill": (True, f"{_CFG}:1138"),
    IE + "enable_return_routed_experts": (False, f"{_CFG}:1142"),
    IE + "max_num_batched_tokens": (8192, f"{_CFG}:1145"),
    IE + "enforce_eager": (False, f"{_CFG}:1147"),
    IE + "gpu_memory_utilization": (0.8, f"{_CFG}:1154"),
    IE + "max_num_seqs": (1024, f"{_CFG}:1172"),
    IE + "external_server_urls": (None, f"{_CFG}:1200"),
    "generator.n_samples_per_prompt": (5, f"{_CFG}:1225"),
    T + "strategy": ("fsdp", f"{_CFG}:1344"),
    T + "remove_microbatch_padding": (True, f"{_CFG}:1431"),
    T + "flash_attn": (True, f"{_CFG}:1444"),
}

ENGINE_PINS = {"vllm": "vllm==0.26.0 (pyproject.toml:116)"}
MODEL_KEYS = (P + "model.path",)
DATASET_KEYS = ("data.train_data",)
# PromptDataset's prompt_key is "prompt" (skyrl/train/dataset/dataset.py:23); no config key sets it
PROMPT_KEY_KEYS: tuple[str, ...] = ()


def _local(config: FrameworkConfig) -> bool:
    """SkyRL starts the vLLM servers itself from these settings (build_vllm_cli_args)."""
    return bool(config.value(IE + "run_engines_locally"))


def _fsdp(config: FrameworkConfig) -> bool:
    return str(config.value(T + "strategy")) in ("fsdp", "fsdp2")


def _correction(kind: str, threshold: Any) -> Any:
    return float(threshold) if threshold is not None and kind else SKIP


def _geo_eps(metric: Any, low: Any, high: Any) -> Any:
    # the probe's band is symmetric (1 ± eps): the wider side, so nothing SkyRL keeps is dropped
    return max(1.0 - float(low), float(high) - 1.0) if metric == "geometric" else SKIP


def _both(low: Any, high: Any) -> bool:
    # SkyRL masks tokens only when both bounds are set (off_policy_correction_utils.py:17-20)
    return low is not None and high is not None


RULES: list[Rule] = [
    Rule(
        "engine.name",
        (IE + "backend", IE + "run_engines_locally"),
        lambda backend, local: "vllm" if backend == "vllm" and local else SKIP,
    ),
    Rule(
        "engine.url",
        (IE + "run_engines_locally", IE + "external_server_urls"),
        lambda local, urls: str(urls[0]) if not local and isinstance(urls, list) and urls else SKIP,
        note="the first of your own servers: the probe reads its settings back from /server_info",
    ),
    Rule("engine.dtype", (IE + "model_dtype",), dtype_name, when=_local),
    Rule("engine.tensor_parallel_size", (IE + "tensor_parallel_size",), int, when=_local),
    Rule("engine.pipeline_parallel_size", (IE + "pipeline_parallel_size",), int, when=_local),
    Rule("engine.data_parallel_size", (IE + "data_parallel_size",), int, when=_local),
    Rule("engine.gpu_memory_utilization", (IE + "gpu_memory_utilization",), float, when=_local),
    Rule("engine.enforce_eager", (IE + "enforce_eager",), bool, when=_local),
    Rule("engine.prefix_caching", (IE + "enable_prefix_caching",), bool, when=_local),
    Rule("engine.max_num_seqs", (IE + "max_num_seqs",), int, when=_local),
    Rule("engine.max_num_batched_tokens", (IE + "max_num_batched_tokens",), int, when=_local),
    Rule("engine.record_routing", (IE + "enable_return_routed_experts",), lambda v: True if v else SKIP, when=_local),
    Rule(
        "engine.logprobs_mode",
        code_at=f"{_SERVERS}:59-161",
        convert=lambda c: "raw" if _local(c) else SKIP,
        note="build_vllm_cli_args never sets logprobs_mode: vLLM's default, raw_logprobs",
    ),
    # engine_init_kwargs are vLLM's own arguments, applied last (utils.py:157-159)
    Rule(
        "engine.logprobs_mode",
        (IE + "engine_init_kwargs.logprobs_mode",),
        lambda v: {"processed_logprobs": "processed", "raw_logprobs": "raw"}.get(str(v), SKIP),
    ),
    Rule("engine.cascade_attn", (IE + "engine_init_kwargs.disable_cascade_attn",), lambda v: not bool(v)),
    Rule("engine.chunked_prefill", (IE + "engine_init_kwargs.enable_chunked_prefill",), bool),
    Rule("sampling.temperature", (SP + "temperature",), float),
    Rule("sampling.top_p", (SP + "top_p",), float),
    Rule("sampling.top_k", (SP + "top_k",), int),
    Rule("sampling.n", ("generator.n_samples_per_prompt",), int),
    Rule("sampling.max_tokens", (SP + "max_generate_length",), int),
    Rule(
        "reference.logprobs",
        code_at=f"{_WRAPPER}:334",
        value="temperature",
        note="the trainer divides its logits by trainer.algorithm.temperature",
    ),
    Rule("reference.fsdp", (T + "strategy",), lambda v: str(v) in ("fsdp", "fsdp2")),
    Rule(
        "reference.dtype",
        code_at="skyrl/backends/skyrl_train/workers/fsdp/fsdp_worker.py:161",
        convert=lambda c: "float32" if _fsdp(c) else SKIP,
        note="the FSDP policy loads in float32 (model_wrapper.py:158)",
    ),
    Rule(
        "reference.fsdp_param_dtype",
        code_at=f"{_FSDP}:204-210",
        convert=lambda c: "bfloat16" if _fsdp(c) else SKIP,
        note="FSDP's param_dtype when fsdp_config.mixed_precision is unset",
    ),
    Rule(
        "reference.fsdp_reduce_dtype",
        code_at=f"{_FSDP}:204-210",
        convert=lambda c: "float32" if _fsdp(c) else SKIP,
        note="FSDP's reduce_dtype when fsdp_config.mixed_precision is unset",
    ),
    Rule("reference.fsdp_param_dtype", (P + "fsdp_config.mixed_precision.param_dtype",), dtype_name, when=_fsdp),
    Rule("reference.fsdp_reduce_dtype", (P + "fsdp_config.mixed_precision.reduce_dtype",), dtype_name, when=_fsdp),
    Rule(
        "reference.attn_implementation",
        (T + "flash_attn",),
        lambda v: "flash_attention_2" if v else "sdpa",
        note=f"{_WRAPPER}:87",
    ),
    Rule("reference.packing", (T + "remove_microbatch_padding",), bool),
    Rule("reference.sequence_parallel_size", (P + "sequence_parallel_size",), int),
    Rule(
        "reference.tensor_parallel_size",
        (T + "strategy", P + "megatron_config.tensor_model_parallel_size"),
        lambda strategy, tp: int(tp) if strategy == "megatron" and tp is not None else SKIP,
        note="the probe runs a DTensor plan, not Megatron's kernels",
    ),
    Rule(
        "corrections.token_tis",
        (OPC + "tis_ratio_type", OPC + "token_tis_ratio_clip_high"),
        lambda kind, high: _correction(kind == "token", high),
    ),
    Rule(
        "corrections.seq_tis",
        (OPC + "tis_ratio_type", OPC + "sequence_tis_ratio_clip_high"),
        lambda kind, high: _correction(kind == "sequence", high),
    ),
    Rule(
        "corrections.seq_mis",
        (OPC + "sequence_mask_metric", OPC + "product_mask_high"),
        lambda metric, high: _correction(metric == "product", high),
    ),
    Rule(
        "corrections.geo_eps",
        (OPC + "sequence_mask_metric", OPC + "geo_mask_low", OPC + "geo_mask_high"),
        _geo_eps,
    ),
    Rule(
        "corrections.token_mask_low",
        (OPC + "token_mask_is_threshold_low", OPC + "token_mask_is_threshold_high"),
        lambda low, high: float(low) if _both(low, high) else SKIP,
    ),
    Rule(
        "corrections.token_mask_high",
        (OPC + "token_mask_is_threshold_low", OPC + "token_mask_is_threshold_high"),
        lambda low, high: float(high) if _both(low, high) else SKIP,
    ),
    Rule(
        "corrections.worst_token_tau",
        (OPC + "outlier_token_is_threshold_low",),
        lambda v: float(v) if v is not None else None,
    ),
]

UNMIRRORABLE: dict[str, str] = {
    IE + "backend": "vLLM is SkyRL's only backend (inference_servers/engine_utils.py:85-89)",
    IE + "enable_chunked_prefill": (
        "SkyRL does not pass it to vLLM (build_vllm_cli_args, inference_servers/utils.py:59-161): vLLM's "
        "default applies; set it through engine_init_kwargs.enable_chunked_prefill"
    ),
    IE + "expert_parallel_size": "the probe has no expert-parallel setting for the engine",
    IE + "weight_sync_backend": "how weights reach the engine: a [sync] setting (sync.transfer), not compare's",
    IE + "delta_weight_sync": "delta weight sync has no probe equivalent",
    IE + "external_proxy_url": "a router balances data-plane routes only: give one backend (external_server_urls)",
    IE + "enable_pd": "prefill/decode disaggregation has no probe setting",
    IE + "speculative_config": "speculative decoding has no probe setting",
    SP + "min_p": "no probe key for min-p: compare samples without it",
    SP + "repetition_penalty": "no probe key for a repetition penalty: compare samples without it",
    SP + "stop": "stop strings end SkyRL's responses early; the probe stops at max_tokens or EOS",
    "trainer.algorithm.temperature": "the trainer's temperature: a risk when it differs from the sampling one",
    OPC + "product_mask_low": "the probe's sequence mask has an upper bound only",
    OPC + "outlier_token_is_threshold_high": "the probe's token veto has a lower bound only",
    P
    + "megatron_config.context_parallel_size": "Megatron context parallelism has no probe key (the reference has Ulysses SP)",
    P + "megatron_config.pipeline_model_parallel_size": "the reference has no pipeline parallelism",
    P + "megatron_config.expert_model_parallel_size": "the reference has no expert parallelism",
    T + "sequence_parallel_backend": "the probe's reference runs Ulysses SP only",
}
# the engine's, sampling's, the trainer's precision and the corrections: what is set there and no rule reads
WATCHED = (IE, SP, P + "fsdp_config.mixed_precision", P + "megatron_config.", OPC)
NOT_SETTINGS = frozenset(
    {
        IE + "num_engines",
        IE + "run_engines_locally",
        IE + "vllm_v1_disable_multiproc",
        IE + "enable_ray_prometheus_stats",
        IE + "weight_transfer_threshold_cuda_ipc_GB",
        IE + "offload_kv_for_weight_sync",
        IE + "use_expandable_segments",
        IE + "served_model_name",
        IE + "distributed_executor_backend",
        IE + "router_init_kwargs",
        P + "megatron_config.expert_tensor_parallel_size",
        SP + "logprobs",
        SP + "additional_kwargs",
    }
)

_ENTRYPOINT = re.compile(r"^(skyrl|skyrl_train|examples)\.[\w.]*main\w*$")
_DEFAULT_ASSIGN = re.compile(r"^\$\{([A-Za-z_]\w*):=(.*)\}$")  # `: "${NAME:=default}"`
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)")


def read(inputs: list[str]) -> FrameworkConfig:
    """``inputs``: launch scripts (their overrides after ``-m ...main_base``), YAML files of the same
    dotted keys, and overrides as typed; later ones win, as on SkyRL's command line."""
    config = FrameworkConfig("skyrl", COMMIT, DEFAULTS)
    for item in inputs:
        if "=" in item and not Path(item).is_file():
            _override(config, item, "command line")
            continue
        path = Path(item)
        config.files.append(item)
        if path.suffix in (".yaml", ".yml", ".json"):
            for key, value in flatten(read_structured(path)):
                config.set(key, value, item)
            continue
        words = _script_words(path)
        start = next((i for i, w in enumerate(words[:-1]) if w == "-m" and _ENTRYPOINT.match(words[i + 1])), None)
        if start is None:
            raise ConfigError(
                f"{item}: no `-m skyrl.train.entrypoints.main_base` (or another SkyRL entrypoint) command in it",
                hint="give SkyRL's launch script, or its key=value overrides",
            )
        for word in words[start + 2 :]:
            if "=" in word and "." in word.split("=", 1)[0]:
                _override(config, word, item)
    return config


def _script_words(path: Path) -> list[str]:
    """The script's words with bash's ``: "${NAME:=default}"`` assignments applied to what follows
    (shell_words resolves plain assignments; SkyRL's scripts also use this form)."""
    values: dict[str, str] = {}
    out: list[str] = []
    words = shell_words(path)
    for word in words:
        m = _DEFAULT_ASSIGN.match(word)
        if m:
            values[m[1]] = _VARIABLE.sub(lambda v: values.get(v[1] or v[2], v[0]), m[2])
            continue
        out.append(_VARIABLE.sub(lambda v: values.get(v[1] or v[2], v[0]), word))
    return out


def _override(config: FrameworkConfig, token: str, where: str) -> None:
    if token.startswith("+"):
        raise ConfigError(
            f"{token}: SkyRL refuses '+' overrides (config.py:1789-1794)", hint="write it without the '+'"
        )
    parsed = hydra_override(token)
    if parsed is None:
        raise ConfigError(f"{token}: not a key=value override", hint="e.g. generator.sampling_params.temperature=0.6")
    _, key, value = parsed
    if isinstance(value, dict):
        for k, v in flatten(value, key):
            config.set(k, v, where)
    else:
        config.set(key, value if not isinstance(value, str) else parse_scalar(value), where)


def facts(config: FrameworkConfig) -> dict[str, Found]:
    out: dict[str, Found] = {}
    trainer_t = config.get("trainer.algorithm.temperature")
    if trainer_t is not None and trainer_t.value is not None:
        # None: copied from the sampling temperature (config.py:1737-1738), so they agree
        out["trainer_temperature"] = trainer_t
    mode = config.get(IE + "engine_init_kwargs.logprobs_mode")
    if mode is None and _local(config):
        out["evidence:logprobs-temperature"] = Found(
            f"skyrl: build_vllm_cli_args never sets vLLM's logprobs_mode ({_SERVERS}:59-161 @ {COMMIT[:7]}), "
            f"so the servers return raw log-probs, while the trainer divides its logits by the temperature "
            f"({_WRAPPER}:334); docs/frameworks/skyrl.md",
            Origin("", default_at=f"{_SERVERS}:59-161 @ {COMMIT[:7]}", framework="skyrl"),
        )
    return out

"""TRL: a ``GRPOConfig`` as YAML or JSON (the dataclass's fields, with ``trl grpo``'s ModelConfig and
ScriptArguments fields beside them, as ``trl grpo --config x.yaml`` reads it through TrlParser), then
``--key value`` overrides, which win, as HfArgumentParser takes them after the file. Defaults and code
read at huggingface/trl ``f2cd577`` (1.10.0.dev0, the commit docs/frameworks/trl.md cites); paths
below are in that repository. TRL 1.16.0 (installed in .trl-site) has the same defaults at other
lines and one behaviour changed: see :func:`facts`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch_probe.errors import ConfigError
from mismatch_probe.frameworks.base import SKIP, Found, FrameworkConfig, Origin, Rule
from mismatch_probe.frameworks.sources import flag_values, flatten, read_structured

COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"

_GRPO = "trl/trainer/grpo_config.py"
_BASE = "trl/trainer/base_config.py"
_MODEL = "trl/trainer/model_config.py"
_VLLM = "trl/generation/vllm_generation.py"

DEFAULTS: dict[str, tuple[Any, str]] = {
    "model_init_kwargs": (None, f"{_GRPO}:424"),
    "cast_lm_head_to_fp32": (False, f"{_GRPO}:454"),
    "num_generations": (8, f"{_GRPO}:474"),
    "max_completion_length": (512, f"{_GRPO}:488"),
    "steps_per_generation": (None, f"{_GRPO}:518"),
    "temperature": (1.0, f"{_GRPO}:522"),
    "top_p": (1.0, f"{_GRPO}:526"),
    "top_k": (0, f"{_GRPO}:533"),
    "use_vllm": (False, f"{_GRPO}:577"),
    "vllm_mode": ("colocate", f"{_GRPO}:584"),
    "vllm_model_impl": ("vllm", f"{_GRPO}:594"),
    "vllm_enable_sleep_mode": (False, f"{_GRPO}:602"),
    "vllm_server_base_url": (None, f"{_GRPO}:615"),
    "vllm_server_host": ("0.0.0.0", f"{_GRPO}:622"),
    "vllm_server_port": (8000, f"{_GRPO}:626"),
    "vllm_gpu_memory_utilization": (0.3, f"{_GRPO}:646"),
    "vllm_max_model_length": (None, f"{_GRPO}:654"),
    "vllm_tensor_parallel_size": (1, f"{_GRPO}:661"),
    "vllm_importance_sampling_correction": (True, f"{_GRPO}:915"),
    "vllm_importance_sampling_mode": ("sequence_mask", f"{_GRPO}:924"),
    "vllm_importance_sampling_clip_max": (3.0, f"{_GRPO}:937"),
    "vllm_importance_sampling_clip_min": (None, f"{_GRPO}:945"),
    "vllm_importance_sampling_cap": (None, f"{_GRPO}:1026"),
    # None: True unless fp16 (base_config.py:105)
    "bf16": (None, f"{_BASE}:67"),
    # ModelConfig, which `trl grpo` turns into model_init_kwargs (trl/scripts/grpo.py:110-115)
    "model_name_or_path": (None, f"{_MODEL}:81"),
    "dtype": ("float32", f"{_MODEL}:89"),
    "attn_implementation": (None, f"{_MODEL}:96"),
    # not a TRL key: the trainer reads the dataset's "prompt" column; open-r1's recipes name theirs
    # with dataset_prompt_column (their GRPOScriptArguments), which they copy into "prompt"
    "dataset_prompt_column": ("prompt", "trl/trainer/grpo_trainer.py:2274"),
}

ENGINE_PINS = {"vllm": "vllm>=0.17.0,<=0.25.1 (pyproject.toml:83)"}
MODEL_KEYS = ("model_name_or_path",)
DATASET_KEYS = ("dataset_name",)  # ScriptArguments: a Hub id or a local path
PROMPT_KEY_KEYS = ("dataset_prompt_column",)

_DTYPES = ("float32", "bfloat16", "float16")


def _vllm(use_vllm: Any, mode: Any, wanted: str) -> bool:
    return bool(use_vllm) and mode == wanted


def _colocate(config: FrameworkConfig) -> bool:
    """The engine TRL builds in each training process: the only one whose settings the config holds."""
    return _vllm(config.value("use_vllm"), config.value("vllm_mode"), "colocate")


def _server(config: FrameworkConfig) -> bool:
    return _vllm(config.value("use_vllm"), config.value("vllm_mode"), "server")


def _reference_dtype(dtype: Any, torch_dtype: Any, bf16: Any, fp16: Any) -> Any:
    weights = str(torch_dtype if torch_dtype is not None else dtype)
    if weights not in _DTYPES:
        return SKIP  # "auto": the checkpoint's own, which the probe's reference loads as its own dtype too
    if weights == "float32" and fp16:
        return "float16"
    if weights == "float32" and (bf16 if bf16 is not None else not fp16):
        return "bfloat16"
    return weights


def _url(base_url: Any, host: Any, port: Any) -> str:
    # VLLMClient: base_url when given, else http://host:port (trl/generation/vllm_client.py)
    return str(base_url).rstrip("/") if base_url else f"http://{host}:{port}"


def _max_num_seqs(per_device: Any, tp: Any, steps: Any, accumulation: Any) -> Any:
    if per_device is None:
        return SKIP  # transformers' TrainingArguments default, not TRL's: not declared here
    # steps_per_generation defaults to gradient_accumulation_steps (grpo_config.py:1077-1078), whose
    # own default is transformers' 1
    return int(per_device) * int(tp) * int(steps if steps is not None else (accumulation or 1))


_IS_KEYS = (
    "use_vllm",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_cap",
)


def _correction(mode: str):
    """TRL's IS mode ``mode`` (grpo_trainer.py:2579-2622) -> its upper bound, the probe's threshold."""

    def convert(use_vllm: Any, on: Any, actual: Any, clip_max: Any, cap: Any) -> Any:
        bound = cap if cap is not None else clip_max  # the deprecated cap replaces clip_max (grpo_config.py:1123-1129)
        return float(bound) if use_vllm and on and actual == mode and bound is not None else SKIP

    return convert


def _token_mask_low(use_vllm: Any, on: Any, mode: Any, clip_min: Any) -> Any:
    return float(clip_min) if use_vllm and on and mode == "token_mask" and clip_min is not None else SKIP


RULES: list[Rule] = [
    Rule("engine.name", ("use_vllm", "vllm_mode"), lambda u, m: "vllm" if _vllm(u, m, "colocate") else SKIP),
    # server mode: the engine is `trl vllm-serve`, whose own flags the config does not hold
    Rule("engine.api", ("use_vllm", "vllm_mode"), lambda u, m: "trl" if _vllm(u, m, "server") else SKIP),
    Rule("engine.url", ("vllm_server_base_url", "vllm_server_host", "vllm_server_port"), _url, when=_server),
    Rule("engine.tensor_parallel_size", ("vllm_tensor_parallel_size",), int, when=_colocate),
    Rule("engine.gpu_memory_utilization", ("vllm_gpu_memory_utilization",), float, when=_colocate),
    Rule(
        "engine.max_model_len", ("vllm_max_model_length",), lambda v: int(v) if v is not None else None, when=_colocate
    ),
    Rule(
        "engine.max_num_seqs",
        (
            "per_device_train_batch_size",
            "vllm_tensor_parallel_size",
            "steps_per_generation",
            "gradient_accumulation_steps",
        ),
        _max_num_seqs,
        note="per_device_train_batch_size x vllm_tensor_parallel_size x steps_per_generation (grpo_trainer.py:1091-1093)",
        when=_colocate,
    ),
    Rule(
        "engine.max_num_batched_tokens",
        code_at=f"{_VLLM}:363",
        convert=lambda c: 4096 if _colocate(c) else SKIP,
        note="TRL's colocated LLM(...)",
    ),
    Rule(
        "engine.dtype",
        code_at=f"{_VLLM}:351-368",
        convert=lambda c: "auto" if _colocate(c) else SKIP,
        note="the colocated LLM(...) passes no dtype: the checkpoint's own",
    ),
    Rule(
        "engine.logprobs_mode",
        code_at=f"{_VLLM}:365; trl/scripts/vllm_serve.py:361",
        convert=lambda c: "processed" if c.value("use_vllm") else SKIP,
        note="processed_logprobs in both modes",
    ),
    Rule(
        "engine.extra_args",
        ("vllm_model_impl",),
        lambda v: {"model_impl": str(v)} if v not in (None, "vllm") else SKIP,
        note="vLLM's model_impl (vllm_generation.py:358)",
        when=_colocate,
    ),
    Rule("sampling.temperature", ("temperature",), float),
    Rule("sampling.top_p", ("top_p",), float),
    Rule("sampling.top_k", ("top_k",), int),
    Rule("sampling.n", ("num_generations",), int),
    Rule("sampling.max_tokens", ("max_completion_length",), int),
    Rule(
        "reference.dtype",
        ("dtype", "torch_dtype", "bf16", "fp16"),
        _reference_dtype,
        note=(
            "the trainer's weights (ModelConfig dtype; torch_dtype is its name before TRL #4000, as open-r1's "
            "recipes spell it); float32 weights under bf16/fp16 mixed precision (base_config.py:67,105) compute "
            "in 16 bits, and the probe's reference has no autocast"
        ),
    ),
    Rule("reference.attn_implementation", ("attn_implementation",), lambda v: str(v) if v else "auto"),
    Rule("reference.logits_fp32", ("cast_lm_head_to_fp32",), bool),
    Rule(
        "reference.logprobs",
        code_at="trl/trainer/grpo_trainer.py:1517-1520",
        value="temperature",
        note="the trainer computes log_softmax(logits / temperature)",
    ),
    Rule(
        "reference.packing",
        code_at="trl/trainer/grpo_trainer.py:2378-2395",
        value=False,
        note="prompts left-padded and completions right-padded into one batch",
    ),
    Rule("corrections.token_tis", _IS_KEYS, _correction("token_truncate")),
    Rule("corrections.token_mask_high", _IS_KEYS, _correction("token_mask")),
    Rule(
        "corrections.token_mask_low",
        (
            "use_vllm",
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_min",
        ),
        _token_mask_low,
    ),
    Rule("corrections.seq_tis", _IS_KEYS, _correction("sequence_truncate")),
    Rule("corrections.seq_mis", _IS_KEYS, _correction("sequence_mask")),
]

UNMIRRORABLE: dict[str, str] = {
    "use_vllm": "without vLLM, TRL samples with transformers' generate, for which the probe has no engine",
    "min_p": "no probe key for min-p: compare samples without it",
    "repetition_penalty": "no probe key for a repetition penalty: compare samples without it",
    "vllm_enable_sleep_mode": "sleep/wake around each generate is weight sync's cycle (sync.sleep_level 2), not compare's",
    "vllm_structured_outputs_regex": "guided decoding has no probe key",
    "vllm_importance_sampling_clip_min": "TRL's lower IS bound has a probe key only in token_mask mode",
    "off_policy_mask_threshold": "DeepSeek-V3.2's advantage-and-KL sequence mask has no probe key",
    "cache_implementation": "transformers' generate cache, used only without vLLM",
    "use_transformers_continuous_batching": "transformers' continuous batching has no probe engine",
    "vllm_device": "not a GRPOConfig field at this commit (older TRL's vLLM GPU choice): TrlParser refuses it",
    "vllm_server_base_url": "server mode's address: the probe reads the server's own settings back (--engine-api trl)",
    "model_init_kwargs": "`trl grpo` replaces model_init_kwargs with ModelConfig's fields (trl/scripts/grpo.py:110-115)",
}
# what a config sets under these names that no rule reads is listed as not mirrored
WATCHED = ("vllm_", "generation_kwargs", "model_init_kwargs")
NOT_SETTINGS = frozenset(
    {
        "vllm_server_timeout",
        "vllm_group_port",
        "vllm_server_host",
        "vllm_server_port",
        "vllm_importance_sampling_correction",
    }
)


def read(inputs: list[str]) -> FrameworkConfig:
    """``inputs``: GRPOConfig YAML/JSON files (``--config FILE`` as `trl grpo` takes it, or the file
    alone), then ``--key value`` / ``--key=value`` overrides; the command line wins over the file."""
    config = FrameworkConfig("trl", COMMIT, DEFAULTS)
    words: list[str] = []
    items = [i for i in inputs if i != "--config"]
    for item in items:
        path = Path(item)
        is_config = path.suffix in (".yaml", ".yml", ".json") and not item.startswith("-")
        if not is_config and not path.is_file():
            words.append(item)  # a flag or its value
            continue
        if not is_config:
            raise ConfigError(
                f"{item}: not a GRPOConfig YAML or JSON file",
                hint="give the YAML or JSON file that `trl grpo` reads as its config",
            )
        tree = read_structured(path)
        tree.pop("env", None)  # environment variables TrlParser exports (trl/scripts/utils.py:330-335)
        config.files.append(item)
        for key, value in tree.items():
            _set(config, key, value, item)
    for flag, value in flag_values(words).items():
        # HfArgumentParser takes --vllm-mode as --vllm_mode
        _set(config, flag.lstrip("-").replace("-", "_"), value, "command line")
    if not config.files and not config.user_keys():
        raise ConfigError(
            "no GRPOConfig settings given",
            hint="mismatch-probe init trl grpo_config.yaml, then any of its fields as flags (e.g. --temperature 0.7)",
        )
    return config


def _set(config: FrameworkConfig, key: str, value: Any, where: str) -> None:
    if isinstance(value, dict):  # model_init_kwargs, generation_kwargs: one key per entry
        for k, v in flatten(value, key):
            config.set(k, v, where)
    else:
        config.set(key, value, where)


def facts(config: FrameworkConfig) -> dict[str, Found]:
    out: dict[str, Found] = {}
    sleep = config.get("vllm_enable_sleep_mode")
    if _colocate(config) and sleep is not None and sleep.value:
        where = f"{_VLLM}:540-548"
        out["colocate_reload_weights"] = Found(
            "with vllm_mode=colocate and vllm_enable_sleep_mode, generate() calls "
            f"collective_rpc('reload_weights') after waking the weights ({where} @ {COMMIT[:7]}), after "
            "sync_weights pushed the trainer's; vLLM's reload_weights() reloads the checkpoint from disk, so "
            "the engine may sample with the step-0 weights (TRL 1.16.0 re-pushes the weights instead, "
            "vllm_generation.py:586-590)",
            Origin(sleep.origin.key, sleep.origin.file, sleep.origin.default_at, "trl"),
        )
    return out

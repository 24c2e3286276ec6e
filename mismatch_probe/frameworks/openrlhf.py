"""OpenRLHF: the flags of ``python3 -m openrlhf.cli.train_ppo_ray`` (``--vllm.num_engines 4``,
``--rollout.temperature 1.0``: dotted groups, underscores within), in a launch script whose bash
arrays may hold them, in a file of the arguments, or as typed. Defaults and code read at OpenRLHF
``3c3be62`` (docs/frameworks/openrlhf.md cites the same commit); paths below are in that repository.
What ``train_ppo_ray.py`` changes after parsing (packing turned on by ring attention or dynamic
batching, and then flash attention) is applied as it does it."""

from __future__ import annotations

from typing import Any

from mismatch_probe.frameworks.base import SKIP, Found, FrameworkConfig, Rule, dtype_name
from mismatch_probe.frameworks.cli_flags import flag, read_flags

COMMIT = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"

_CLI = "openrlhf/cli/train_ppo_ray.py"
_VLLM = "openrlhf/trainer/ray/vllm_engine.py"
_GEN = "openrlhf/trainer/ppo_utils/samples_generator.py"
_IS = "--algo.advantage.is_correction_"

DEFAULTS: dict[str, tuple[Any, str]] = {
    "--vllm.num_engines": (None, f"{_CLI}:231-233"),
    "--vllm.tensor_parallel_size": (1, f"{_CLI}:234-239"),
    "--vllm.enable_prefix_caching": (False, f"{_CLI}:242"),
    "--vllm.enforce_eager": (False, f"{_CLI}:243"),
    "--vllm.gpu_memory_utilization": (0.95, f"{_CLI}:250-255"),
    _IS + "enable": (False, f"{_CLI}:257"),
    _IS + "threshold": ([0.5, 5.0], f"{_CLI}:258-264"),
    _IS + "type": ("tis", f"{_CLI}:265-271"),
    "--ds.param_dtype": ("bf16", f"{_CLI}:311-317"),
    "--ds.attn_implementation": ("flash_attention_2", f"{_CLI}:323-328"),
    "--ds.tensor_parallel_size": (1, f"{_CLI}:353"),
    "--ds.packing_samples": (False, f"{_CLI}:356"),
    "--train.dynamic_batch_enable": (False, f"{_CLI}:359"),
    "--data.max_len": (2048, f"{_CLI}:379"),
    "--rollout.max_new_tokens": (None, f"{_CLI}:380-385"),
    "--rollout.top_p": (1.0, f"{_CLI}:398"),
    "--rollout.temperature": (1.0, f"{_CLI}:399"),
    "--rollout.n_samples_per_prompt": (1, f"{_CLI}:413-415"),
    "--actor.policy_loss_type": ("ppo", f"{_CLI}:420"),
    "--ds.ring_attn_size": (1, f"{_CLI}:506"),
    "--data.input_key": ("input", f"{_CLI}:542"),
    "--data.input_template": (None, f"{_CLI}:544"),
    "--data.apply_chat_template": (False, f"{_CLI}:545-547"),
}

ENGINE_PINS = {"vllm": "vllm==0.27.1 (setup.py:77, extra 'vllm'; dockerfile/Dockerfile:19)"}
MODEL_KEYS = ("--actor.model_name_or_path",)
DATASET_KEYS = ("--data.prompt_dataset",)
PROMPT_KEY_KEYS = ("--data.input_key",)

# store_true flags (argparse takes no value after them): those with a False default, and the ones
# the lists below name
BOOLEANS = frozenset(
    {k for k, (v, _) in DEFAULTS.items() if v is False}
    | {
        "--vllm.enable_sleep",
        "--train.colocate_all",
        "--train.colocate_actor_ref",
        "--train.async_enable",
        "--train.partial_rollout_enable",
        "--train.full_determinism_enable",
        "--vllm.sync_with_ray",
    }
)


def _attn(attn: Any, packing: Any) -> str:
    # packed samples need flash attention: anything else becomes flash_attention_2 (train_ppo_ray.py:655-660)
    return "flash_attention_2" if flag(packing) and "flash_attention" not in str(attn) else str(attn)


def _max_tokens(max_new_tokens: Any, max_len: Any) -> int:
    # None: vLLM's max_tokens None, up to max_model_len (= --data.max_len) less the prompt (samples_generator.py:207)
    return int(max_new_tokens) if max_new_tokens is not None else int(max_len)


def _correction(kind: str, side: int):
    """The threshold ``side`` (0 low, 1 high) of correction type ``kind``, where the run applies it:
    with --algo.advantage.is_correction_enable and the PPO loss (openrlhf/models/loss.py:197-217)."""

    def convert(enable: Any, kind_set: Any, threshold: Any, loss_type: Any) -> Any:
        if not flag(enable) or kind_set != kind or loss_type != "ppo":
            return SKIP
        return float(threshold[side])

    return convert


_CORRECTION_KEYS = (_IS + "enable", _IS + "type", _IS + "threshold", "--actor.policy_loss_type")


def _geo_eps(enable: Any, kind: Any, threshold: Any, loss_type: Any) -> Any:
    # the probe's geometric rejection is the symmetric [1 - eps, 1 + eps]; OpenRLHF's [low, high] maps
    # only where it is symmetric
    if not flag(enable) or kind != "seq-mask-tis" or loss_type != "ppo":
        return SKIP
    low, high = float(threshold[0]), float(threshold[1])
    return round(1.0 - low, 12) if abs((1.0 - low) - (high - 1.0)) < 1e-9 and 0 < low < 1 else SKIP


RULES: list[Rule] = [
    Rule("engine.name", code_at=f"{_VLLM}:34-64", value="vllm", note="OpenRLHF's engines are vLLM's AsyncLLMEngine"),
    Rule(
        "engine.dtype",
        code_at=f"{_VLLM}:275",
        value="bfloat16",
        note="hard-coded; weight sync asserts the trainer's dtype equals it (vllm_worker_wrap.py:39,59)",
    ),
    Rule("engine.tensor_parallel_size", ("--vllm.tensor_parallel_size",), int),
    Rule(
        "engine.distributed_executor_backend",
        ("--vllm.tensor_parallel_size",),
        lambda tp: "uni" if int(tp) == 1 else "ray",
        note=f"{_VLLM}:242",
    ),
    Rule("engine.prefix_caching", ("--vllm.enable_prefix_caching",), flag),
    Rule("engine.enforce_eager", ("--vllm.enforce_eager",), flag),
    Rule("engine.gpu_memory_utilization", ("--vllm.gpu_memory_utilization",), float),
    Rule("engine.max_model_len", ("--data.max_len",), int, note=f"vLLM's max_model_len ({_VLLM}:273)"),
    Rule(
        "engine.logprobs_mode",
        (_IS + "enable",),
        lambda v: "processed" if flag(v) else SKIP,
        note="processed_logprobs with the correction on (train_ppo_ray.py:78; vllm_engine.py:295-297); off: none",
    ),
    Rule("sampling.temperature", ("--rollout.temperature",), float),
    Rule("sampling.top_p", ("--rollout.top_p",), float),
    Rule("sampling.top_k", code_at=f"{_GEN}:206", value=-1, note="OpenRLHF has no top-k flag"),
    Rule("sampling.n", ("--rollout.n_samples_per_prompt",), int),
    Rule("sampling.max_tokens", ("--rollout.max_new_tokens", "--data.max_len"), _max_tokens),
    Rule(
        "reference.dtype",
        ("--ds.param_dtype",),
        dtype_name,
        note="the actor's dtype (openrlhf/trainer/ray/ppo_actor.py:516)",
    ),
    Rule("reference.attn_implementation", ("--ds.attn_implementation", "--ds.packing_samples"), _attn),
    Rule("reference.packing", ("--ds.packing_samples",), flag, note="the actor's packed forward (ppo_actor.py:523)"),
    Rule(
        "reference.tensor_parallel_size",
        ("--ds.tensor_parallel_size",),
        int,
        note="the probe runs transformers' DTensor plan, not DeepSpeed's",
    ),
    Rule(
        "reference.logits_fp32",
        code_at="openrlhf/models/actor.py:267",
        value=False,
        note="the LM head runs in the model's dtype; its logits are cast to float32 after it",
    ),
    Rule(
        "reference.logprobs",
        code_at="openrlhf/models/actor.py:285",
        value="temperature",
        note="log_softmax(logits / --rollout.temperature) (ppo_actor.py:524)",
    ),
    Rule(
        "corrections.token_tis",
        _CORRECTION_KEYS,
        _correction("tis", 1),
        note="tis clamps to [low, high]; the low clamp has no probe key",
    ),
    Rule("corrections.token_mask_low", _CORRECTION_KEYS, _correction("icepop", 0), note="icepop zeroes tokens outside"),
    Rule(
        "corrections.token_mask_high", _CORRECTION_KEYS, _correction("icepop", 1), note="icepop zeroes tokens outside"
    ),
    Rule("corrections.geo_eps", _CORRECTION_KEYS, _geo_eps, note="seq-mask-tis: the geometric-mean ratio's interval"),
]

UNMIRRORABLE: dict[str, str] = {
    "--vllm.num_engines": "independent engines load-balanced by OpenRLHF, not vLLM data parallelism: one engine mirrors one",
    "--ds.ring_attn_size": "ring-attention context parallelism has no probe key (the reference has Ulysses SP)",
    _IS + "threshold": (
        "applies only with --algo.advantage.is_correction_enable and the PPO loss; seq-mask-tis's [low, high] "
        "maps to the probe's geo_eps (1 - eps, 1 + eps) only when symmetric about 1"
    ),
    "--train.full_determinism_enable": "VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm_engine.py:98-100): no probe setting",
    "--train.partial_rollout_enable": "in-flight samples span two weight versions: the probe samples one checkpoint",
    "--ds.load_in_4bit": "a 4-bit trainer: the reference has no quantized mode",
    "--ds.lora.rank": "LoRA training: the probe compares one checkpoint's forward",
}
# the engine's, the sampling's and the correction's flags that no rule reads are listed as not mirrored
WATCHED = ("--vllm.", "--rollout.", "--algo.advantage.is_correction")
# what those prefixes hold that is batching, weight sync or bookkeeping, not numerics
NOT_SETTINGS = frozenset(
    {
        "--vllm.sync_backend",
        "--vllm.sync_with_ray",
        "--vllm.enable_sleep",
        "--rollout.batch_size",
        "--rollout.micro_batch_size",
        "--rollout.max_tokens_per_gpu",
        "--rollout.vllm_generate_batch_size",
    }
)

_ENTRIES = ("openrlhf.cli.train_ppo_ray",)


def read(inputs: list[str]) -> FrameworkConfig:
    """``inputs``: OpenRLHF launch scripts, files of its arguments, and flags as typed; later ones win."""
    config = FrameworkConfig("openrlhf", COMMIT, DEFAULTS)
    read_flags(config, inputs, entries=_ENTRIES, booleans=BOOLEANS, what="OpenRLHF")
    # ring attention and dynamic batching turn packing on (train_ppo_ray.py:642-650); the value keeps
    # the origin of the flag that did it
    for cause, applies in (("--ds.ring_attn_size", lambda v: int(v) > 1), ("--train.dynamic_batch_enable", flag)):
        found = config.get(cause)
        if found is not None and applies(found.value) and not flag(config.value("--ds.packing_samples")):
            config.replace("--ds.packing_samples", True, found.origin)
    found = config.get("--ds.ring_attn_size")
    if found is not None and int(found.value) == 1:
        config.delete("--ds.ring_attn_size")  # a ring of 1 is no context parallelism
    return config


def facts(config: FrameworkConfig) -> dict[str, Found]:
    out: dict[str, Found] = {}
    template = config.get("--data.apply_chat_template")
    if template is not None and flag(template.value):
        # prompts_dataset.py:26-37: a string becomes one user message, rendered with the chat template
        out["dataset_shape"] = Found("text-as-chat", template.origin)
    else:
        # without the chat template, --data.input_template wraps the raw text (prompts_dataset.py:38-40);
        # one without "{}" is dropped (train_ppo_ray.py:632-634)
        wrap = config.get("--data.input_template")
        if wrap is not None and isinstance(wrap.value, str) and "{}" in wrap.value:
            out["dataset_input_template"] = Found(wrap.value, wrap.origin)
    return out

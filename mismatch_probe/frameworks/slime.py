"""slime: the flags of ``train.py`` (or ``train_async.py``), in a launch script whose bash arrays
(``ROLLOUT_ARGS=( ... )``) hold them, in a file of the arguments, or as typed. Its own flags, SGLang's
server arguments with the prefix ``--sglang-`` (``sglang_utils/arguments.py:71-121``) and Megatron's.
Defaults and code read at slime ``624b824`` (docs/frameworks/slime.md cites the same commit); paths
below are in that repository. A sourced model file (``source scripts/models/qwen3-4B.sh``, its
``MODEL_ARGS``) holds the architecture, which the checkpoint gives the probe: it is not read."""

from __future__ import annotations

from typing import Any

from mismatch_probe.frameworks.base import SKIP, Found, FrameworkConfig, Origin, Rule
from mismatch_probe.frameworks.cli_flags import flag, read_flags

COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"

_ARGS = "slime/utils/arguments.py"
_ENGINE = "slime/backends/sglang_utils/sglang_engine.py"
_LOSS = "slime/backends/megatron_utils/loss.py"

DEFAULTS: dict[str, tuple[Any, str]] = {
    "--rollout-num-gpus-per-engine": (1, f"{_ARGS}:55-60"),
    "--colocate": (False, f"{_ARGS}:70-78"),
    "--rollout-temperature": (1.0, f"{_ARGS}:342-347"),
    "--rollout-top-p": (1.0, f"{_ARGS}:348-350"),
    "--rollout-top-k": (-1, f"{_ARGS}:351-352"),
    "--rollout-max-response-len": (None, f"{_ARGS}:373-380"),
    "--input-key": ("input", f"{_ARGS}:659"),
    "--apply-chat-template": (False, f"{_ARGS}:656"),
    "--n-samples-per-prompt": (1, f"{_ARGS}:699-700"),
    "--use-tis": (False, f"{_ARGS}:1060-1065"),
    "--tis-clip": (2.0, f"{_ARGS}:1066-1071"),
    "--tis-clip-low": (0, f"{_ARGS}:1072-1077"),
    "--use-rollout-routing-replay": (False, f"{_ARGS}:1097-1102"),
    # Megatron's flag; slime trains in bf16 unless it is given
    "--fp16": (False, "slime/backends/megatron_utils/arguments.py:157"),
}

ENGINE_PINS = {
    "sglang": (
        "slimerl/sglang:v0.5.15.post1-cu129, SGLang 0.5.15.post1 with slime's sglang.patch, "
        "sglang-top_p.patch and others (docker/Dockerfile:1-2,136-151)"
    ),
}
MODEL_KEYS = ("--hf-checkpoint",)
DATASET_KEYS = ("--prompt-data",)
PROMPT_KEY_KEYS = ("--input-key",)

# store_true flags the rules read: given bare, they take no value
_SGLANG_SWITCHES = (
    "--sglang-disable-cuda-graph",
    "--sglang-disable-radix-cache",
    "--sglang-enable-deterministic-inference",
    "--sglang-enable-fp32-lm-head",
    "--sequence-parallel",
)
BOOLEANS = frozenset({k for k, (v, _) in DEFAULTS.items() if v is False} | set(_SGLANG_SWITCHES))


def _tp(gpus_per_engine: Any, pp: Any) -> int:
    # tp_size = gpus per engine // pp_size (sglang_engine.py:521-522)
    return int(gpus_per_engine) // int(pp or 1)


def _engine_dtype(fp16: Any, dtype: Any) -> Any:
    # --fp16 sets SGLang's dtype before the --sglang-* arguments, which do not replace it (sglang_engine.py:571-582)
    if flag(fp16):
        return "float16"
    return str(dtype) if dtype is not None else SKIP


def _tis(use_tis: Any, clip: Any, custom: Any) -> Any:
    # a custom TIS function replaces vanilla_tis_function (loss.py:1074-1077): its thresholds are its own
    return float(clip) if flag(use_tis) and custom is None else SKIP


def _true(value: Any) -> Any:
    return True if flag(value) else SKIP


def _false(value: Any) -> Any:
    return False if flag(value) else SKIP


RULES: list[Rule] = [
    Rule(
        "engine.name",
        code_at=f"{_ENGINE}:48-52",
        value="sglang",
        note="slime's rollout engines are SGLang servers",
    ),
    Rule("engine.dtype", ("--fp16", "--sglang-dtype"), _engine_dtype),
    Rule(
        "engine.tensor_parallel_size",
        ("--rollout-num-gpus-per-engine", "--sglang-pp-size"),
        _tp,
        note="SGLang's tp_size (sglang_engine.py:521-522)",
    ),
    Rule("engine.pipeline_parallel_size", ("--sglang-pp-size",), int),
    Rule("engine.data_parallel_size", ("--sglang-dp-size",), int),
    Rule(
        "engine.gpu_memory_utilization", ("--sglang-mem-fraction-static",), float, note="SGLang's mem_fraction_static"
    ),
    Rule("engine.enforce_eager", ("--sglang-disable-cuda-graph",), _true),
    # a chunk size is not a switch: only -1 (off) maps; a size stays listed as not mirrored
    Rule("engine.chunked_prefill", ("--sglang-chunked-prefill-size",), lambda v: False if int(v) == -1 else SKIP),
    Rule("engine.prefix_caching", ("--sglang-disable-radix-cache",), _false),
    Rule("engine.attention_backend", ("--sglang-attention-backend",), str),
    Rule("engine.batch_invariant", ("--sglang-enable-deterministic-inference",), _true),
    Rule("engine.rl_on_policy_target", ("--sglang-rl-on-policy-target",), str),
    Rule("engine.logits_fp32", ("--sglang-enable-fp32-lm-head",), _true),
    Rule("engine.kv_cache_dtype", ("--sglang-kv-cache-dtype",), str),
    Rule("engine.quantization", ("--sglang-quantization",), str),
    Rule("engine.max_model_len", ("--sglang-context-length",), int),
    Rule("engine.max_num_seqs", ("--sglang-max-running-requests",), int),
    Rule(
        "engine.record_routing",
        ("--use-rollout-routing-replay",),
        lambda v: True if flag(v) else SKIP,
        note="return_routed_experts (sglang_rollout.py:181-182)",
    ),
    Rule("sampling.temperature", ("--rollout-temperature",), float),
    Rule("sampling.top_p", ("--rollout-top-p",), float),
    Rule("sampling.top_k", ("--rollout-top-k",), int),
    Rule("sampling.n", ("--n-samples-per-prompt",), int),
    Rule("sampling.max_tokens", ("--rollout-max-response-len",), lambda v: int(v) if v is not None else None),
    Rule(
        "reference.dtype",
        ("--fp16",),
        lambda v: "float16" if flag(v) else "bfloat16",
        note="Megatron's bf16 = not fp16 (megatron_utils/arguments.py:157)",
    ),
    Rule(
        "reference.logits_fp32",
        code_at=f"{_LOSS}:535",
        value=False,
        note=(
            "the output layer runs in the model's dtype; Megatron's Float16Module casts its logits to float32, "
            "which loss.py asserts"
        ),
    ),
    Rule(
        "reference.logprobs",
        code_at=f"{_LOSS}:540-543",
        value="temperature",
        note="log_softmax(logits / --rollout-temperature); below top-p 1 renormalised over SGLang's nucleus",
    ),
    Rule(
        "reference.tensor_parallel_size",
        ("--tensor-model-parallel-size",),
        int,
        note="the probe runs a DTensor plan, not Megatron's kernels",
    ),
    Rule(
        "reference.routing_replay",
        ("--use-rollout-routing-replay",),
        lambda v: True if flag(v) else SKIP,
    ),
    Rule(
        "corrections.token_tis",
        ("--use-tis", "--tis-clip", "--custom-tis-function-path"),
        _tis,
        note="vanilla_tis_function clamps to [--tis-clip-low, --tis-clip] (loss.py:884-905)",
    ),
]

UNMIRRORABLE: dict[str, str] = {
    "--sglang-chunked-prefill-size": "a chunk size, not a switch: pass it as --engine-arg chunked_prefill_size=N",
    "--tis-clip-low": "the probe's token TIS clips above only",
    "--custom-tis-function-path": "a TIS function of your own: the probe computes its corrections by its own rules",
    "--custom-config-path": "its settings are the custom functions' own, not slime's",
    "--use-rollout-logprobs": (
        "the rollout's own log-probs are the old log-probs (arguments.py:1051-1058), so slime never sees "
        "the mismatch the probe measures"
    ),
    "--sequence-parallel": "Megatron's sequence parallelism splits the TP region's activations; the probe's TP plan has none",
    "--context-parallel-size": "Megatron context parallelism has no probe key (the reference has Ulysses SP)",
    "--pipeline-model-parallel-size": "the reference has no pipeline parallelism",
    "--expert-model-parallel-size": "the reference has no expert parallelism",
    "--expert-tensor-parallel-size": "the reference has no expert tensor parallelism",
    "--attention-backend": "Megatron's attention kernels: the reference runs transformers' (reference.attn_implementation)",
    "--rollout-max-context-len": "a cap on prompt + response slime applies per sample; set sampling.max_tokens yourself",
    "--use-routing-replay": "Megatron's own routing replay between its forward passes, not the engine's routing",
    "--sglang-config": "per-group SGLang overrides in a YAML the probe does not read",
}
# the rollout's and the engine's settings whose keys no rule reads are listed as not mirrored
WATCHED = ("--sglang-", "--rollout-", "--tis-")
# what those prefixes hold that is batching, addressing or bookkeeping, not numerics
NOT_SETTINGS = frozenset(
    {
        "--rollout-batch-size",
        "--rollout-shuffle",
        "--rollout-seed",
        "--rollout-function-path",
        "--rollout-global-dataset",
        "--rollout-external-engine-addrs",
        "--rollout-skip-special-tokens",
        "--sglang-router-ip",
        "--sglang-router-port",
        "--sglang-router-request-timeout-secs",
        "--sglang-server-concurrency",
        "--sglang-log-level",
        "--sglang-enable-metrics",
    }
)

_ENTRIES = ("train.py", "train_async.py")
_PARALLEL_SIZES = tuple(k for k in UNMIRRORABLE if k.endswith("-parallel-size"))


def read(inputs: list[str]) -> FrameworkConfig:
    """``inputs``: slime launch scripts, files of its arguments, and flags as typed; later ones win."""
    config = FrameworkConfig("slime", COMMIT, DEFAULTS)
    read_flags(config, inputs, entries=_ENTRIES, booleans=BOOLEANS, what="slime")
    # a parallel size of 1 is no parallelism: nothing the probe fails to mirror
    for key in _PARALLEL_SIZES:
        found = config.get(key)
        if found is not None and found.value == 1:
            config.delete(key)
    return config


def facts(config: FrameworkConfig) -> dict[str, Found]:
    out: dict[str, Found] = {}
    top_p = config.get("--rollout-top-p")
    assert top_p is not None  # defaulted
    # below top-p 1 slime asks the patched SGLang for the nucleus ids and renormalises the trainer's
    # log-probs over them (loss.py:83-93,556-578)
    renormalises = float(top_p.value) != 1.0
    out["trainer_renormalizes_truncation"] = Found(renormalises, top_p.origin)
    if renormalises:
        out["evidence:truncated-sampling"] = Found(
            f"slime {_LOSS}:83-93,556-578 @ {COMMIT[:7]}: the trainer renormalises over the nucleus that "
            "sglang-top_p.patch returns; what the patched SGLang returns as log-probs was not read "
            "(docs/frameworks/slime.md)",
            Origin("", default_at=f"{_LOSS}:83-93 @ {COMMIT[:7]}", framework="slime"),
        )
    template = config.get("--apply-chat-template")
    if template is not None and flag(template.value):
        # slime/utils/data.py:142-150: a string becomes one user message, rendered with the chat template
        out["dataset_shape"] = Found("text-as-chat", template.origin)
    return out

"""The ``sglang`` engine's arguments: each setting to the ``sglang.Engine`` / ``ServerArgs`` argument the
spec's declarations name for it (``config/spec.py: engine_arguments``), how a value converts where it is not
the value itself, the CPU defaults mismatch-probe sets, what is read back from ``get_server_info()``, and
what SGLang's offline engine cannot run. Light to import (no SGLang): the registry's ``check`` is here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mismatch_probe.config.spec import LAYOUT_SETTINGS, EngineSpec, engine_arguments
from mismatch_probe.engines.base import check_extra_args
from mismatch_probe.errors import ConfigError

# EngineSpec field -> the ServerArgs field the declarations name (config/spec.py: engine_arguments)
ARGS = {name: args[0] for name, args in engine_arguments("sglang").items()}
# how a spec value becomes its ServerArgs value, where it is not the value itself
CONVERTERS: dict[str, Callable[[Any], Any]] = {"prefix_caching": lambda v: not v}
# set apart by server_args: chunked_prefill (chunked_prefill_size -1, or None for the device's default
# size), and the device (the one the adapter resolved), passed after the node rendezvous, where run.json's
# engine.requested has always held it
SET_APART = ("chunked_prefill", "device")
DEVICE_AFTER = "dist_init_addr"
# Passed only when they differ from the spec's defaults (SGLang's own defaults too): an older SGLang
# may lack them
ONLY_WHEN_SET = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes", "node_rank")
# Read back from get_server_info() into run.json (beside the mapped settings above).
RECORDED = (
    "dtype",
    "tp_size",
    "pp_size",
    "dp_size",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "device",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "sampling_backend",
    "disable_cuda_graph",
    "enable_torch_compile",
    "disable_radix_cache",
    "chunked_prefill_size",
    "enable_deterministic_inference",
    "rl_on_policy_target",
    "enable_fp32_lm_head",
    "mem_fraction_static",
    "max_total_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "max_prefill_tokens",
    "context_length",
    "kv_cache_dtype",
    "quantization",
    "page_size",
    "disable_overlap_schedule",
    "random_seed",
    "schedule_policy",
)
ENV_RECORDED = (
    "SGLANG_USE_CPU_ENGINE",
    "SGLANG_CPU_OMP_THREADS_BIND",
    "SGLANG_RETURN_ORIGINAL_LOGPROB",
    "SGLANG_ENABLE_DETERMINISTIC_INFERENCE",
    "SGLANG_ATTENTION_BACKEND",
    "CUDA_VISIBLE_DEVICES",
)


def settings_by_argument() -> dict[str, str]:
    """ServerArgs field -> the EngineSpec setting that takes its value unchanged (no converter): how a
    server's ``/server_info`` reads back into the names the in-process engine records."""
    return {arg: name for name, arg in ARGS.items() if name not in CONVERTERS and name != "chunked_prefill"}


# On CPU, without a cap, SGLang sizes the KV cache from free system memory (15.6 GB on a 24 GB
# machine): mismatch-probe caps it unless the spec sets max_total_tokens or gpu_memory_utilization.
CPU_MAX_TOTAL_TOKENS = 32768
# Set by the adapter where the spec leaves them open: SGLang's CPU defaults need sgl-kernel's CPU ops.
CPU_DEFAULTS = {"attention_backend": "torch_native", "disable_cuda_graph": True}
# SGLang's scheduler polls its sockets in a busy loop while it has no request: one core at 100%
# (sgl-project/sglang#1730). On CPU that core is one the reference's scoring, and any other process
# of the run, needs; sleep_on_idle (where this SGLang has it) parks the scheduler in zmq's poll until
# a request comes. It changes no number, only when an idle scheduler wakes.
CPU_IDLE_DEFAULTS = {"sleep_on_idle": True}


def server_args(
    spec: EngineSpec, model_path: str | Path, *, device: str, trust_remote_code: bool, version: str, known: set[str]
) -> tuple[dict, dict]:
    """The ``sglang.Engine`` / ``ServerArgs`` keyword arguments for ``spec`` on ``device``, and the
    CPU defaults mismatch-probe set among them; ``known`` are the installed SGLang's ServerArgs fields."""
    args: dict = {
        "model_path": str(model_path),
        "skip_tokenizer_init": True,  # token ids in, token ids out: nothing is re-tokenized
        "trust_remote_code": trust_remote_code,
        "log_level": "warning",
    }
    for field_name, arg in ARGS.items():
        if field_name in SET_APART:
            continue
        value = getattr(spec, field_name)
        if field_name == "dtype" and value == "auto":
            value = None
        if field_name in ONLY_WHEN_SET and value == EngineSpec.model_fields[field_name].default:
            value = None
        if field_name == "batch_invariant" and not value:
            value = None
        if value is not None:
            # the layout settings are refused by name where the installed SGLang lacks them
            if field_name in LAYOUT_SETTINGS and arg not in known:
                raise ConfigError(
                    f"SGLang {version} has no server argument {arg!r}, so engine.{field_name} cannot be honored",
                    hint="upgrade SGLang in the engine's python, or remove the setting",
                )
            args[arg] = CONVERTERS.get(field_name, _unchanged)(value)
        if field_name == DEVICE_AFTER:
            args[ARGS["device"]] = device
    if spec.chunked_prefill is False:
        args[ARGS["chunked_prefill"]] = -1  # SGLang's switch for "no chunked prefill"
    elif spec.chunked_prefill:
        args[ARGS["chunked_prefill"]] = None  # its default size, chosen per device
    # sampling is seeded per request where SGLang allows it (see info()); elsewhere it draws from
    # this engine seed, fixed so that runs repeat, and [engine.extra_args] random_seed varies it
    defaults: dict = {"random_seed": 0}
    if device == "cpu":
        for key, value in CPU_DEFAULTS.items():
            if key not in args:
                defaults[key] = value
        defaults.update({k: v for k, v in CPU_IDLE_DEFAULTS.items() if k in known and k not in args})
        if spec.max_total_tokens is None and spec.gpu_memory_utilization is None:
            defaults["max_total_tokens"] = CPU_MAX_TOTAL_TOKENS
    check_extra_args(spec.extra_args, known, args, f"SGLang {version}", "sglang.srt.server_args.ServerArgs")
    # the user's own value wins over a CPU default
    defaults = {k: v for k, v in defaults.items() if k not in spec.extra_args}
    return {**args, **spec.extra_args, **defaults}, defaults


def world_size(spec: EngineSpec) -> int:
    """SGLang's ranks over every node: data x tensor x pipeline parallel."""
    return spec.data_parallel_size * spec.tensor_parallel_size * spec.pipeline_parallel_size


def local_world_size(spec: EngineSpec) -> int:
    """SGLang's ranks on this node: its world shared out over the nodes."""
    return max(1, world_size(spec) // spec.nnodes)


def layout_phrase(spec: EngineSpec) -> str:
    names = ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size")
    parts = [f"{name} {getattr(spec, name)}" for name in names]
    return " x ".join(parts) + (f" over {spec.nnodes} nodes" if spec.nnodes > 1 else "")


def check_spec(spec: EngineSpec) -> None:
    """What SGLang's offline engine cannot run for mismatch-probe whatever the platform; raises
    :class:`ConfigError` before any engine process starts (``EngineEntry.check``)."""
    if spec.node_rank > 0:
        raise ConfigError(
            f"engine.node_rank = {spec.node_rank}: mismatch-probe runs SGLang's node rank 0, the only one with a "
            "tokenizer manager to take requests; the other nodes run SGLang's schedulers only",
            hint=f"run mismatch-probe on node rank 0; on node R run: python -m sglang.launch_server --model-path "
            f"MODEL --nnodes {spec.nnodes} --node-rank R --dist-init-addr {spec.dist_init_addr or 'HOST:PORT'} "
            f"--tp-size {spec.tensor_parallel_size} --pp-size {spec.pipeline_parallel_size} "
            f"--dp-size {spec.data_parallel_size}",
        )


# the CPU ops SGLang's own CPU quantization calls (srt/layers/quantization/w8a8_int8.py and fp8.py,
# on CPUs with AMX); sgl-kernel's CPU build registers them, and PyPI has no CPU build of it
CPU_QUANT_OPS = {"w8a8_int8": "int8_scaled_mm_with_quant", "fp8": "fp8_scaled_mm_cpu"}


def check_cpu_quantization(spec: EngineSpec, model_path: Path, version: str) -> None:
    """What quantization SGLang's CPU engine cannot run; raises :class:`ConfigError` before the engine
    starts. On CPU SGLang quantizes only with its own w8a8_int8 and (block) fp8 methods, through
    sgl-kernel's CPU ops; the compressed-tensors schemes (fixtures/quantize.py's exports) have no CPU
    path at all."""
    from mismatch_probe.modeling.loading import read_config

    declared = read_config(model_path).get("quantization_config") or {}
    method = spec.quantization or (declared.get("quant_method") if isinstance(declared, dict) else None)
    if not method:
        return
    if method == "compressed-tensors":
        raise ConfigError(
            f"SGLang {version} runs compressed-tensors checkpoints on CUDA only: picking each layer's scheme "
            "asks the CUDA device for its capability (srt/layers/quantization/compressed_tensors/compressed_tensors.py: "
            "_check_scheme_supported -> "
            "torch.cuda.get_device_capability; without this check the engine dies at start with 'Torch not "
            "compiled with CUDA enabled'), and the schemes call CUDA kernels (W8A8 int8: sgl_kernel.int8_scaled_mm, "
            "imported only when is_cuda(); WNA16: Marlin)",
            hint="run this checkpoint with vLLM (its CPU build runs W8A8, W4A16 and FP8_DYNAMIC), or SGLang on a GPU",
        )
    import torch

    op = CPU_QUANT_OPS.get(str(method))
    if op is None or not hasattr(torch.ops.sgl_kernel, op):
        need = (
            f"sgl-kernel's CPU op torch.ops.sgl_kernel.{op}, which this installation lacks (PyPI has no CPU "
            "build of sgl-kernel)"
            if op
            else f"a CPU path, which {method!r} does not have (SGLang quantizes on CPU only with "
            f"{' and '.join(CPU_QUANT_OPS)})"
        )
        raise ConfigError(
            f"SGLang {version}'s CPU engine cannot run quantization {method!r}: it needs {need}",
            hint="run the quantized rollout with vLLM's CPU build, or SGLang on a GPU",
        )


def _unchanged(value: Any) -> Any:
    return value

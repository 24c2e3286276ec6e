"""The ``sglang`` engine: SGLang's offline engine (``sglang.Engine``, token-id prompts).

Runs inside the engine worker process (never in the CLI's own process), usually from its own
venv (``--engine-python``): SGLang and vLLM pin conflicting versions. Every setting maps to the
``ServerArgs`` field its declaration names (``engines/sglang_args.py``); after start-up the
configuration SGLang actually resolved is read back (``get_server_info()``) and compared with what
was asked for, so a setting the installed build overrides is an error rather than a silent no-op.
What it can do beyond sampling (prefill, weight sync, its default log-probs) is :data:`CAPABILITIES`.

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
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mismatch_probe.config.spec import EngineSpec, SamplingSpec, SyncSpec, default_logprobs_mode
from mismatch_probe.engines.api_uses import version_warning
from mismatch_probe.engines.base import (
    Completion,
    EngineCapabilities,
    GenerationRequest,
    ScoreRequest,
    SelfFlush,
    SyncSupport,
    batch_seed,
    check_sync,
)
from mismatch_probe.engines.cpu_threads import cpu_thread_binding
from mismatch_probe.engines.routed_experts import (
    MoeLayout,
    checkpoint_config,
    decode_sglang_int32_b64,
    moe_layout,
)
from mismatch_probe.engines.sglang_args import (
    ENV_RECORDED,
    RECORDED,
    check_cpu_quantization,
    check_spec,
    layout_phrase,
    local_world_size,
    server_args,
    world_size,
)
from mismatch_probe.engines.sglang_logprobs import PrefillLogprobs, finish_reason, sampled_logprobs
from mismatch_probe.errors import ConfigError, EngineError
from mismatch_probe.modeling.logprobs import LogprobSemantics

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


# ---- what SGLang can do (ARCHITECTURE.md, Engine contract; Weight sync) ------------------------------
# Where SGLang flushes its radix cache by itself, in the installed sources (sglang/...); recorded with each sync
DISK_FLUSH_BY = (
    "srt/managers/scheduler_components/weight_updater.py: SchedulerWeightUpdaterManager.update_weights_from_disk "
    "-> flush_cache_after_weight_update (UpdateWeightFromDiskReqInput.flush_cache defaults to True, and "
    "Engine.update_weights_from_disk has no argument for it)"
)
SLEEP_FLUSH_BY = (
    "srt/managers/scheduler_components/weight_updater.py: SchedulerWeightUpdaterManager.release_memory_occupation "
    "(the kv_cache tag: memory_saver_adapter.pause(KV cache), then self.flush_cache())"
)
# the colocate cycle flushes the radix cache in the engine and in a server alike
SLEEP_FLUSH = SelfFlush(
    when="sleep",
    event="when it releases the KV cache's memory",
    by=SLEEP_FLUSH_BY,
    hint="drop --sync-sleep-level, or --no-sync-reset-prefix-cache",
)
CPU_SLEEP_REFUSAL = (
    "SGLang's colocate cycle (Engine.release_memory_occupation / resume_memory_occupation) frees and restores "
    "memory through torch_memory_saver, switched on by enable_memory_saver (srt/utils/torch_memory_saver_adapter.py: "
    "'Backed by the upstream torch_memory_saver package (CUDA VMM, and Intel XPU via Level Zero)'); CPU memory has "
    "no such allocator (with enable_memory_saver on and the package absent SGLang raises at start: "
    "'enable_memory_saver is enabled, but torch-memory-saver is not installed'), and with it off the calls reach "
    "_TorchMemorySaverAdapterNoop, whose pause/resume do nothing, so sync.sleep_level cannot run on CPU"
)
SINGLE_REPLICA = (
    "SGLang updates weights from tensors only with one data-parallel replica "
    "(srt/managers/tokenizer_control_mixin.py: update_weights_from_tensor asserts dp_size == 1: "
    "'data-parallel replicas are not supported for update weights from tensor')"
)
NCCL_PATH = (
    "update_weights_from_distributed over the process group init_weights_update_group opens, with backend 'nccl' "
    "by default: srt/entrypoints/engine.py: Engine.init_weights_update_group(..., backend='nccl')"
)
# SGLang's log-probs when engine.logprobs_mode is unset: log_softmax(logits / T), top-k/top-p not applied
LOGPROBS = {"logprobs_mode": default_logprobs_mode("sglang"), "processed_by": "temperature"}

CAPABILITIES = EngineCapabilities(
    prefill=True,
    weight_digest=True,
    **LOGPROBS,
    sync=SyncSupport(
        transfers=("tensor", "disk"),
        nccl=NCCL_PATH,
        sleep_cpu_refusal=CPU_SLEEP_REFUSAL,
        cache="radix cache",
        flushes=(
            SelfFlush(
                when="disk",
                event="after update_weights_from_disk",
                by=DISK_FLUSH_BY,
                hint="use --sync-transfer tensor (update_weights_from_tensor(flush_cache=False)) to keep the cache, "
                "or drop --no-sync-reset-prefix-cache",
            ),
            SLEEP_FLUSH,
        ),
        single_replica=SINGLE_REPLICA,
        # the probe's digest of the weights and its faults go through update_weights_from_tensor too
        single_replica_transfers=("tensor", "disk"),
    ),
)
# What an SGLang server (python -m sglang.launch_server) declares, for the remote engine's sglang dialect:
# the same facts over its HTTP routes, where /update_weights_from_disk takes flush_cache in its body
SERVER_CAPABILITIES = EngineCapabilities(
    prefill=True,
    keeps_state=True,
    **LOGPROBS,
    sync=SyncSupport(
        transfers=("tensor", "disk"),
        nccl="/init_weights_update_group + /update_weights_from_distributed",
        nccl_group="the server's",
        sleep_cpu_refusal=CPU_SLEEP_REFUSAL,
        cache="radix cache",
        flushes=(SLEEP_FLUSH,),
        single_replica=SINGLE_REPLICA,
        single_replica_transfers=("tensor",),
    ),
)


class SGLangEngine:
    name = "sglang"
    capabilities = CAPABILITIES

    def __init__(
        self,
        model_path: str | Path,
        spec: EngineSpec,
        *,
        trust_remote_code: bool = False,
        sync: SyncSpec | None = None,
    ):
        import torch

        spec = spec if spec.logprobs_mode else spec.model_copy(update={"logprobs_mode": CAPABILITIES.logprobs_mode})
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
        # a release whose API lacks names the adapter uses: said once here (engine.log) and in run.json
        self.version_warning = version_warning("sglang", self.version)
        if self.version_warning:
            print(f"warning: {self.version_warning}", file=sys.stderr, flush=True)
        if self.device == "cpu":
            check_cpu_quantization(spec, self.model_path, self.version)
        if self.sync is not None:
            check_sync(
                self.sync,
                CAPABILITIES,
                engine=f"SGLang {self.version}",
                on_cpu=self.device == "cpu",
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
        return self.capabilities.semantics(self.spec.logprobs_mode, sampling)

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
            **({"version_warning": self.version_warning} if self.version_warning else {}),
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

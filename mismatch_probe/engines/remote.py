"""The ``remote`` engine: a rollout server that is already running, over HTTP (``engine.url``).

RL setups that sample out of process (slime, ms-swift's external mode, a server of one's own)
talk to a vLLM or SGLang server, and that server, with its own flags, build and GPU, is what
causes the mismatch. This adapter probes it as it runs instead of re-creating it in process.

Three dialects (``engine.api``):

* ``openai``: ``POST /v1/completions`` (``vllm serve``, any OpenAI-compatible server that returns
  token ids and log-probs). The prompt goes out as a list of token ids; the
  sampled ids come back in ``token_ids`` (``return_token_ids``) and as ``token_id:N`` in the
  log-prob entries (``return_tokens_as_token_ids``), which must agree; the log-prob of each sampled
  token is ``token_logprobs``. The prefill re-score asks for ``prompt_logprobs`` over prompt +
  response, each entry looked up by the token's id.
* ``swift``: ms-swift's ``swift rollout`` (``POST /infer/``): chat messages in, as its GRPO
  trainer sends them; the server renders them with its own template and answers with the prompt
  ids it rendered, which are checked against ours (``rollout/multiturn.py: ServerTemplateCheck``: a
  difference is a finding, and the probe scores what the server saw), the sampled ids and their
  processed log-probs. No prefill re-score and no weight sync (its updates travel by NCCL).
* ``sglang``: SGLang's native ``POST /generate`` with ``input_ids``; the answer's
  ``meta_info.output_token_logprobs`` carries ``(logprob, token_id, text)`` per sampled token;
  the prefill re-score uses ``logprob_start_len`` and ``input_token_logprobs``.

Nothing is re-tokenized (a swift server's prompt ids are its own): a server that answers with
text only is refused with the option that turns ids on. The server's settings are read back wherever it exposes them (vLLM: ``/version``,
``/v1/models``, ``/metrics``' ``vllm:cache_config_info``, and ``/server_info`` when started with
``VLLM_SERVER_DEV_MODE=1``; SGLang: ``/server_info`` and ``/model_info``); every setting it
does not expose is recorded as unknown, with what would expose it, never guessed. The served
model must be the checkpoint the reference loads (names, architectures, and the server's
tokenizer on a probe text where it has one), unless ``engine.check_model = false``.

Weight sync (``[sync]``, ARCHITECTURE.md, Weight sync) goes through the server's own HTTP routes,
as an RL trainer that talks to a rollout server does (:func:`check_sync` says what each server
cannot do, before any request). SGLang: ``/update_weights_from_disk`` (a checkpoint the probe
writes to ``work_dir``, which the server must be able to read: same machine or a shared file
system), or ``/update_weights_from_tensor`` between ``/begin_weight_update`` and
``/end_weight_update`` with each bucket as a pickle of CPU tensors whose bytes travel inline
(base64), which SGLang's ``SafeUnpickler`` takes from any process on any machine; then
``/flush_cache``; the colocate cycle is ``/release_memory_occupation`` + ``/resume_memory_occupation``.
``vllm serve`` (its development routes, ``VLLM_SERVER_DEV_MODE=1``): ``/collective_rpc`` with the
worker's ``reload_weights(weights_path=...)`` (disk only: no route of vLLM 0.32 carries the
tensors' bytes), ``/reset_prefix_cache``, ``/sleep`` + ``/wake_up``. After each sync the journal
of answers starts a new epoch, so an answer given before a sync is never reused after it.
"""

from __future__ import annotations

import hashlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from mismatch_probe.config.spec import EngineSpec, SamplingSpec, SyncSpec, default_logprobs_mode
from mismatch_probe.engines.base import (
    Completion,
    EngineCapabilities,
    GenerationRequest,
    ScoreRequest,
    SyncSupport,
    batch_seed,
)
from mismatch_probe.engines.http_client import (
    AUTH_HINT,
    Client,
    Journal,
    RequestFailed,
    _message,
    api_key_from,
    redact_url,
)
from mismatch_probe.engines.routed_experts import MoeLayout
from mismatch_probe.errors import ConfigError, EngineError, ProbeError
from mismatch_probe.modeling.logprobs import LogprobSemantics, engine_semantics

# how long SGLang's /flush_cache may wait for the server to be idle, seconds
# (srt/managers/scheduler_components/flush_wrapper.py: SchedulerFlushWrapper.handle)
FLUSH_WAIT_S = 60.0

# the text whose token ids the server's tokenizer must give as the checkpoint's does
TOKENIZER_PROBE = "mismatch-probe: The quick brown fox jumps over 13 lazy dogs. ünïcödé, 漢字, 🙂\n\tend"
# settings the in-process engines record under these names (the report's engine label reads them)
VLLM_SERVER_INFO = {
    "dtype": ("model_config", "dtype"),
    "logprobs_mode": ("model_config", "logprobs_mode"),
    "max_model_len": ("model_config", "max_model_len"),
    "enforce_eager": ("model_config", "enforce_eager"),
    "quantization": ("model_config", "quantization"),
    "served_model_name": ("model_config", "served_model_name"),
    "model": ("model_config", "model"),
    "tensor_parallel_size": ("parallel_config", "tensor_parallel_size"),
    "pipeline_parallel_size": ("parallel_config", "pipeline_parallel_size"),
    "data_parallel_size": ("parallel_config", "data_parallel_size"),
    "distributed_executor_backend": ("parallel_config", "distributed_executor_backend"),
    "chunked_prefill": ("scheduler_config", "enable_chunked_prefill"),
    "max_num_seqs": ("scheduler_config", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler_config", "max_num_batched_tokens"),
    "async_scheduling": ("scheduler_config", "async_scheduling"),
    "prefix_caching": ("cache_config", "enable_prefix_caching"),
    "kv_cache_dtype": ("cache_config", "cache_dtype"),
    "gpu_memory_utilization": ("cache_config", "gpu_memory_utilization"),
    "kv_cache_memory_bytes": ("cache_config", "kv_cache_memory_bytes"),
    "compilation_mode": ("compilation_config", "mode"),
    "cudagraph_mode": ("compilation_config", "cudagraph_mode"),
    "attention_backend": ("attention_config", "backend"),
    "device": ("device_config", "device"),
    "return_routed_experts": ("aux_output_config", "enable_return_routed_experts"),
}
# what vLLM's /metrics exposes without dev mode (vllm:cache_config_info's labels)
VLLM_CACHE_LABELS = {
    "prefix_caching": "enable_prefix_caching",
    "kv_cache_dtype": "cache_dtype",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes",
    "block_size": "block_size",
}
# of vllm:cache_config_info's labels (one per CacheConfig field), those recorded as the server gives them
CACHE_LABELS_RECORDED = (
    *VLLM_CACHE_LABELS.values(),
    "num_gpu_blocks",
    "kv_cache_size_tokens",
    "sliding_window",
    "prefix_caching_hash_algo",
)
VLLM_ENV_RECORDED = ("VLLM_BATCH_INVARIANT", "VLLM_ATTENTION_BACKEND", "VLLM_USE_V2_MODEL_RUNNER")
# SGLang server_info field -> the name the in-process engines record it under
SGLANG_SERVER_INFO = {
    "dtype": "dtype",
    "tp_size": "tensor_parallel_size",
    "pp_size": "pipeline_parallel_size",
    "dp_size": "data_parallel_size",
    "device": "device",
    "attention_backend": "attention_backend",
    "prefill_attention_backend": "prefill_attention_backend",
    "decode_attention_backend": "decode_attention_backend",
    "sampling_backend": "sampling_backend",
    "disable_cuda_graph": "disable_cuda_graph",
    "enable_torch_compile": "enable_torch_compile",
    "disable_radix_cache": "disable_radix_cache",
    "chunked_prefill_size": "chunked_prefill_size",
    "enable_deterministic_inference": "batch_invariant",
    "rl_on_policy_target": "rl_on_policy_target",
    "enable_fp32_lm_head": "logits_fp32",
    "mem_fraction_static": "gpu_memory_utilization",
    "max_total_tokens": "max_total_tokens",
    "max_running_requests": "max_num_seqs",
    "context_length": "max_model_len",
    "kv_cache_dtype": "kv_cache_dtype",
    "quantization": "quantization",
    "page_size": "page_size",
    "disable_overlap_schedule": "disable_overlap_schedule",
    "random_seed": "random_seed",
    "schedule_policy": "schedule_policy",
    "skip_tokenizer_init": "skip_tokenizer_init",
    "model_path": "model",
    "served_model_name": "served_model_name",
    "enable_return_routed_experts": "return_routed_experts",
}
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def check_spec(spec: EngineSpec) -> None:
    """What a remote engine needs before anything starts (``EngineEntry.check``)."""
    if not spec.url:
        raise ConfigError(
            "engine 'remote' needs the server's address",
            hint="pass --engine-url http://HOST:PORT (engine.url in the spec)",
        )
    parts = urlsplit(spec.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"engine.url {redact_url(spec.url)!r} is not an http(s) address",
            hint="give the server's base address, e.g. http://10.0.0.5:8000 (no /v1 path)",
        )
    if parts.path.rstrip("/").endswith("/v1"):
        raise ConfigError(
            f"engine.url {redact_url(spec.url)!r} ends in /v1",
            hint="give the server's base address without /v1; mismatch-probe adds each endpoint's path",
        )
    if spec.ca_bundle is not None and not Path(spec.ca_bundle).is_file():
        raise ConfigError(
            f"engine.ca_bundle {spec.ca_bundle!r} is not a file",
            hint="give the PEM file of the CA that signed the server's certificate",
        )


# ---- weight sync through the server's routes (ARCHITECTURE.md, Weight sync) -----------------------
# SGLang 0.5 (sglang/srt/...): every route below is in entrypoints/http_server.py
SGLANG_DISK_FLUSH_BY = (
    "sglang/srt/managers/scheduler_components/weight_updater.py: SchedulerWeightUpdaterManager."
    "update_weights_from_disk -> flush_cache_after_weight_update (UpdateWeightFromDiskReqInput.flush_cache, "
    "default true; over HTTP the body sets it: sync.reset_prefix_cache)"
)
SGLANG_SLEEP_FLUSH_BY = (
    "sglang/srt/managers/scheduler_components/weight_updater.py: SchedulerWeightUpdaterManager."
    "release_memory_occupation (the kv_cache tag: memory_saver_adapter.pause(KV cache), then flush_cache())"
)
VLLM_TENSOR_REFUSAL = (
    "vllm serve has no route that takes the tensors' bytes: /update_weights "
    "(vllm/entrypoints/rl/online/api_router.py) drives a weight-transfer engine chosen at the server's start "
    "(--weight-transfer-config: nccl, ipc = CUDA IPC handles, sparse_nccl, nccl_m2n, sharded_rdt, modelexpress), "
    "each moving the bytes outside HTTP, and /collective_rpc (vllm/entrypoints/serve/dev/rpc/api_router.py) "
    "passes JSON arguments to a worker method, whose reload_weights takes tensors only as an in-process iterator"
)
NCCL_REFUSAL = (
    "the nccl transfer needs a trainer process in the server's NCCL group (SGLang: /init_weights_update_group "
    "+ /update_weights_from_distributed; vLLM: /init_weight_transfer_engine + /update_weights with "
    "--weight-transfer-config), which mismatch-probe does not drive"
)
# ms-swift 4.5 / 4.6 (swift/pipelines/infer/rollout.py: SwiftRolloutDeploy, WeightSyncWorkerExtension)
SWIFT_SYNC_REFUSAL = (
    "its weight-update routes (/update_flattened_params/, /update_named_param/) only announce tensors that "
    "then arrive by an NCCL broadcast from a trainer rank in the server's process group (/init_communicator/ "
    "-> PyNcclCommunicator), which mismatch-probe does not drive (and which needs a GPU on both sides)"
)
SWIFT_SYNC_HINT = "probe the sync through vllm serve or an SGLang server started with the same settings"
SWIFT_MULTI_TURN_REFUSAL = (
    "it runs its own multi-turn scheduler (--multi_turn_scheduler / gym), whose environment turns come back as "
    "messages without their token ids (RolloutOutput.messages), so the sequence it sampled cannot be scored"
)
VLLM_DEV_MODE_HINT = "restart vllm serve with VLLM_SERVER_DEV_MODE=1 in its environment (its development routes)"
# what a server answers when it cannot read the checkpoint the probe wrote (a path it does not have
# is then taken for a Hugging Face repo id)
PATH_NOT_READ = re.compile(
    r"no such file|not found|does not exist|repo.?id|name or service not known|huggingface|hf_?hub|offline",
    re.IGNORECASE,
)


def check_sync(sync: SyncSpec, api: str) -> None:
    """What a remote server cannot do of a [sync] table whatever it runs; raises
    :class:`ConfigError` before any request (what depends on the server is checked once it is read)."""
    if api == "swift":
        raise ConfigError(f"[sync] through swift rollout: {SWIFT_SYNC_REFUSAL}", hint=SWIFT_SYNC_HINT)
    server = "vllm serve" if api == "openai" else "an SGLang server"
    if sync.transfer == "nccl":
        raise ConfigError(
            f"sync.transfer = 'nccl' through {server}: {NCCL_REFUSAL}",
            hint="--sync-transfer disk" + (" or tensor" if api == "sglang" else ""),
        )
    if sync.transfer == "tensor" and api == "openai":
        raise ConfigError(
            f"sync.transfer = 'tensor' through vllm serve: {VLLM_TENSOR_REFUSAL}",
            hint="--sync-transfer disk (/collective_rpc reload_weights from a checkpoint the server can read)",
        )
    if api == "sglang" and not sync.reset_prefix_cache and sync.sleep_level:
        raise ConfigError(
            "SGLang flushes its radix cache by itself when it releases the KV cache's memory "
            f"({SGLANG_SLEEP_FLUSH_BY}), so sync.reset_prefix_cache = false cannot be honored with sync.sleep_level",
            hint="drop --sync-sleep-level, or --no-sync-reset-prefix-cache",
        )


class RemoteEngine:
    name = "remote"
    keeps_state = True  # the worker gives it a directory for the journal of answers received
    weight_sync = True  # the worker passes a [sync] table to the constructor (routes: check_sync)
    # what any server may offer (engines/base.py: EngineCapabilities); each instance narrows it to its dialect's
    capabilities = EngineCapabilities(
        keeps_state=True,
        sync=SyncSupport(transfers=("tensor", "disk"), nccl=NCCL_REFUSAL, nccl_group="the server's"),
    )

    def __init__(
        self,
        model_path: str | Path,
        spec: EngineSpec,
        *,
        trust_remote_code: bool = False,
        state_dir: str | Path | None = None,
        sync: SyncSpec | None = None,
    ):
        check_spec(spec)
        self.sync = sync if sync is not None and sync.enabled else None
        if self.sync is not None:
            check_sync(self.sync, spec.api)
        self.sync_epoch = 0  # weight syncs so far: the journal's answers are per epoch
        self.spec = spec
        self.model_path = Path(model_path)
        self.trust_remote_code = trust_remote_code
        self.dialect: _Dialect = (
            OpenAIDialect()
            if spec.api == "openai"
            else SwiftDialect()
            if spec.api == "swift"
            else SGLangDialect(self.model_path)
        )
        # why the server cannot re-score the sampled ids with its prefill (None: it can)
        self.prefill_unavailable = self.dialect.prefill_unavailable
        self.supports_prefill = self.prefill_unavailable is None
        self.capabilities = EngineCapabilities(
            prefill=self.supports_prefill,
            prefill_unavailable=self.prefill_unavailable,
            keeps_state=True,
            logprobs_mode=default_logprobs_mode("remote", spec.api),
            sync=type(self).capabilities.sync if spec.api != "swift" else None,
            sync_unavailable=SWIFT_SYNC_REFUSAL if spec.api == "swift" else None,
        )
        self.client = Client(
            url=spec.url,
            api_key=api_key_from(spec.api_key_env),
            timeout_s=spec.request_timeout_s,
            max_concurrency=spec.max_concurrency,
            max_retries=spec.max_retries,
            backoff_s=spec.retry_backoff_s,
            verify=spec.ca_bundle if spec.ca_bundle else spec.tls_verify,
            log=lambda msg: print(f"[remote] {msg}", file=sys.stderr, flush=True),
        )
        self.journal = Journal(state_dir)
        if len(self.journal):
            self.client.log(f"{len(self.journal)} answers received before are reused ({self.journal.path})")
        self.server = self.dialect.read_server(self.client, spec.served_model)
        self.served_model = self.server.model
        self.model_check = check_served_model(self, spec.check_model)
        self.logprobs_source = self._check_declared()
        self.seeds_off_because = None
        if self.server.software == "vllm" and self.server.settings.get("device") == "cpu":
            # as in process (engines/vllm.py): a seeded request split by chunked prefill kills the engine
            self.seeds_off_because = (
                "the server is vLLM's CPU build, whose runner cannot rewind a seeded generator after a "
                "chunked-prefill discard ('CPU Generator does not use offset'); sampling uses the server's seed"
            )
        # what the server offers for the sync, read (GET only) before anything is changed
        self.sync_server = self.dialect.sync_check(self.client, self.server, self.sync) if self.sync else {}
        self.routing_unavailable = self._routing(spec) if spec.record_routing else None

    def _routing(self, spec: EngineSpec) -> str | None:
        """Ask the server for the routed experts of an MoE checkpoint when it returns them (the
        dialect then reads them with every answer); otherwise why not."""
        from mismatch_probe.engines.routed_experts import checkpoint_config, moe_layout

        layout = moe_layout(checkpoint_config(self.model_path, trust_remote_code=self.trust_remote_code))
        if layout is None:
            return None  # a dense model: nothing to record
        why = self.dialect.routing_unavailable(self.server, self.client)
        if why is None:
            self.dialect.routing = layout
        return why

    # ---- settings ------------------------------------------------------------------------
    def _check_declared(self) -> str:
        """The spec's dtype and logprobs_mode say what the server runs with: where the server
        tells, they must agree (the reference would otherwise match the wrong distribution)."""
        settings = self.server.settings
        dtype = _dtype_name(settings.get("dtype"))
        if self.spec.dtype != "auto" and dtype not in (None, "auto") and dtype != self.spec.dtype:
            raise ConfigError(
                f"the server at {self.client.where('')} runs in {dtype}, but engine.dtype says {self.spec.dtype}",
                hint=f"set engine.dtype = {dtype!r} (or auto), or restart the server with the dtype you meant",
            )
        served_mode = settings.get("logprobs_mode")
        if served_mode is None:
            return "declared (engine.logprobs_mode; the server does not say what its log-probs are)"
        mode = {"raw_logprobs": "raw", "processed_logprobs": "processed"}.get(str(served_mode))
        if mode is None:
            raise ConfigError(
                f"the server returns {served_mode} (vLLM --logprobs-mode), which are not log-probabilities",
                hint="restart it with --logprobs-mode raw_logprobs or processed_logprobs",
            )
        if mode != self.spec.logprobs_mode:
            raise ConfigError(
                f"the server returns {served_mode}, but engine.logprobs_mode is {self.spec.logprobs_mode}",
                hint=f"pass --logprobs-mode {mode} (engine.logprobs_mode = {mode!r})",
            )
        return "read from the server"

    # ---- Engine protocol -----------------------------------------------------------------
    def semantics(self, sampling: SamplingSpec) -> LogprobSemantics:
        mode = self.spec.logprobs_mode or "raw"
        if self.spec.api == "sglang":
            if mode == "raw" or sampling.temperature <= 0:
                return LogprobSemantics("raw")
            # SGLang's sampler returns log_softmax(logits / T): top-k/top-p shape the draw only
            return LogprobSemantics("processed", sampling.temperature, 0, 1.0)
        return engine_semantics(mode, sampling.temperature, sampling.top_k, sampling.top_p)

    def info(self) -> dict:
        s = self.server
        return {
            "engine": self.name,
            "api": self.spec.api,
            "url": redact_url(self.spec.url or ""),
            "served_model": self.served_model,
            "platform": s.settings.get("device") or "unknown",
            **{k: v for k, v in s.settings.items() if k not in ("model", "served_model_name")},
            "server": s.raw,
            "unknown": s.unknown,
            "model_check": self.model_check,
            "logprobs_mode": self.spec.logprobs_mode,
            "logprobs_mode_source": self.logprobs_source,
            # SGLang honors a request's sampling_seed only with --enable-deterministic-inference
            "per_request_seeds": self._seeded()
            and (self.spec.api != "sglang" or bool(s.settings.get("batch_invariant"))),
            **({"per_request_seeds_off_because": self.seeds_off_because} if self.seeds_off_because else {}),
            "client": {
                "max_concurrency": self.client.max_concurrency,
                "request_timeout_s": self.client.timeout_s,
                "max_retries": self.client.max_retries,
                "retry_backoff_s": self.client.backoff_s,
                "tls_verify": bool(self.client.verify),
                "ca_bundle": self.spec.ca_bundle,
                "api_key": "from $" + self.spec.api_key_env if self.spec.api_key_env else None,
            },
            "routing": self.dialect.routing.describe() if self.dialect.routing is not None else None,
            **({"routing_unavailable": self.routing_unavailable} if self.routing_unavailable else {}),
            "versions": {s.software: s.version} if s.software and s.version else {},
            "workarounds": self.dialect.workarounds(),
            **({"renders_prompts": self.dialect.renders_prompts} if self.dialect.renders_prompts else {}),
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
        seeds = [batch_seed(seed, i) % (2**31) if self._seeded() else None for i in range(len(requests))]
        bodies = [
            self.dialect.generate_body(self.served_model, r, sampling, stop_token_ids, s)
            for r, s in zip(requests, seeds)
        ]
        completions: list[Completion | None] = [None] * len(requests)

        def parse(i: int, answer: dict) -> None:
            completions[i] = self.dialect.completion(
                answer, requests[i], self._where(f"sampling request {i + 1} of {len(requests)}")
            )
            if on_progress is not None:
                on_progress(1)

        self._post(self.dialect.generate_path, bodies, "sampling request", parse)
        return completions  # type: ignore[return-value]

    def prefill_logprobs(
        self, requests: Sequence[ScoreRequest], on_progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        limit = self.server.max_model_len or 0
        # a sequence the server cannot prefill (as long as its context) stays NaN, as in process
        result = [np.full(len(r.token_ids) - r.start, np.nan, np.float32) for r in requests]
        todo = [i for i, r in enumerate(requests) if not limit or len(r.token_ids) < limit]
        if on_progress is not None and len(todo) < len(requests):
            on_progress(len(requests) - len(todo))
        bodies = [self.dialect.prefill_body(self.served_model, requests[i]) for i in todo]

        def parse(k: int, answer: dict) -> None:
            i = todo[k]
            result[i] = self.dialect.prefill(
                answer, requests[i], self._where(f"prefill request {i + 1} of {len(requests)}")
            )
            if on_progress is not None:
                on_progress(1)

        self._post(self.dialect.generate_path, bodies, "prefill request", parse)
        return result

    def close(self) -> None:
        self.journal.close()

    # ---- weight sync (ARCHITECTURE.md, Weight sync) ---------------------------------------
    def sync_weights(self, weights_dir: str, work_dir: str, fault: str | None = None) -> dict:
        """Push the checkpoint in ``weights_dir`` into the running server through its own HTTP
        routes, as an RL trainer that drives a rollout server does after an optimizer step: the
        colocate cycle when set, then the weights (disk: a checkpoint written to ``work_dir``, which
        the server reads; tensor: buckets over HTTP, SGLang only), then the prefix cache's reset
        when set. The server's answers are in ``engine_report``. No ``weight_digest``: a server's
        parameters cannot be read from outside it."""
        from mismatch_probe.engines import weight_sync as ws

        sync = self._sync_table()
        if fault == "untie_lm_head":
            raise ConfigError(
                "the untie_lm_head fault acts inside the engine (the probe's own loader unties the LM head), "
                "which a remote server does not run",
                hint="test it with the in-process engines; through a server: "
                + ", ".join(f for f in ws.FAULTS if f != "untie_lm_head"),
            )
        # from here on the server's weights are not those the journal's answers were given with
        self.sync_epoch += 1
        report: dict = {"transfer": sync.transfer, "dtype_sent": sync.dtype, "fault": fault}
        t0 = time.perf_counter()
        if sync.sleep_level:
            report["sleep"] = self.dialect.sleep_cycle(self, sync.sleep_level)
        named = ws.trainer_tensors(weights_dir, sync.dtype, fault)
        if sync.transfer == "disk":
            written = ws.write_checkpoint(named, work_dir, weights_dir)
            try:
                pushed = self.dialect.load_from_disk(self, str(work_dir), sync)
            except _RouteFailed as exc:
                raise self._unread_path(exc, str(work_dir)) from None
            report.update(buckets=1, **written, **pushed)
        else:  # tensor (SGLang; check_sync refused the rest)
            report.update(self.dialect.load_tensors(self, named, sync, self.sync_server))
        if "reset_prefix_cache" not in report:  # not done by the server itself
            report["reset_prefix_cache"] = self.reset_prefix_cache() if sync.reset_prefix_cache else None
        report["seconds"] = round(time.perf_counter() - t0, 3)
        return report

    def reset_prefix_cache(self) -> dict:
        """The server's prefix cache reset through its route (SGLang ``/flush_cache``, vLLM
        ``/reset_prefix_cache``); its answer."""
        return self.dialect.reset_prefix_cache(self)

    def _sync_table(self) -> SyncSpec:
        if self.sync is None:
            raise ConfigError("this engine was started without a [sync] table", hint="set sync.start_from")
        return self.sync

    def _sync_call(self, path: str, body: dict | None, what: str, *, params: dict | None = None):
        """POST once and return the answer; a refusal is :class:`_RouteFailed`."""
        ok, answer = self._sync_try(path, body, what, params=params)
        if not ok:
            raise _RouteFailed(
                f"{what}: the server at {self.client.where(path)} refused it: {self.client.redact(_message(answer))}",
                status=answer.get("status", 0) if isinstance(answer, dict) else 0,
            )
        return answer

    def _sync_try(self, path: str, body: dict | None, what: str, *, params: dict | None = None) -> tuple[bool, object]:
        """POST once (an update is not retried: a timed-out one may still be running): ``(accepted,
        answer)``, refused on an HTTP error or ``"success": false``; a missing route is a
        :class:`ConfigError` that says how to get it."""
        status, answer = self.client.post(path, body, params=params, attempts=1)
        if status == 404:
            raise ConfigError(
                f"{self.client.where(path)} answered HTTP 404 to {what}: the server has no such route",
                hint=self.dialect.routes_hint,
            )
        refused = status >= 400 or (isinstance(answer, dict) and answer.get("success") is False)
        if refused and not isinstance(answer, dict):
            answer = {"message": answer}
        if refused:
            answer = {**answer, "status": status}  # type: ignore[dict-item]
        return not refused, answer

    def _unread_path(self, exc: _RouteFailed, work_dir: str) -> ProbeError:
        """A refused disk update, named for what it most often is: a path the server cannot read."""
        import socket

        where = f"{work_dir} (written on {socket.gethostname()})"
        if PATH_NOT_READ.search(exc.message):
            return ConfigError(
                f"the server cannot read the checkpoint the probe wrote at {where}; {exc.message}",
                hint="the server must reach that path: run the probe on the server's machine, or put the run "
                "directory on a file system the server mounts at the same path (or use --sync-transfer tensor "
                "with SGLang, whose bytes travel over HTTP)",
            )
        return EngineError(f"{exc.message} (the checkpoint it was given: {where})", hint="see the server's log")

    # ---- plumbing ------------------------------------------------------------------------
    def _seeded(self) -> bool:
        return self.spec.seed_requests and self.seeds_off_because is None

    def _where(self, what: str) -> str:
        return f"{what} to {self.client.where(self.dialect.generate_path)}"

    def _post(self, path: str, bodies: list[dict], what: str, parse: Callable[[int, dict], None]) -> None:
        journal = self.journal if self.sync_epoch == 0 else _EpochJournal(self.journal, self.sync_epoch)
        try:
            self.client.post_all(
                path, bodies, what=lambda i: f"{what} {i + 1} of {len(bodies)}", journal=journal, on_answer=parse
            )
        except RequestFailed as exc:
            kept = f"; the {len(self.journal)} answers received are kept" if self.journal.path else ""
            message = f"the server at {self.client.where(path)}: {exc}{kept}"
            if exc.status in (401, 403):
                raise ConfigError(message, hint=AUTH_HINT) from None
            raise EngineError(
                message,
                hint="re-run the same command once the server is back: it resumes, sending only what is missing",
            ) from None


class _RouteFailed(EngineError):
    """A weight-sync route that answered with a refusal (its message is the server's)."""

    def __init__(self, message: str, *, status: int, hint: str = "see the server's log"):
        super().__init__(message, hint=hint)
        self.status = status


class _EpochJournal:
    """The journal as seen after the ``epoch``-th weight sync: the same request asks again (an
    answer given with other weights is not an answer now), and a re-run that syncs the same way
    finds the answers of each epoch again."""

    def __init__(self, journal: Journal, epoch: int):
        self.journal = journal
        self.epoch = epoch

    def _key(self, key: str) -> str:
        return hashlib.sha256(f"sync-epoch-{self.epoch}:{key}".encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        return self.journal.get(self._key(key))

    def put(self, key: str, answer: dict) -> None:
        self.journal.put(self._key(key), answer)


class ServerInfo:
    """What the server says about itself, in the in-process engines' names where they have one."""

    def __init__(self, *, model: str, names: set[str], software: str | None, version: str | None):
        self.model = model  # the name requests carry
        self.names = names  # every name and path the server gives the model
        self.software = software  # "vllm", "sglang", or None (another OpenAI-compatible server)
        self.version = version
        self.settings: dict = {}  # in the in-process engines' names
        self.raw: dict = {}  # as the server names them, by endpoint
        self.unknown: dict[str, str] = {}  # setting -> what would expose it
        self.architectures: list[str] | None = None
        self.tokenizer_probe: list[int] | None = None  # the server's ids of TOKENIZER_PROBE
        self.max_model_len: int | None = None


class _Dialect:
    generate_path: str
    # the server takes chat messages and renders them itself (what to call it in messages); None: token ids
    renders_prompts: str | None = None
    prefill_unavailable: str | None = None  # why it cannot re-score given ids; None: it can
    routing: MoeLayout | None = None  # set when the server returns the routed experts of each answer

    def routing_unavailable(self, server: ServerInfo, client: Client) -> str | None:
        """Why this server's answers cannot carry routed experts (None: they can; ask for them)."""
        returns = server.settings.get("return_routed_experts")
        if returns:
            return None
        if returns is None:
            return (
                f"the server at {client.where('')} does not say whether it returns routed experts "
                f"({self.routing_settings_hint})"
            )
        return f"the server at {client.where('')} runs without --enable-return-routed-experts (restart it with it)"

    routing_settings_hint = ""

    def read_server(self, client: Client, served_model: str | None) -> ServerInfo:
        raise NotImplementedError

    def generate_body(
        self, model: str, r: GenerationRequest, sampling: SamplingSpec, stops: Sequence[int], seed: int | None
    ) -> dict:
        raise NotImplementedError

    def completion(self, answer: dict, request: GenerationRequest, where: str) -> Completion:
        raise NotImplementedError

    def prefill_body(self, model: str, r: ScoreRequest) -> dict:
        raise NotImplementedError

    def prefill(self, answer: dict, request: ScoreRequest, where: str) -> np.ndarray:
        raise NotImplementedError

    def workarounds(self) -> dict:
        """run.json's ``engine.workarounds``: an engine bug this dialect works around, and how often."""
        return {}

    # ---- weight sync: the server's routes ---------------------------------------------------
    routes_hint = ""  # how to get the weight-sync routes on a server that lacks them

    def sync_check(self, client: Client, server: ServerInfo, sync: SyncSpec) -> dict:
        """What this server cannot do of ``sync`` (read with GETs only); what the sync needs of it."""
        raise NotImplementedError

    def sleep_cycle(self, engine: RemoteEngine, level: int) -> dict:
        raise NotImplementedError

    def load_from_disk(self, engine: RemoteEngine, work_dir: str, sync: SyncSpec) -> dict:
        raise NotImplementedError

    def load_tensors(self, engine: RemoteEngine, named, sync: SyncSpec, server: dict) -> dict:
        raise NotImplementedError

    def reset_prefix_cache(self, engine: RemoteEngine) -> dict:
        raise NotImplementedError


class OpenAIDialect(_Dialect):
    """``/v1/completions`` with vLLM's token-id extensions."""

    generate_path = "/v1/completions"
    routes_hint = VLLM_DEV_MODE_HINT
    routing_settings_hint = (
        "vllm serve tells only at /server_info, with VLLM_SERVER_DEV_MODE=1; restart it so, with "
        "--enable-return-routed-experts"
    )

    def sync_check(self, client: Client, server: ServerInfo, sync: SyncSpec) -> dict:
        if server.software != "vllm":
            raise ConfigError(
                f"the server at {client.where('')} is not vLLM (it has no /version), and mismatch-probe knows the "
                "weight-update routes of vllm serve and SGLang only",
                hint="sync through vllm serve (VLLM_SERVER_DEV_MODE=1) or an SGLang server (--engine-api sglang)",
            )
        # a development route that changes nothing: present exactly when the others are
        status = client.get("/is_sleeping")[0]
        if status != 200:
            raise ConfigError(
                f"vllm serve at {client.where('')} has no development routes (GET /is_sleeping: HTTP {status}), and a "
                "[sync] probe updates its weights through them (/collective_rpc reload_weights, /reset_prefix_cache)",
                hint=VLLM_DEV_MODE_HINT,
            )
        if sync.sleep_level:
            if server.settings.get("device") == "cpu":
                raise ConfigError(
                    "the server is vLLM's CPU build, whose worker has no sleep mode (vllm/v1/worker/cpu_worker.py: "
                    "CPUWorker.sleep logs 'sleep mode is not supported on CPU, ignore it.'), so the colocate cycle "
                    "(sync.sleep_level) cannot run there",
                    hint="drop --sync-sleep-level with a CPU server",
                )
            status, info = client.get("/server_info", params={"config_format": "json"})
            config = info.get("vllm_config") if status == 200 and isinstance(info, dict) else None
            model_config = (config.get("model_config") or {}) if isinstance(config, dict) else {}
            if not model_config.get("enable_sleep_mode"):
                raise ConfigError(
                    f"vllm serve at {client.where('')} runs without sleep mode, so /sleep cannot free its memory "
                    "(sync.sleep_level)",
                    hint="restart it with --enable-sleep-mode, or drop --sync-sleep-level",
                )
        return {"routes": "vLLM development routes (VLLM_SERVER_DEV_MODE=1)"}

    def sleep_cycle(self, engine: RemoteEngine, level: int) -> dict:
        slept = engine._sync_call("/sleep", None, "the sleep call (/sleep)", params={"level": level})
        woke = engine._sync_call("/wake_up", None, "the wake-up call (/wake_up)")
        return {
            "level": level,
            "calls": "POST /sleep?level=N, POST /wake_up (vllm/entrypoints/serve/dev/sleep/api_router.py)",
            "answers": [slept, woke],
        }

    def load_from_disk(self, engine: RemoteEngine, work_dir: str, sync: SyncSpec) -> dict:
        body = {"method": "reload_weights", "kwargs": {"weights_path": work_dir, "is_checkpoint_format": True}}
        answer = engine._sync_call("/collective_rpc", body, "the weight reload (/collective_rpc reload_weights)")
        return {
            "call": "POST /collective_rpc {method: reload_weights, kwargs: {weights_path, is_checkpoint_format: "
            "true}} (vllm/entrypoints/serve/dev/rpc/api_router.py: collective_rpc -> Worker.reload_weights, "
            "vLLM's in-place reload)",
            "engine_report": {
                "reloaded_from": "disk",
                "results": answer.get("results") if isinstance(answer, dict) else answer,
            },
        }

    def reset_prefix_cache(self, engine: RemoteEngine) -> dict:
        ok, answer = engine._sync_try("/reset_prefix_cache", None, "the prefix cache reset (/reset_prefix_cache)")
        return {
            "call": "POST /reset_prefix_cache (vllm/entrypoints/serve/dev/cache/api_router.py)",
            "result": bool(ok and isinstance(answer, dict) and answer.get("success")),
            **({} if ok else {"message": _message(answer)}),
        }

    def read_server(self, client: Client, served_model: str | None) -> ServerInfo:
        status, models = client.get("/v1/models")
        if status != 200 or not isinstance(models, dict) or not isinstance(models.get("data"), list):
            if status == 404 and client.get("/get_world_size/")[0] == 200:
                # both ms-swift's `swift rollout` and TRL's `trl vllm-serve` answer /get_world_size/;
                # only ms-swift's has POST /get_engine_type/ (swift/pipelines/infer/rollout.py)
                if client.post("/get_engine_type/", None)[0] == 200:
                    raise ConfigError(
                        f"{client.where('')} is ms-swift's `swift rollout` server: it takes chat messages (it "
                        "applies the chat template itself), not the OpenAI API",
                        hint="pass --engine-api swift",
                    )
                raise ConfigError(
                    f"{client.where('')} answers /get_world_size/ but has no /v1/models: TRL's `trl vllm-serve` "
                    "(its own /generate/ route, not the OpenAI API), which mismatch-probe has no dialect for yet",
                    hint="probe its engine as `vllm serve` started with the flags you give trl vllm-serve "
                    "(docs/frameworks/trl.md), or sample in process with --engine vllm",
                )
            raise ConfigError(
                f"{client.where('/v1/models')} answered HTTP {status}: not an OpenAI-compatible server",
                hint="check --engine-url; for SGLang's native API pass --engine-api sglang",
            )
        cards = {c.get("id"): c for c in models["data"] if isinstance(c, dict)}
        model = _choose_model(cards, served_model, client)
        card = cards[model]
        status, version = client.get("/version")
        is_vllm = status == 200 and isinstance(version, dict) and "version" in version
        info = ServerInfo(
            model=model,
            names={n for n in (model, card.get("root")) if n},
            software="vllm" if is_vllm else None,
            version=version.get("version") if is_vllm else None,
        )
        info.raw["model_card"] = {k: card.get(k) for k in ("id", "root", "parent", "owned_by", "max_model_len")}
        info.max_model_len = card.get("max_model_len")
        info.settings["max_model_len"] = info.max_model_len
        if is_vllm:
            self._vllm_settings(client, info)
        else:
            info.unknown["everything"] = "the server has no /version: not vLLM, so only its model card is read"
        status, tokens = client.post(
            "/tokenize", {"model": model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False}
        )
        if status == 200 and isinstance(tokens, dict) and isinstance(tokens.get("tokens"), list):
            info.tokenizer_probe = [int(t) for t in tokens["tokens"]]
        else:
            info.unknown["tokenizer"] = "the server has no working /tokenize (started with --skip-tokenizer-init?)"
        return info

    def _vllm_settings(self, client: Client, info: ServerInfo) -> None:
        status, server_info = client.get("/server_info", params={"config_format": "json"})
        config = server_info.get("vllm_config") if status == 200 and isinstance(server_info, dict) else None
        if isinstance(config, dict):
            for name, (section, key) in VLLM_SERVER_INFO.items():
                value = (config.get(section) or {}).get(key)
                if value is not None:
                    info.settings[name] = value
            info.settings["dtype"] = _dtype_name(info.settings.get("dtype"))
            env = server_info.get("vllm_env") or {}
            info.settings["batch_invariant"] = bool(env.get("VLLM_BATCH_INVARIANT", False))
            info.raw["vllm_env"] = {k: env[k] for k in VLLM_ENV_RECORDED if k in env}
            hf = (config.get("model_config") or {}).get("hf_config") or {}
            if isinstance(hf, dict) and hf.get("architectures"):
                info.architectures = list(hf["architectures"])
            for name in ("model", "served_model_name"):
                value = info.settings.get(name)
                info.names.update(value if isinstance(value, list) else [value] if value else [])
        else:
            why = "vLLM exposes it at /server_info only when started with VLLM_SERVER_DEV_MODE=1"
            for name in VLLM_SERVER_INFO:
                if name not in VLLM_CACHE_LABELS and name not in ("max_model_len", "model", "served_model_name"):
                    info.unknown[name] = why
            info.unknown["batch_invariant"] = why
        status, metrics = client.get("/metrics")
        labels = _prometheus_labels(metrics, "vllm:cache_config_info") if status == 200 else None
        if labels:
            info.raw["cache_config_info"] = {k: labels[k] for k in CACHE_LABELS_RECORDED if k in labels}
            for name, label in VLLM_CACHE_LABELS.items():
                if label in labels and name not in info.settings:
                    info.settings[name] = _label_value(labels[label])
        else:
            for name in VLLM_CACHE_LABELS:
                if name not in info.settings:
                    info.unknown[name] = (
                        "vLLM's /metrics has no vllm:cache_config_info (started with --disable-log-stats?)"
                    )

    def generate_body(self, model, r, sampling, stops, seed) -> dict:
        body = {
            "model": model,
            "prompt": [int(t) for t in r.prompt_token_ids],
            "max_tokens": int(r.max_tokens),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "logprobs": 0,  # the sampled token's own log-prob
            "stop_token_ids": [int(t) for t in stops],
            "skip_special_tokens": False,
            "add_special_tokens": False,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "n": 1,
            "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        if self.routing is not None:  # from the last prompt position: the input behind the first sampled token
            body["routed_experts_prompt_start"] = len(r.prompt_token_ids) - 1
        return body

    def completion(self, answer: dict, request: GenerationRequest, where: str) -> Completion:
        completion = self._completion(answer, request, where)
        if self.routing is not None:
            from mismatch_probe.engines.routed_experts import decode_vllm_npy_b64

            raw = _first_choice(answer, where).get("routed_experts")
            completion.experts = _routed_rows(self.routing, raw, decode_vllm_npy_b64, request, completion, where)
        return completion

    def _completion(self, answer: dict, request: GenerationRequest, where: str) -> Completion:
        choice = _first_choice(answer, where)
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("token_logprobs"), list):
            raise ConfigError(
                f"{where}: the answer has no log-probs (logprobs=0 was asked for)",
                hint="the server must return log-probs: vLLM does unless started with --max-logprobs 0",
            )
        ids_from_entries = [_token_id(t) for t in logprobs.get("tokens") or []]
        ids = choice.get("token_ids")
        if ids is None:
            if any(t is None for t in ids_from_entries):
                raise ConfigError(
                    f"{where}: the server returns sampled tokens as text, not ids; mismatch-probe never "
                    "re-tokenizes text (the ids would not be the ones sampled)",
                    hint="use a vLLM that honors return_token_ids (0.10.2 or later) or return_tokens_as_token_ids "
                    "(start it with --return-tokens-as-token-ids); other servers: use one that returns token ids",
                )
            ids = ids_from_entries
        tokens = np.asarray(ids, dtype=np.int32)
        values = logprobs["token_logprobs"]
        if len(values) != len(tokens):
            raise EngineError(f"{where}: {len(tokens)} sampled tokens but {len(values)} log-probs")
        # the entries name their tokens as ids only with return_tokens_as_token_ids; then they must agree
        if ids_from_entries and None not in ids_from_entries and ids_from_entries != [int(t) for t in tokens]:
            k = next(j for j, (a, b) in enumerate(zip(ids_from_entries, tokens)) if a != b)
            raise EngineError(f"{where}: log-prob entry {k} is for token {ids_from_entries[k]}, not {int(tokens[k])}")
        if any(v is None for v in values):
            raise EngineError(f"{where}: the server returned no log-prob for a sampled token")
        prompt = choice.get("prompt_token_ids")
        return Completion(
            token_ids=tokens,
            logprobs=np.asarray(values, dtype=np.float64).astype(np.float32),
            finish_reason=_finish(choice.get("finish_reason"), where),
            prompt_token_ids=np.asarray(prompt, dtype=np.int32) if prompt is not None else None,
        )

    def prefill_body(self, model, r) -> dict:
        return {
            "model": model,
            "prompt": [int(t) for t in r.token_ids],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,  # the given token's own log-prob at each position, from the raw logits
            "add_special_tokens": False,
            "return_tokens_as_token_ids": True,
            "n": 1,
            "stream": False,
        }

    def prefill(self, answer: dict, request: ScoreRequest, where: str) -> np.ndarray:
        entries = _first_choice(answer, where).get("prompt_logprobs")
        ids = request.token_ids
        if not isinstance(entries, list) or len(entries) != len(ids):
            got = "none" if not isinstance(entries, list) else len(entries)
            raise EngineError(
                f"{where}: {got} prompt log-prob entries for {len(ids)} tokens",
                hint="the server must honor prompt_logprobs (vLLM does); or turn the re-score off with "
                "--no-prefill-check",
            )
        out = np.empty(len(ids) - request.start, np.float64)
        for k, p in enumerate(range(request.start, len(ids))):
            entry = entries[p] or {}
            hit = entry.get(str(int(ids[p])))
            if hit is None:
                raise EngineError(f"{where}: no prompt log-prob for token {int(ids[p])} at position {p}")
            out[k] = hit["logprob"] if isinstance(hit, dict) else hit
        return out.astype(np.float32)


class SGLangDialect(_Dialect):
    """SGLang's native ``/generate`` (token ids in and out)."""

    generate_path = "/generate"
    routing_settings_hint = "its /server_info is not there (a router?): point --engine-url at one SGLang worker"
    routes_hint = (
        "every SGLang server (python -m sglang.launch_server) has the weight-update routes; a router in front of "
        "workers may not: point --engine-url at one worker"
    )

    def __init__(self, model_path: Path) -> None:
        from mismatch_probe.engines.sglang import PrefillLogprobs

        # of the checkpoint the server must serve (check_served_model)
        self.prefill_reader = PrefillLogprobs(model_path)

    def workarounds(self) -> dict:
        return self.prefill_reader.workarounds()

    def sync_check(self, client: Client, server: ServerInfo, sync: SyncSpec) -> dict:
        info = _first_found(client, ("/server_info", "/get_server_info"))
        if not info:
            raise ConfigError(
                f"{client.where('')} has no /server_info (a router?), so its parallel layout, which a weight "
                "update must match, is unknown",
                hint="point --engine-url at one SGLang worker to sync its weights",
            )
        tp, dp = int(info.get("tp_size") or 1), int(info.get("dp_size") or 1)
        if sync.transfer == "tensor" and dp > 1:
            raise ConfigError(
                "SGLang updates weights from tensors only with one data-parallel replica "
                "(srt/managers/tokenizer_control_mixin.py: update_weights_from_tensor asserts dp_size == 1: "
                f"'data-parallel replicas are not supported for update weights from tensor'); the server has dp_size {dp}",
                hint="--sync-transfer disk (update_weights_from_disk reaches every replica)",
            )
        if sync.sleep_level:
            if info.get("device") == "cpu":
                raise ConfigError(
                    "the server is SGLang on CPU: its colocate cycle (/release_memory_occupation, "
                    "/resume_memory_occupation) frees and restores memory through torch_memory_saver "
                    "(srt/utils/torch_memory_saver_adapter.py: CUDA VMM and Intel XPU), which CPU memory has no "
                    "allocator for, so sync.sleep_level cannot run there",
                    hint="drop --sync-sleep-level with a CPU server",
                )
            if not info.get("enable_memory_saver"):
                raise ConfigError(
                    f"the SGLang server at {client.where('')} runs without its memory saver, so "
                    "/release_memory_occupation frees nothing (sync.sleep_level)",
                    hint="restart it with --enable-memory-saver, or drop --sync-sleep-level",
                )
            backup = bool(info.get("enable_weights_cpu_backup"))
            if backup != (sync.sleep_level == 1):
                raise ConfigError(
                    f"sync.sleep_level = {sync.sleep_level} {'keeps' if sync.sleep_level == 1 else 'discards'} the "
                    f"weights over the cycle (vLLM's levels), but the SGLang server runs "
                    f"{'with' if backup else 'without'} --enable-weights-cpu-backup, so it "
                    f"{'keeps' if backup else 'discards'} them",
                    hint=f"--sync-sleep-level {1 if backup else 2}, or restart the server "
                    f"{'without' if backup else 'with'} --enable-weights-cpu-backup",
                )
        return {"tp_size": tp, "dp_size": dp}

    def sleep_cycle(self, engine: RemoteEngine, level: int) -> dict:
        engine._sync_call("/release_memory_occupation", {}, "the memory release (/release_memory_occupation)")
        engine._sync_call("/resume_memory_occupation", {}, "the memory resumption (/resume_memory_occupation)")
        return {
            "level": level,
            "calls": "POST /release_memory_occupation, POST /resume_memory_occupation (all tags)",
            "weights_cpu_backup": level == 1,
            "engine_flushes_itself": True,
            "by": SGLANG_SLEEP_FLUSH_BY,
        }

    def load_from_disk(self, engine: RemoteEngine, work_dir: str, sync: SyncSpec) -> dict:
        body = {"model_path": work_dir, "flush_cache": bool(sync.reset_prefix_cache)}
        answer = engine._sync_call("/update_weights_from_disk", body, "the weight update (/update_weights_from_disk)")
        # SGLang now names the served model by the path it loaded (TokenizerManager._update_model_path_info)
        status, model_info = engine.client.get("/model_info")
        after = {k: model_info.get(k) for k in ("model_path", "weight_version")} if status == 200 else None
        out = {
            "call": "POST /update_weights_from_disk {model_path, flush_cache} (srt/entrypoints/http_server.py: "
            "update_weights_from_disk, SGLang's in-place reload)",
            "engine_report": {**answer, "model_info_after": after} if isinstance(answer, dict) else answer,
        }
        if sync.reset_prefix_cache:
            out["reset_prefix_cache"] = {
                "call": "POST /update_weights_from_disk (flush_cache = true)",
                "engine_flushes_itself": True,
                "by": SGLANG_DISK_FLUSH_BY,
            }
        return out

    def load_tensors(self, engine: RemoteEngine, named, sync: SyncSpec, server: dict) -> dict:
        from mismatch_probe.engines import weight_sync as ws

        session = "the weight-update session"
        begin = engine._sync_try("/begin_weight_update", {}, f"opening {session} (/begin_weight_update)")
        if not begin[0]:
            raise _RouteFailed(
                f"SGLang at {engine.client.where('/begin_weight_update')} did not open {session}: {_message(begin[1])}",
                status=0,
                hint="if a sync was interrupted, its session is still open: POST /end_weight_update to the server "
                "closes it",
            )
        sent = ws.SentBuckets(named, sync.bucket_mb)
        messages: set[str] = set()
        failed: _RouteFailed | None = None
        try:
            for bucket in sent:
                payload = _pickled_bucket(bucket)
                body = {"serialized_named_tensors": [payload] * server["tp_size"], "flush_cache": False}
                answer = engine._sync_call(
                    "/update_weights_from_tensor", body, f"bucket {sent.buckets} (/update_weights_from_tensor)"
                )
                messages.add(str(answer.get("message")) if isinstance(answer, dict) else str(answer))
        except _RouteFailed as exc:
            failed = exc
        end = engine._sync_try("/end_weight_update", {}, f"closing {session} (/end_weight_update)")
        if failed is not None:
            raise failed
        if not end[0]:
            raise _RouteFailed(f"SGLang did not close {session}: {_message(end[1])}", status=0)
        return {
            "call": "POST /update_weights_from_tensor {serialized_named_tensors, flush_cache: false} per bucket, "
            "between POST /begin_weight_update and POST /end_weight_update (srt/entrypoints/http_server.py; "
            "-> model.load_weights); each bucket a pickle of CPU tensors, their bytes inline (base64), one copy "
            "per tensor-parallel rank",
            **sent.counts(),
            "engine_report": {
                "success": True,
                "messages": sorted(messages),
                "begin": _message(begin[1]),
                "end": _message(end[1]),
                "tp_size": server["tp_size"],
            },
        }

    def reset_prefix_cache(self, engine: RemoteEngine) -> dict:
        # with a timeout SGLang flushes once it is idle (a flush while requests run is refused)
        ok, answer = engine._sync_try(
            "/flush_cache", None, "the radix cache flush (/flush_cache)", params={"timeout": FLUSH_WAIT_S}
        )
        return {
            "call": "POST /flush_cache (srt/entrypoints/http_server.py: flush_cache)",
            "result": ok,
            "message": _message(answer),
        }

    def read_server(self, client: Client, served_model: str | None) -> ServerInfo:
        server_info = _first_found(client, ("/server_info", "/get_server_info"))
        model_info = _first_found(client, ("/model_info", "/get_model_info")) or {}
        if server_info is None:
            if client.get("/health")[0] != 200:
                raise ConfigError(
                    f"{client.where('/server_info')} (and /get_server_info, /health) did not answer: "
                    "not an SGLang server",
                    hint="check --engine-url; for vllm serve pass --engine-api openai",
                )
            # a router in front of SGLang workers (slime's, sgl-model-gateway) serves /generate only
            server_info = {}
        names = {n for n in (model_info.get("model_path"), model_info.get("served_model_name")) if n}
        names |= {n for n in (server_info.get("model_path"), server_info.get("served_model_name")) if n}
        model = served_model or model_info.get("served_model_name") or server_info.get("served_model_name") or ""
        info = ServerInfo(model=model, names=names, software="sglang", version=server_info.get("version"))
        for key, name in SGLANG_SERVER_INFO.items():
            if key in server_info:
                info.settings[name] = server_info[key]
        # the in-process engines' names for SGLang's negated switches
        if "disable_cuda_graph" in info.settings:
            info.settings["enforce_eager"] = info.settings["disable_cuda_graph"]
        if "disable_radix_cache" in info.settings:
            info.settings["prefix_caching"] = not info.settings["disable_radix_cache"]
        info.raw["server_info"] = {k: server_info[k] for k in SGLANG_SERVER_INFO if k in server_info}
        info.raw["model_info"] = {
            k: model_info.get(k) for k in ("model_path", "served_model_name", "weight_version", "model_type")
        }
        info.architectures = model_info.get("architectures")
        info.max_model_len = server_info.get("context_length")
        info.unknown["logprobs_mode"] = (
            "SGLang does not expose SGLANG_RETURN_ORIGINAL_LOGPROB (set on the server: raw log-probs; "
            "unset: log_softmax(logits / T)); engine.logprobs_mode must say which"
        )
        info.unknown["tokenizer"] = "SGLang's native API has no tokenizer endpoint; names and architectures are checked"
        if not server_info:
            why = "the server (a router?) has no /server_info: point --engine-url at one SGLang worker to read it"
            info.unknown.update({name: why for name in SGLANG_SERVER_INFO.values() if name not in info.settings})
            info.unknown["version"] = why
        return info

    def generate_body(self, model, r, sampling, stops, seed) -> dict:
        params = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "max_new_tokens": int(r.max_tokens),
            "stop_token_ids": [int(t) for t in stops],
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if seed is not None:
            params["sampling_seed"] = seed  # honored with --enable-deterministic-inference
        body = {"input_ids": [int(t) for t in r.prompt_token_ids], "sampling_params": params, "return_logprob": True}
        if self.routing is not None:  # from the last prompt position: the input behind the first sampled token
            body.update(return_routed_experts=True, routed_experts_start_len=len(r.prompt_token_ids) - 1)
        return body

    def completion(self, answer: dict, request: GenerationRequest, where: str) -> Completion:
        from mismatch_probe.engines.sglang import finish_reason, sampled_logprobs

        if "output_ids" not in answer:
            raise ConfigError(
                f"{where}: the answer has no output_ids",
                hint="is it SGLang's /generate? For vllm serve or swift rollout pass --engine-api openai",
            )
        tokens = np.asarray(answer["output_ids"], dtype=np.int32)
        meta = answer.get("meta_info") or {}
        try:
            completion = Completion(
                token_ids=tokens,
                logprobs=sampled_logprobs(meta.get("output_token_logprobs"), tokens),
                finish_reason=finish_reason(meta, where),
            )
        except RuntimeError as exc:
            raise EngineError(str(exc)) from None
        if (layout := self.routing) is not None:
            from mismatch_probe.engines.routed_experts import decode_sglang_int32_b64

            def decode(raw, what):
                return decode_sglang_int32_b64(raw, layout.num_hidden_layers, layout.top_k, what=what)

            completion.experts = _routed_rows(layout, meta.get("routed_experts"), decode, request, completion, where)
        return completion

    def prefill_body(self, model, r) -> dict:
        return {
            "input_ids": [int(t) for t in r.token_ids],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            # SGLang's first returned position has no log-prob: start one before the first to score
            "logprob_start_len": int(r.start) - 1,
        }

    def prefill(self, answer: dict, request: ScoreRequest, where: str) -> np.ndarray:
        from mismatch_probe.engines.sglang import finish_reason

        meta = answer.get("meta_info") or {}
        try:
            finish_reason(meta, where)
            entries = meta.get("input_token_logprobs")
            return self.prefill_reader.read(entries[1:] if entries else entries, request.token_ids[request.start :])
        except RuntimeError as exc:
            raise EngineError(str(exc)) from None


class SwiftDialect(_Dialect):
    """ms-swift's rollout server (``swift rollout``, its external GRPO mode), as its GRPO trainer
    calls it (ms-swift 4.5 / 4.6: ``swift/rlhf_trainers/vllm_client.py: VLLMClient.infer``,
    ``swift/rlhf_trainers/rollout_mixin.py``): ``POST /infer/`` with ``{infer_requests:
    [RolloutInferRequest], request_config: RequestConfig}``, one ``RolloutOutput`` per request.
    The server renders the chat messages with its own template (``--template_backend``) and
    returns the prompt ids it fed vLLM (``response.prompt_token_ids``, with ``return_details``),
    the sampled ids (``choices[0].token_ids``) and their log-probs (``choices[0].logprobs.content
    [i].logprob``, vLLM's processed log-probs: the server forces ``logprobs_mode=processed_logprobs``).
    What it exposes of itself: ``/health/``, ``/get_world_size/`` (tensor x data parallel) and
    ``POST /get_engine_type/``; every other setting is in its log only."""

    generate_path = "/infer/"
    renders_prompts = "swift rollout"
    prefill_unavailable = (
        "swift rollout takes chat messages and renders them itself, so it cannot be asked to prefill exactly "
        "the sampled token ids (its prompt_logprobs would score its own rendering of the conversation)"
    )
    routes_hint = SWIFT_SYNC_HINT

    def routing_unavailable(self, server: ServerInfo, client: Client) -> str | None:
        return (
            "not read from swift rollout: its answers carry routed experts (choices[i].routed_experts) only when "
            "its vLLM was started with enable_return_routed_experts (--vllm_engine_kwargs), which it does not "
            "expose, and always from the first prompt position"
        )

    def read_server(self, client: Client, served_model: str | None) -> ServerInfo:
        status, world = client.get("/get_world_size/")
        if status != 200 or not isinstance(world, dict) or "world_size" not in world:
            raise ConfigError(
                f"{client.where('/get_world_size/')} answered HTTP {status}: not ms-swift's swift rollout server",
                hint="check --engine-url; for vllm serve pass --engine-api openai, for SGLang --engine-api sglang",
            )
        status, engine_type = client.post("/get_engine_type/", None)
        if status != 200 or not isinstance(engine_type, dict):
            raise ConfigError(
                f"{client.where('/get_engine_type/')} answered HTTP {status}; ms-swift 3.5 or later answers it",
                hint="upgrade ms-swift on the server (pip install -U ms-swift)",
            )
        if engine_type.get("enable_multi_turn") or engine_type.get("use_gym_env"):
            raise ConfigError(
                f"the swift rollout server at {client.where('')}: {SWIFT_MULTI_TURN_REFUSAL}",
                hint="restart swift rollout without --multi_turn_scheduler / --use_gym_env; mismatch-probe then "
                "drives the turns itself, one /infer/ call per turn, as ms-swift's trainer does with such a server",
            )
        info = ServerInfo(model=served_model or "", names=set(), software="ms-swift", version=None)
        info.raw["get_world_size"] = world
        info.raw["get_engine_type"] = engine_type
        info.settings["world_size"] = int(world["world_size"])
        info.settings["engine_type"] = engine_type.get("engine_type")
        info.settings["lora"] = bool(engine_type.get("enable_lora"))
        why = (
            "swift rollout exposes only its world size (tensor x data parallel) and engine type; its arguments "
            "(--vllm_*, --torch_dtype, --template, ...) are printed in its log ('args: ...')"
        )
        for name in (
            "dtype",
            "max_model_len",
            "tensor_parallel_size",
            "data_parallel_size",
            "enforce_eager",
            "prefix_caching",
            "version",
            "template",
        ):
            info.unknown[name] = why
        info.unknown["logprobs_mode"] = (
            "not exposed; ms-swift forces vLLM's processed_logprobs (swift/pipelines/infer/rollout.py: "
            "get_infer_engine, vLLM >= 0.10.2), which engine.logprobs_mode defaults to for swift"
        )
        info.unknown["model"] = (
            "swift rollout names no model before it answers (response.model); its prompt ids are checked"
        )
        return info

    def generate_body(self, model, r, sampling, stops, seed) -> dict:
        if r.messages is None:
            raise ConfigError(
                "swift rollout takes chat messages, but this request has token ids only",
                hint='give the prompts as "messages" in the prompts file',
            )
        # RolloutInferRequest and RequestConfig (swift/infer_engine/protocol.py) as the GRPO trainer
        # fills them (swift/rlhf_trainers/rollout_mixin.py: _prepare_request_config); unset fields
        # take their defaults
        return {
            "infer_requests": [{"messages": r.messages}],
            "request_config": {
                "max_tokens": int(r.max_tokens),
                "temperature": sampling.temperature,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "top_p": sampling.top_p,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "seed": seed,
                "stream": False,
                "logprobs": True,
                "n": 1,
                "return_details": True,  # the sampled ids and the prompt ids the server rendered
            },
        }

    def completion(self, answer, request: GenerationRequest, where: str) -> Completion:
        outputs = answer if isinstance(answer, list) else None
        if not outputs or len(outputs) != 1 or not isinstance(outputs[0], dict):
            raise EngineError(f"{where}: expected a list of one RolloutOutput, got {str(answer)[:200]}")
        output = outputs[0]
        if output.get("response_token_ids") or output.get("rollout_logprobs"):
            raise EngineError(f"{where}: the server ran several turns itself ({SWIFT_MULTI_TURN_REFUSAL})")
        response = output.get("response") if isinstance(output.get("response"), dict) else output
        choice = _first_choice(response, where)
        ids, prompt = choice.get("token_ids"), response.get("prompt_token_ids")
        if ids is None or prompt is None:
            raise ConfigError(
                f"{where}: the answer has no token_ids / prompt_token_ids (request_config.return_details = true "
                "was sent)",
                hint="use ms-swift 3.5 or later on the server, whose rollout answers carry them",
            )
        entries = (choice.get("logprobs") or {}).get("content")
        if not isinstance(entries, list):
            raise EngineError(f"{where}: the answer has no log-probs (request_config.logprobs = true was sent)")
        if len(entries) != len(ids):
            raise EngineError(f"{where}: {len(ids)} sampled tokens but {len(entries)} log-probs")
        values = [e.get("logprob") if isinstance(e, dict) else None for e in entries]
        if any(v is None for v in values):
            raise EngineError(f"{where}: the server returned no log-prob for a sampled token")
        return Completion(
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=np.asarray(values, dtype=np.float64).astype(np.float32),
            finish_reason=_finish(choice.get("finish_reason"), where),
            prompt_token_ids=np.asarray(prompt, dtype=np.int32),
        )

    def prefill_body(self, model, r) -> dict:
        raise ConfigError(self.prefill_unavailable or "", hint="--no-prefill-check")

    def prefill(self, answer, request, where) -> np.ndarray:
        raise ConfigError(self.prefill_unavailable or "", hint="--no-prefill-check")


# settings of a server that change what it samples, as info() records them
SAMPLING_SETTINGS = (
    "dtype",
    "world_size",
    "engine_type",
    "logprobs_mode",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enforce_eager",
    "compilation_mode",
    "cudagraph_mode",
    "chunked_prefill",
    "prefix_caching",
    "kv_cache_dtype",
    "quantization",
    "attention_backend",
    "sampling_backend",
    "batch_invariant",
    "rl_on_policy_target",
    "logits_fp32",
    "device",
)


def server_changes(before: dict, after: dict) -> list[str]:
    """What a remote server runs differently now (``after``, an ``info()``) than when ``before``
    was recorded: its software, version or a setting both records know. Not a remote engine on
    both sides: nothing to compare (an in-process engine is built from the spec, which resumes only
    unchanged)."""
    if before.get("engine") != "remote" or after.get("engine") != "remote":
        return []
    changes = [
        f"{name} {(after.get('versions') or {}).get(name, 'absent')} (was {version})"
        for name, version in (before.get("versions") or {}).items()
        if (after.get("versions") or {}).get(name) != version
    ]
    for key in SAMPLING_SETTINGS:
        if key in before and key in after and before[key] != after[key]:
            changes.append(f"{key}={after[key]!r} (was {before[key]!r})")
    return changes


# ---- the served model -----------------------------------------------------------------------
def check_served_model(engine: RemoteEngine, enforce: bool) -> dict:
    """Is the server's model the checkpoint the reference loads? Compared where both sides say:
    names (the checkpoint directory's, its config's ``_name_or_path``; the server's model ids and
    paths, by their last path component), architectures, and the server's tokenizer on
    :data:`TOKENIZER_PROBE`. A difference is refused unless ``enforce`` is off (then recorded)."""
    from mismatch_probe.modeling.loading import read_config

    server, local = engine.server, engine.model_path
    config = read_config(local)
    ours = {local.resolve().name, _basename(config.get("_name_or_path") or "")} - {""}
    theirs = {_basename(n) for n in server.names} - {""}
    checks: dict = {"checkpoint_names": sorted(ours), "server_names": sorted(theirs)}
    differences = []
    if theirs:
        checks["names"] = bool(ours & theirs)
        if not checks["names"]:
            differences.append(f"it serves {', '.join(sorted(theirs))}")
    if server.architectures and config.get("architectures"):
        checks["architectures"] = list(server.architectures) == list(config["architectures"])
        if not checks["architectures"]:
            differences.append(f"architectures {server.architectures} vs the checkpoint's {config['architectures']}")
    if server.tokenizer_probe is not None:
        from mismatch_probe.modeling.loading import load_tokenizer

        tokenizer = load_tokenizer(local, trust_remote_code=engine.trust_remote_code)
        mine = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        checks["tokenizer"] = list(mine) == server.tokenizer_probe
        if not checks["tokenizer"]:
            differences.append("its tokenizer splits a probe text into other ids")
    checks["matched"] = not differences
    if differences and enforce:
        raise ConfigError(
            f"the server at {engine.client.where('')} does not serve the checkpoint the reference loads "
            f"({local.name}): {'; '.join(differences)}",
            hint="point --model at the checkpoint the server loaded; if it is the same weights under another "
            "name, pass --no-check-model (engine.check_model = false)",
        )
    if differences:
        checks["overridden"] = "engine.check_model = false"
    return checks


def _choose_model(cards: dict, served_model: str | None, client: Client) -> str:
    if served_model is not None:
        if served_model not in cards:
            raise ConfigError(
                f"the server at {client.where('')} does not serve a model named {served_model!r}",
                hint=f"it serves: {', '.join(map(repr, sorted(cards)))} (engine.served_model)",
            )
        return served_model
    if len(cards) != 1:
        raise ConfigError(
            f"the server at {client.where('')} serves {len(cards)} models",
            hint=f"name one with --engine-model ({', '.join(map(repr, sorted(cards))) or 'none listed'})",
        )
    return next(iter(cards))


def _pickled_bucket(bucket) -> str:
    """A bucket of named CPU tensors as SGLang's ``/update_weights_from_tensor`` takes one from
    another process: a plain pickle (each tensor's bytes inside it, through
    ``torch.storage._load_from_bytes``, which SGLang's ``SafeUnpickler`` maps to a
    ``weights_only`` load), base64-encoded. Not ``MultiprocessingSerializer``: it pickles shared
    memory handles, which a server on another machine (or without this process's authkey) cannot open."""
    import base64
    import pickle

    own = []
    for name, tensor in bucket:
        t = tensor.detach().contiguous()
        if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view would carry its whole storage
        own.append((name, t))
    return base64.b64encode(pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def _first_found(client: Client, paths: Sequence[str]) -> dict | None:
    for path in paths:
        status, answer = client.get(path)
        if status == 200 and isinstance(answer, dict):
            return answer
    return None


def _routed_rows(layout: MoeLayout, raw, decode, request: GenerationRequest, completion: Completion, where: str):
    """The routing behind each sampled token from a server's routed experts (asked for from the
    last prompt position), in the probe's rows; a server that returns none is an error: it said it would."""
    if raw is None:
        raise EngineError(f"{where}: the answer has no routed experts, though the server runs with them on")
    what = f"{where}: the server"
    n_prompt = len(request.prompt_token_ids)
    return layout.rows(decode(raw, what=what), n_prompt, n_prompt - 1, len(completion.token_ids), what=what)


def _first_choice(answer: dict, where: str) -> dict:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineError(f"{where}: the answer has no choices: {str(answer)[:200]}")
    return choices[0]


def _token_id(token: str) -> int | None:
    """``token_id:N`` (vLLM's return_tokens_as_token_ids) -> N; text -> None."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit():
        return int(token[9:])
    return None


def _finish(reason, where: str) -> str:
    if reason in ("stop", "length"):
        return reason
    raise EngineError(
        f"{where} ended with finish_reason {reason!r}, not stop or length: the server aborted it",
        hint="see the server's log; a prompt over its context length or a KV cache too small are the usual causes",
    )


def _dtype_name(value) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def _basename(name: str) -> str:
    return str(name).rstrip("/").rsplit("/", 1)[-1]


def _prometheus_labels(text, metric: str) -> dict[str, str] | None:
    """The labels of ``metric``'s first sample in Prometheus' text format."""
    if not isinstance(text, str):
        return None
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            body = line[len(metric) + 1 : line.rindex("}")]
            return {k: v.replace('\\"', '"') for k, v in LABEL.findall(body)}
    return None


def _label_value(value: str):
    """A Prometheus label's text as the value it stands for (``True``, ``0.92``, ``None``)."""
    if value in ("True", "False"):
        return value == "True"
    if value == "None":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value

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

from mismatch_probe.config.spec import LAYOUT_SETTINGS, EngineSpec, SamplingSpec
from mismatch_probe.engines.base import Completion, GenerationRequest, ScoreRequest, batch_seed, check_extra_args
from mismatch_probe.engines.cpu_threads import cpu_thread_binding
from mismatch_probe.errors import ConfigError
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
CPU_MAX_TOTAL_TOKENS = 32768
# Set by the adapter where the spec leaves them open: SGLang's CPU defaults need sgl-kernel's CPU ops.
CPU_DEFAULTS = {"attention_backend": "torch_native", "disable_cuda_graph": True}
# SGLang's scheduler polls its sockets in a busy loop while it has no request: one core at 100%
# (sgl-project/sglang#1730). On CPU that core is one the reference's scoring, and any other process
# of the run, needs; sleep_on_idle (where this SGLang has it) parks the scheduler in zmq's poll until
# a request comes. It changes no number, only when an idle scheduler wakes.
CPU_IDLE_DEFAULTS = {"sleep_on_idle": True}


class SGLangEngine:
    name = "sglang"

    def __init__(self, model_path: str | Path, spec: EngineSpec, *, trust_remote_code: bool = False):
        import torch

        spec = spec if spec.logprobs_mode else spec.model_copy(update={"logprobs_mode": "processed"})
        self.spec = spec
        self.model_path = Path(model_path)
        self.device = spec.device if spec.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                "engine.device is cuda, but this torch sees no CUDA device",
                hint="drop engine.device (auto), or run on a GPU machine",
            )
        check_spec(spec)
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
        self.requested, self.defaults_applied = self._server_args(spec, trust_remote_code)
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
            "routing": None,
            "routing_unavailable": "expert ids from SGLang (return_routed_experts) are not recorded yet",
            "versions": versions,
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
        outputs = self.engine.generate(
            input_ids=[r.prompt_token_ids.tolist() for r in requests],
            sampling_params=params,
            return_logprob=True,
        )
        completions = []
        for i, out in enumerate(outputs):
            tokens = np.asarray(out["output_ids"], dtype=np.int32)
            meta = out["meta_info"]
            completions.append(
                Completion(
                    token_ids=tokens,
                    logprobs=sampled_logprobs(meta.get("output_token_logprobs"), tokens),
                    finish_reason=finish_reason(meta, f"sampling request {i}"),
                )
            )
        if on_progress:
            on_progress(len(requests))
        return completions

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
                result[i] = sampled_logprobs(entries[1:] if entries else entries, r.token_ids[r.start :])
        if on_progress:
            on_progress(len(requests))
        return result

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()


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

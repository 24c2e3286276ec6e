"""Probe specification: what to load, how to sample, how to score (DESIGN §5).

A spec comes from a TOML file (``probes/*.toml``) and/or CLI flags; flags win. Paths inside a
spec file are relative to that file, so a spec works from any working directory. Every field is
validated here, once, with a message that names the field and the accepted values.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from mismatch_probe.config.keys import KeyLines, unknown_key
from mismatch_probe.config.sweep_spec import SweepSpec
from mismatch_probe.config.validation import choices_of, first_error, is_rule, model_at, phrase, rule_error, rule_parts
from mismatch_probe.errors import ConfigError
from mismatch_probe.files import read_text

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "DEVICES",
    "DTYPE_ALIASES",
    "LOGPROBS_MODES",
    "SP_ATTN_IMPLEMENTATIONS",
    "CorrectionThresholds",
    "CorrectionsPatch",
    "EngineSpec",
    "ProbeSpec",
    "ReferencePatch",
    "ReferenceSpec",
    "SamplingSpec",
    "VariantSpec",
    "apply_overrides",
    "load_spec_file",
    "normalize_dtype",
    "rollout_fingerprint",
    "spec_from_dict",
    "unknown_key",
]

DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
# auto: sdpa where the architecture supports it, else eager (hf_models.choose_attention)
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
DEVICES = ("auto", "cpu", "cuda")
# attention that runs under Ulysses sequence parallelism: per packed sequence from cu_seq_lens (sdpa,
# flash), or eager with a mask over the whole packed row (reference/parallel.py: packed_row_mask)
SP_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


# What an engine's log-probs are taken from: the raw logits, or after temperature/top-k/top-p.
LOGPROBS_MODES = ("raw", "processed")


class _Settings(BaseModel):
    """A table of the spec: unknown keys are errors, values are checked strictly (no ``"2"`` for an
    integer, no ``"yes"`` for a boolean; an integer is fine for a number), also on assignment."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class CorrectionThresholds(BaseModel):
    """Thresholds of the correction what-ifs; defaults follow verl's rollout correction.

    verl: ``rollout_is_threshold`` 2.0, RS lower bound the reciprocal of the upper one, geometric
    RS thresholds "typically 1.0002 - 1.001", token veto "typically 1e-4 to 1e-6".
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    token_tis: float = 2.0
    token_mask_low: float = 0.5
    token_mask_high: float = 2.0
    seq_tis: float = 2.0
    seq_mis: float = 2.0
    geo_eps: float = 1e-3
    worst_token_tau: float = 1e-4

    @model_validator(mode="after")
    def _bounds(self) -> CorrectionThresholds:
        for name in ("token_tis", "token_mask_high", "seq_tis", "seq_mis"):
            if not getattr(self, name) > 1.0:
                raise ValueError(f"correction threshold {name} must be > 1, got {getattr(self, name)}")
        if not 0.0 < self.token_mask_low < 1.0:
            raise ValueError(f"token_mask_low must be in (0, 1), got {self.token_mask_low}")
        if not 0.0 < self.geo_eps < 1.0:
            raise ValueError(f"geo_eps must be in (0, 1), got {self.geo_eps}")
        if not 0.0 < self.worst_token_tau < 1.0:
            raise ValueError(f"worst_token_tau must be in (0, 1), got {self.worst_token_tau}")
        return self

    def as_record(self) -> dict[str, Any]:
        """The thresholds as they appear in run.json, next to the share each one produces."""
        return {
            "token_tis_clipped_share": {"ratio_above": self.token_tis},
            "token_mask_share": {"ratio_below": self.token_mask_low, "ratio_above": self.token_mask_high},
            "seq_tis_clipped_share": {"seq_ratio_above": self.seq_tis},
            "seq_mis_masked_share": {"seq_ratio_above": self.seq_mis},
            "geo_rejected_share": {"geo_ratio_below": 1.0 - self.geo_eps, "geo_ratio_above": 1.0 + self.geo_eps},
            "worst_token_rejected_share": {"min_token_ratio_below": self.worst_token_tau},
        }


def normalize_dtype(value: str, *, field_name: str, allow_auto: bool) -> str:
    v = str(value).strip().lower()
    if allow_auto and v == "auto":
        return "auto"
    if v in DTYPE_ALIASES:
        return DTYPE_ALIASES[v]
    choices = "float32, bfloat16, float16" + (" or auto" if allow_auto else "")
    raise ConfigError(f"unknown dtype {value!r} for {field_name}; choose {choices}")


def added_later(default: Any) -> Any:
    """A setting added after runs were first recorded: dumped (so recorded and fingerprinted)
    only when it differs from ``default``, so the specs of earlier runs, and their fingerprints,
    stay what they were and those runs still resume and share rollouts."""
    return Field(default, exclude_if=lambda value: value == default)


class EngineSpec(_Settings):
    """The inference side (behavior policy).

    Engine-specific settings default to ``None``: "whatever the engine does by default", resolved
    and recorded by the engine itself. A setting the chosen engine does not have is an error, never
    silently ignored (see :data:`mismatch_probe.engines.EngineEntry.settings`).
    """

    name: str = "hf"
    python: str | None = None  # interpreter of the engine worker (a venv with the engine installed)
    dtype: str = "auto"  # auto: the checkpoint's own dtype
    # None: the engine's own default, resolved by validate() (raw for hf and vLLM; processed,
    # i.e. log_softmax(logits / T), for SGLang)
    logprobs_mode: str | None = None
    # MoE: record each token's top-k experts per layer (2 * layers * k bytes a token, each side)
    record_routing: bool = True
    # re-score the sampled sequences with the engine's own prefill (decode-vs-prefill mismatch)
    prefill_check: bool = True
    # hf
    device: str = "auto"
    attn_implementation: str | None = None  # hf default: auto (sdpa where the architecture supports it, else eager)
    batch_size: int | None = None  # hf default: 32
    # vllm / sglang
    tensor_parallel_size: int = 1
    # across GPUs and machines (docs/engines-multinode.md); one name means one thing in both engines
    pipeline_parallel_size: int = added_later(1)  # SGLang: pp_size
    data_parallel_size: int = added_later(1)  # engine replicas; SGLang: dp_size
    nnodes: int = added_later(1)  # machines the engine spans (the other nodes are started by hand)
    node_rank: int = added_later(0)  # this machine's rank; mismatch-probe drives rank 0
    dist_init_addr: str | None = added_later(None)  # "HOST:PORT" of node rank 0; vLLM: master_addr, master_port
    distributed_executor_backend: str | None = added_later(None)  # vLLM: mp, ray, uni (None: vLLM's choice)
    enforce_eager: bool | None = None  # True: no torch.compile, no CUDA graphs
    cascade_attn: bool | None = None
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None  # SGLang: the radix cache
    # batch-invariant kernels: vLLM VLLM_BATCH_INVARIANT=1, SGLang enable_deterministic_inference
    batch_invariant: bool = False
    max_num_seqs: int | None = None  # SGLang: max_running_requests
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None  # SGLang: mem_fraction_static
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None  # SGLang: context_length
    # vLLM: the KV cache's size in bytes (per rank); on its CPU build mismatch-probe picks one that fits
    kv_cache_memory_bytes: int | None = None
    # sglang
    attention_backend: str | None = None  # e.g. flashinfer, fa3, triton, torch_native
    rl_on_policy_target: str | None = None  # e.g. "fsdp": SGLang's kernels chosen to match that trainer
    logits_fp32: bool | None = None  # enable_fp32_lm_head
    max_total_tokens: int | None = None  # KV-cache size in tokens (a memory cap)
    # any other engine argument, by the engine's own name (vLLM: EngineArgs fields; SGLang: ServerArgs fields)
    extra_args: dict[str, Any] = Field(default_factory=dict)
    # remote: a rollout server that is already running (engines/remote.py)
    url: str | None = added_later(None)  # http(s)://HOST:PORT, the server's base address
    api: str = added_later("openai")  # openai: /v1/completions (vllm serve); sglang: SGLang's /generate
    served_model: str | None = added_later(None)  # the model name requests carry (default: the only one served)
    api_key_env: str | None = added_later(None)  # the environment variable holding the API key (never the key)
    check_model: bool = added_later(True)  # refuse a server whose model is not the checkpoint
    seed_requests: bool = added_later(True)  # send each request its own seed (the same draw on a re-run)
    # requests in flight; vLLM schedules 256 sequences a step by default, and RL trainers send a whole batch at once
    max_concurrency: int = added_later(256)
    request_timeout_s: float = added_later(600.0)  # per request, each attempt
    max_retries: int = added_later(5)  # on 408/429/5xx, connection refused or reset, timeouts
    retry_backoff_s: float = added_later(1.0)  # the first wait; doubled at each retry (capped at 30 s)
    tls_verify: bool = added_later(True)
    ca_bundle: str | None = added_later(None)  # a CA bundle for a server with a private certificate

    def dist_init_host_port(self) -> tuple[str, int] | None:
        """``dist_init_addr`` as ``(host, port)``: ``HOST:PORT``, an IPv6 host in brackets
        (``[fd00::1]:29500``); None when unset. Raises :class:`ConfigError` when malformed."""
        if self.dist_init_addr is None:
            return None
        host, sep, port = self.dist_init_addr.strip().rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif ":" in host:
            host = ""  # an IPv6 host without brackets: which colon starts the port is ambiguous
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(
                f"engine.dist_init_addr {self.dist_init_addr!r} is not HOST:PORT",
                hint="give node rank 0's address and a free port there, e.g. 10.0.0.1:29500 ([fd00::1]:29500 for IPv6)",
            )
        return host, int(port)

    def check_layout(self) -> None:
        """The multi-GPU / multi-node settings (docs/engines-multinode.md), as far as they hold
        whatever the engine; what one engine cannot run its adapter's ``check_spec`` refuses."""
        for name in ("pipeline_parallel_size", "data_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"engine.node_rank must be in [0, nnodes = {self.nnodes}), got {self.node_rank}")
        backends = ("mp", "ray", "uni", "external_launcher")  # vLLM 0.32's ParallelConfig choices
        if self.distributed_executor_backend not in (None, *backends):
            raise ConfigError(
                f"engine.distributed_executor_backend is {self.distributed_executor_backend!r}; "
                f"choose one of {', '.join(backends)}"
            )
        if self.dist_init_host_port() is None and self.nnodes > 1:
            raise ConfigError(
                f"engine.nnodes = {self.nnodes} needs engine.dist_init_addr, the HOST:PORT where the other "
                "nodes reach node rank 0",
                hint='set dist_init_addr = "10.0.0.1:29500" in [engine] (node rank 0\'s address and a free port)',
            )


class SamplingSpec(_Settings):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    max_tokens: int = 256
    n: int = 1
    seed: int = 0


class ReferenceSpec(_Settings):
    """The training side: a full-sequence forward as a trainer computes it."""

    dtype: str = "bfloat16"
    logits_fp32: bool = False
    attn_implementation: str = "auto"  # sdpa where the architecture supports it, else eager
    packing: bool = True  # padding-free: sequences concatenated, position ids restart per sequence
    micro_batch_size: int = 16  # sequences per forward
    max_tokens_per_micro_batch: int = 4096  # packed mode: token budget per forward
    device: str = "auto"
    # training layouts (one process per rank, torch.distributed): Ulysses sequence parallelism
    # shards the packed row across ranks; tensor parallelism shards attention and MLP weights
    # (DTensor, the model's own column/row-wise plan). world size = sequence x tensor.
    sequence_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # FSDP2 (fully_shard) over the data- and sequence-parallel ranks with a MixedPrecisionPolicy,
    # so the forward runs an FSDP learner's numerics. The defaults are verl's FSDP2 actor's:
    # weights gathered and computed in bfloat16, gradients reduced in float32 (no effect on a
    # forward), outputs left as computed. ``dtype`` is then the master (sharded) weights' dtype.
    fsdp: bool = added_later(False)
    fsdp_param_dtype: str = added_later("bfloat16")
    fsdp_reduce_dtype: str = added_later("float32")
    fsdp_output_dtype: str | None = added_later(None)
    # which distribution the reference scores under: "engine" (the same as the engine's log-probs,
    # the only comparable choice), or deliberately "raw", "temperature" (logits / T only, as
    # verl's actor does), "processed" (temperature, top-k, top-p)
    logprobs: str = "engine"


REFERENCE_LOGPROBS = ("engine", "raw", "temperature", "processed")
# what each engine returns when nobody asks: SGLang's sampler gives log_softmax(logits / T)
ENGINE_DEFAULT_LOGPROBS_MODE = {"sglang": "processed", "remote-sglang": "processed"}


class _Patch(BaseModel):
    """Some settings of a section, for a variant: only the keys given are set, and only those are
    recorded (run.json's ``variants`` lists what each variant changes)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_serializer(mode="wrap")
    def _only_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class ReferencePatch(_Patch):
    """``[variants.reference]``: any :class:`ReferenceSpec` setting."""

    dtype: str | None = None
    logits_fp32: bool | None = None
    attn_implementation: str | None = None
    packing: bool | None = None
    micro_batch_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    device: str | None = None
    sequence_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    fsdp: bool | None = None
    fsdp_param_dtype: str | None = None
    fsdp_reduce_dtype: str | None = None
    fsdp_output_dtype: str | None = None
    logprobs: str | None = None


class CorrectionsPatch(_Patch):
    """``[variants.corrections]``: any :class:`CorrectionThresholds` setting."""

    token_tis: float | None = None
    token_mask_low: float | None = None
    token_mask_high: float | None = None
    seq_tis: float | None = None
    seq_mis: float | None = None
    geo_eps: float | None = None
    worst_token_tau: float | None = None


VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class VariantSpec(_Patch):
    """One ``[[variants]]`` entry: a name (its run directory) and the reference and correction
    settings it scores the shared rollouts with."""

    name: str = Field(pattern=VARIANT_NAME.pattern)
    reference: ReferencePatch | None = None
    corrections: CorrectionsPatch | None = None


class ProbeSpec(_Settings):
    model: str | None = None
    prompts: str | None = None
    out: str | None = None
    name: str | None = None
    max_prompts: int | None = None
    shard_size: int = 256  # samples per rollout/token shard (the unit of resume)
    max_turns: int = 1  # assistant turns per sample; > 1 runs tool calls between turns
    trust_remote_code: bool = False
    engine: EngineSpec = Field(default_factory=EngineSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    reference: ReferenceSpec = Field(default_factory=ReferenceSpec)
    corrections: CorrectionThresholds = Field(default_factory=CorrectionThresholds)
    # [[variants]]: reference (and correction) settings to score the same rollouts with, one run
    # each; recorded as {"name": ..., "reference": {...}, "corrections": {...}} (the keys given)
    variants: list[VariantSpec] = Field(default_factory=list)
    # [sweep]: the settings `mismatch-probe sweep` varies around this spec (a run of its own each)
    sweep: SweepSpec | None = None
    # The run uses absolute paths; run.json records them as the user gave them (in a spec file:
    # relative to it; as flags: as typed), so a record carries no machine's directory layout.
    # {"model": "../fixtures/models/tiny-qwen2", "engine.python": ...}; not part of any fingerprint.
    _given_paths: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def given_paths(self) -> dict[str, str]:
        return self._given_paths

    @field_validator("variants")
    @classmethod
    def _distinct_variants(cls, variants: list[VariantSpec]) -> list[VariantSpec]:
        names: set[str] = set()
        for i, v in enumerate(variants):
            if v.name in names:
                raise rule_error(f"variants[{i}]: the name {v.name!r} is used twice", key=i)
            names.add(v.name)
        if len(variants) == 1:
            raise rule_error("one variant compares nothing", hint="give two or more [[variants]], or none")
        return variants

    @model_validator(mode="after")
    def _sweep_or_variants(self) -> ProbeSpec:
        if self.sweep is not None and self.variants:
            raise rule_error(
                "a spec has [sweep] or [[variants]], not both",
                hint="a sweep varies reference settings too: give them as [[sweep.axes]]",
            )
        return self

    @model_serializer(mode="wrap")
    def _without_empty_sweep(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a spec without [sweep] dumps, records and fingerprints exactly as before [sweep] existed
        d = handler(self)
        if d.get("sweep") is None:
            d.pop("sweep", None)
        return d

    def _resolved_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def to_dict(self) -> dict[str, Any]:
        """The spec as run.json records it: paths as given (others relative to the working
        directory when under it), every other value as the run uses it."""
        from mismatch_probe.files import portable_path

        d = self._resolved_dict()
        for dotted in PATH_FIELDS + ("engine.python",):
            section, _, key = dotted.rpartition(".")
            target = d[section] if section else d
            if target.get(key) is None:
                continue
            given = self.given_paths.get(dotted)
            # a bare interpreter name (python3) is looked up on PATH: keep it as typed
            target[key] = (
                given if given is not None else (portable_path(target[key]) if "/" in target[key] else target[key])
            )
        return d

    def rollout_fingerprint(self) -> str:
        """Hash of what decides the rollouts (model, prompts, engine, sampling), not how they are scored."""
        return rollout_fingerprint(self._resolved_dict())

    def expand_variants(self, base_out: Path) -> list[tuple[str, ProbeSpec]]:
        """One spec per ``[[variants]]`` entry, writing to ``base_out/<variant name>``."""
        out = []
        for v in self.variants:
            spec = self.model_copy(
                deep=True,
                update={
                    "variants": [],
                    "out": str(Path(base_out) / v.name),
                    "name": f"{self.name}-{v.name}" if self.name else v.name,
                },
            )
            spec._given_paths = {k: p for k, p in self.given_paths.items() if k != "out"}
            for section in VARIANT_SECTIONS:
                patch = getattr(v, section)
                if patch is None or not patch.model_fields_set:
                    continue
                current = getattr(spec, section)
                try:
                    merged = type(current).model_validate({**current.model_dump(), **patch.model_dump()})
                except ValidationError as exc:  # CorrectionThresholds validates itself
                    raise ConfigError(f"variant {v.name!r}: [{section}] {phrase(first_error(exc))}") from None
                setattr(spec, section, merged)
            out.append((v.name, spec))
        return out

    def fingerprint(self) -> str:
        """Hash of everything that changes the results (not where they are written)."""
        d = self._resolved_dict()
        d.pop("out", None)
        d.pop("name", None)
        d["engine"] = {k: v for k, v in d["engine"].items() if k not in CLIENT_SETTINGS}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def validate(self) -> ProbeSpec:  # type: ignore[override]  # (pydantic v1's deprecated classmethod)
        """Normalize aliases and check every field; raises :class:`ConfigError`."""
        if not self.model:
            raise ConfigError("no model given", hint="pass --model PATH or set model = ... in the spec file")
        if not self.prompts:
            raise ConfigError(
                "no prompts file given", hint="pass --prompts FILE.jsonl or set prompts = ... in the spec file"
            )
        e, s, r = self.engine, self.sampling, self.reference
        e.dtype = normalize_dtype(e.dtype, field_name="the engine (--engine-dtype)", allow_auto=True)
        r.dtype = normalize_dtype(r.dtype, field_name="the reference (--train-dtype)", allow_auto=False)
        for name in ("fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_output_dtype"):
            if getattr(r, name) is not None:
                setattr(r, name, normalize_dtype(getattr(r, name), field_name=f"reference.{name}", allow_auto=False))
        for side, spec in (("engine", e), ("reference", r)):
            if spec.attn_implementation is not None:
                _choice(spec.attn_implementation, ATTN_IMPLEMENTATIONS, f"{side}.attn_implementation")
            _choice(spec.device, DEVICES, f"{side}.device")
        _choice(r.logprobs, REFERENCE_LOGPROBS, "reference.logprobs")
        if e.url is not None and e.name == "hf":  # a server's address means the remote engine
            e.name = "remote"
        if e.logprobs_mode is None:
            # a server's default: vLLM's raw_logprobs; SGLang's log_softmax(logits / T)
            name = f"remote-{e.api}" if e.name == "remote" else e.name
            e.logprobs_mode = ENGINE_DEFAULT_LOGPROBS_MODE.get(name, "raw")
        _choice(e.logprobs_mode, LOGPROBS_MODES, "engine.logprobs_mode")
        if s.top_k == -1:
            s.top_k = 0
        _check(s.temperature >= 0, f"sampling.temperature must be >= 0, got {s.temperature}")
        _check(0 < s.top_p <= 1, f"sampling.top_p must be in (0, 1], got {s.top_p}")
        _check(s.top_k >= 0, f"sampling.top_k must be >= 0 (0 or -1 disables it), got {s.top_k}")
        _check(s.max_tokens >= 1, f"sampling.max_tokens must be >= 1, got {s.max_tokens}")
        _check(s.n >= 1, f"sampling.n must be >= 1, got {s.n}")
        for name in (
            "batch_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "max_total_tokens",
            "kv_cache_memory_bytes",
        ):
            value = getattr(e, name)
            _check(value is None or value >= 1, f"engine.{name} must be >= 1, got {value}")
        _check(e.max_concurrency >= 1, f"engine.max_concurrency must be >= 1, got {e.max_concurrency}")
        _check(e.max_retries >= 0, f"engine.max_retries must be >= 0, got {e.max_retries}")
        _check(e.request_timeout_s > 0, f"engine.request_timeout_s must be > 0, got {e.request_timeout_s}")
        _check(e.retry_backoff_s >= 0, f"engine.retry_backoff_s must be >= 0, got {e.retry_backoff_s}")
        _check(e.tensor_parallel_size >= 1, f"engine.tensor_parallel_size must be >= 1, got {e.tensor_parallel_size}")
        e.check_layout()
        _check(
            e.gpu_memory_utilization is None or 0 < e.gpu_memory_utilization <= 1,
            f"engine.gpu_memory_utilization must be in (0, 1], got {e.gpu_memory_utilization}",
        )
        if e.python is not None and "/" not in e.python:
            e.python = shutil.which(e.python) or e.python
        if e.python is not None and not Path(e.python).is_file():
            raise ConfigError(
                f"engine.python {e.python!r} does not exist",
                hint="give the python of a venv that has the engine and mismatch-probe installed, e.g. /opt/vllm/bin/python",
            )
        _check(r.micro_batch_size >= 1, f"reference.micro_batch_size must be >= 1, got {r.micro_batch_size}")
        _check(r.max_tokens_per_micro_batch >= 1, "reference.max_tokens_per_micro_batch must be >= 1")
        _check(
            r.sequence_parallel_size >= 1,
            f"reference.sequence_parallel_size must be >= 1, got {r.sequence_parallel_size}",
        )
        _check(
            r.tensor_parallel_size >= 1, f"reference.tensor_parallel_size must be >= 1, got {r.tensor_parallel_size}"
        )
        if r.sequence_parallel_size > 1:
            if not r.packing:
                raise ConfigError(
                    "Ulysses sequence parallelism (--train-sp) shards one packed row across ranks; "
                    "padded micro-batches have no packed row",
                    hint="use --packing (reference.packing = true)",
                )
            _check(
                r.attn_implementation in SP_ATTN_IMPLEMENTATIONS + ("auto",),
                f"reference.attn_implementation {r.attn_implementation!r} cannot run under sequence parallelism "
                f"(it needs a mask over the whole row); choose {' or '.join(SP_ATTN_IMPLEMENTATIONS)}",
            )
        _check(self.shard_size >= 1, f"shard_size must be >= 1, got {self.shard_size}")
        _check(self.max_turns >= 1, f"max_turns must be >= 1, got {self.max_turns}")
        _check(self.max_prompts is None or self.max_prompts >= 1, "max_prompts must be >= 1")
        if e.logprobs_mode == "processed" and s.temperature == 0:
            # Greedy decoding has no processed distribution; both sides then use raw logits.
            e.logprobs_mode = "raw"
        for name, variant in self.expand_variants(Path(".")):
            try:
                variant.validate()
            except ConfigError as exc:
                raise ConfigError(f"variant {name!r}: {exc.message}", hint=exc.hint) from None
        return self


ROLLOUT_KEYS = ("model", "prompts", "max_prompts", "shard_size", "max_turns", "trust_remote_code", "engine", "sampling")
VARIANT_SECTIONS = ("reference", "corrections")


# How a remote engine reaches its server, not what the server samples: a run resumes, and shares its
# rollouts, when the server comes back at another address or under another name, or with other timeouts.
CLIENT_SETTINGS = (
    "url",
    "served_model",
    "api_key_env",
    "check_model",
    "max_concurrency",
    "request_timeout_s",
    "max_retries",
    "retry_backoff_s",
    "tls_verify",
    "ca_bundle",
)


def rollout_fingerprint(spec_dict: dict[str, Any]) -> str:
    """:meth:`ProbeSpec.rollout_fingerprint` of a stored spec (a run.json's ``spec``)."""
    d = {k: spec_dict.get(k) for k in ROLLOUT_KEYS}
    # where the engine ran from, and where its nodes met, do not change what it sampled (run.json
    # records its versions and its layout)
    d["engine"] = {
        k: v
        for k, v in (d["engine"] or {}).items()
        if k not in ("python", "dist_init_addr", "node_rank", *CLIENT_SETTINGS)
    }
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(value: str, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ConfigError(f"{name} is {value!r}; choose one of {', '.join(choices)}")


SECTIONS = {
    "engine": EngineSpec,
    "sampling": SamplingSpec,
    "reference": ReferenceSpec,
    "corrections": CorrectionThresholds,
}
PATH_FIELDS = ("model", "prompts", "out")


def _spec_error(exc: ValidationError, source: str, lines: KeyLines | None) -> ConfigError:
    """The first problem pydantic found in a spec, as one line naming the key (and its line in the file)."""
    err = first_error(exc)
    loc = tuple(err["loc"])
    kind = err["type"]

    def at(path: tuple[str | int, ...]) -> str:
        line = lines.line(path) if lines is not None else None
        return f"{source}:{line}" if line else source

    if is_rule(err):
        message, key, hint = rule_parts(err)
        return ConfigError(f"{at(loc + ((key,) if key is not None else ()))}: {message}", hint=hint)
    what = phrase(err, choices_of(ProbeSpec, loc))
    if loc[0] == "variants":
        if len(loc) < 3:
            return ConfigError(f"{at(loc)}: variants must be an array of tables ([[variants]])")
        where = f"variants[{loc[1]}]"
        if loc[2] == "name":
            return ConfigError(
                f"{at(loc)}: {where} needs a name of letters, digits, '.', '_' or '-' (it names its run directory)"
            )
        if len(loc) == 3:
            if kind == "extra_forbidden":
                return ConfigError(
                    f"{at(loc)}: {where}: {loc[2]!r} cannot vary between variants, which score the same rollouts",
                    hint="a variant sets [reference] and [corrections] settings; give other settings a spec of their own",
                )
            return ConfigError(f"{at(loc)}: {where}: {loc[2]} must be a table")
        if kind == "extra_forbidden":
            return unknown_key(str(loc[-1]), _known(loc), f"{at(loc)}: {where}.{loc[2]}")
        return ConfigError(f"{at(loc)}: {where}.{_dotted(loc[2:])} {what}")
    if len(loc) == 1:
        if kind == "extra_forbidden":
            return unknown_key(str(loc[0]), ProbeSpec.model_fields, at(loc))
        if loc[0] in SECTIONS:
            return ConfigError(f"{at(loc)}: [{loc[0]}] {what if kind == 'value_error' else 'must be a table'}")
        return ConfigError(f"{at(loc)}: {loc[0]} {what}")
    if kind == "extra_forbidden":
        return unknown_key(str(loc[-1]), _known(loc), f"{at(loc)} [{_dotted(loc[:-1])}]")
    return ConfigError(f"{at(loc)}: {_dotted(loc)} {what}")


def _known(loc: tuple[str | int, ...]) -> list[str]:
    """The keys of the table that holds ``loc``'s last key."""
    model = model_at(ProbeSpec, loc[:-1])
    return list(model.model_fields) if model is not None else []


def _dotted(loc: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in loc)


def spec_from_dict(
    data: dict[str, Any], *, base_dir: Path | None = None, source: str = "spec", text: str | None = None
) -> ProbeSpec:
    """Build a spec from nested dicts (a parsed TOML file, ``text`` its source for line numbers);
    unknown keys are errors."""
    data = dict(data)
    given: dict[str, str] = {}
    if base_dir is not None:
        for key in PATH_FIELDS:
            value = data.get(key)
            if isinstance(value, str):
                given[key] = value
                data[key] = str((base_dir / value).resolve()) if not Path(value).is_absolute() else value
        engine = data.get("engine")
        python = engine.get("python") if isinstance(engine, dict) else None
        if isinstance(engine, dict) and isinstance(python, str) and "/" in python:
            given["engine.python"] = python
            data["engine"] = {**engine, "python": os.path.abspath(base_dir / python)}  # not resolve(): venv symlinks
    try:
        spec = ProbeSpec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(exc, source, KeyLines(text) if text is not None else None) from None
    spec.given_paths.update(given)
    return spec


def load_spec_file(path: str | Path) -> ProbeSpec:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"spec file {str(p)!r} is a directory", hint="give a probe spec (TOML), e.g. probes/demo.toml"
        )
    text = read_text(p, "spec file")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML ({exc})") from None
    spec = spec_from_dict(data, base_dir=p.resolve().parent, source=str(p), text=text)
    spec.given_paths["spec_file"] = str(p)  # as typed; run.json names the file it came from
    return spec


def apply_overrides(spec: ProbeSpec, overrides: dict[str, Any]) -> ProbeSpec:
    """Apply ``{"field": v}`` / ``{"section.field": v}`` overrides (CLI flags); ``None`` means unset."""
    for dotted, value in overrides.items():
        if value is None:
            continue
        section_name, _, leaf = dotted.rpartition(".")
        target: BaseModel = getattr(spec, section_name) if section_name else spec
        if leaf not in type(target).model_fields or (not section_name and leaf in (*SECTIONS, "variants", "sweep")):
            settings = [
                k for k in type(target).model_fields if section_name or k not in (*SECTIONS, "variants", "sweep")
            ]
            raise unknown_key(leaf, settings, "override")
        flag = f"--{dotted.replace('.', '-').replace('_', '-')}"
        updated: BaseModel | None = None
        try:
            if section_name:  # a new section object, as dataclasses.replace made (the thresholds are frozen)
                updated = type(target).model_validate({**target.model_dump(), leaf: value})
            else:
                setattr(spec, leaf, value)  # validated on assignment
        except ValidationError as exc:
            err = first_error(exc)
            if err["type"] == "value_error":  # CorrectionThresholds validates itself
                raise ConfigError(f"{dotted}: {phrase(err)}") from None
            raise ConfigError(f"{flag} {phrase(err, choices_of(type(target), (leaf,)))}") from None
        if dotted in PATH_FIELDS or (dotted == "engine.python" and "/" in value):
            spec.given_paths[dotted] = value  # as typed, relative to the working directory
            # not resolve() for the python: a venv's bin/python is a symlink whose target is not the venv
            value = os.path.abspath(value) if dotted == "engine.python" else str(Path(value).resolve())
            if updated is None:
                setattr(spec, leaf, value)
            else:
                updated = updated.model_copy(update={leaf: value})
        if updated is not None:
            setattr(spec, section_name, updated)
    return spec

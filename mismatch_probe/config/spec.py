"""Probe specification: what to load, how to sample, how to score.

A spec comes from a TOML file (``probes/*.toml``) and/or CLI flags; flags win. Paths inside a spec
file are relative to that file, so a spec works from any working directory.

Every setting is declared once, here, with :func:`~mismatch_probe.config.settings.setting`: its
type, default, range or choices, help text and :class:`~mismatch_probe.config.settings.SettingInfo`
(flag, engines, fingerprints, since when recorded). The CLI's options, the flag names in messages,
the engines' settings lists, the remote client's settings, the variant patch models, the JSON Schema
and ``docs/settings.md`` are derived from these declarations (:func:`spec_settings`).

Three steps, kept apart:

1. **validation** (pydantic, when a spec is built or a setting assigned): types, ranges, choices and
   the rules between settings; a bad value is a :class:`ConfigError` naming its TOML line or flag;
2. **normalization** (:meth:`ProbeSpec.normalized`, a new spec): aliases to canonical names
   (``bf16`` is ``bfloat16``), each engine's own defaults resolved (``logprobs_mode``), an
   engine URL selecting the remote engine;
3. **readiness** (:meth:`ProbeSpec.check_runnable`): what a run needs that a spec file may leave to
   flags (a model, prompts) and what lives outside it (the engine's interpreter exists).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tomllib
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from mismatch_probe.config.keys import KeyLines, unknown_key
from mismatch_probe.config.remote_dialects import REMOTE_DIALECTS, api_help
from mismatch_probe.config.settings import EVERY_ENGINE, SettingInfo, info_of, setting
from mismatch_probe.config.sweep_spec import SweepSpec
from mismatch_probe.config.validation import (
    choices_of,
    first_error,
    is_rule,
    literal_values,
    model_at,
    phrase,
    rule_error,
    rule_parts,
)
from mismatch_probe.errors import ConfigError
from mismatch_probe.files import read_text

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "CLIENT_SETTINGS",
    "COMMON_ENGINE_SETTINGS",
    "FINGERPRINT_SCHEMA",
    "LAYOUT_SETTINGS",
    "LOGPROBS_MODES",
    "SP_ATTN_IMPLEMENTATIONS",
    "CorrectionThresholds",
    "CorrectionsPatch",
    "EngineSpec",
    "ProbeSpec",
    "ReferencePatch",
    "ReferenceSpec",
    "SamplingSpec",
    "Setting",
    "SyncSpec",
    "VariantSpec",
    "apply_overrides",
    "default_logprobs_mode",
    "engine_arguments",
    "engine_settings",
    "flag_of",
    "load_spec_file",
    "rollout_fingerprint",
    "spec_from_dict",
    "spec_settings",
    "unknown_key",
]

# The record schema whose fingerprint rules this version computes by (record.py: SCHEMA_VERSION;
# a setting declared ``since`` a later schema is left out of an older record's fingerprints while
# it is at its default, so runs recorded before it existed still resume).
FINGERPRINT_SCHEMA = 4

# ---- choices ----------------------------------------------------------------------------------

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
Dtype = Literal["float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half"]
EngineDtype = Literal["auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half"]
DTYPES = ("float32", "bfloat16", "float16")  # what messages list (the aliases are accepted too)
assert set(typing.get_args(Dtype)) == set(DTYPE_ALIASES) and set(typing.get_args(EngineDtype)) == {
    "auto",
    *DTYPE_ALIASES,
}

# auto: sdpa where the architecture supports it, else eager (modeling/loading.py: choose_attention)
AttnImplementation = Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]
ATTN_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(AttnImplementation)
# attention that runs under Ulysses sequence parallelism: per packed sequence from cu_seq_lens (sdpa,
# flash), or eager with a mask over the whole packed row (reference/parallel.py: packed_row_mask)
SP_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
Device = Literal["auto", "cpu", "cuda"]
# What an engine's log-probs are taken from: the raw logits, or after temperature/top-k/top-p.
LogprobsMode = Literal["raw", "processed"]
LOGPROBS_MODES: tuple[str, ...] = typing.get_args(LogprobsMode)
# which distribution the reference scores under: "engine" (the same as the engine's log-probs, the
# only comparable choice), or deliberately "raw", "temperature" (logits / T only, as verl's actor
# does), "processed" (temperature, top-k, top-p)
ReferenceLogprobs = Literal["engine", "raw", "temperature", "processed"]
ExecutorBackend = Literal["mp", "ray", "uni", "external_launcher"]  # vLLM 0.32's ParallelConfig choices
# the remote engine's dialects (config/remote_dialects.py): a Literal of their names, built from the list
if TYPE_CHECKING:
    RemoteApi = str
else:
    RemoteApi = Literal[tuple(REMOTE_DIALECTS)]
# what each engine returns when nobody asks (raw where not named): SGLang's sampler gives
# log_softmax(logits / T); a remote engine ("remote-<api>") what its dialect's line says
# (config/remote_dialects.py). The one place it is written: spec normalization and the adapters
# read it (default_logprobs_mode).
ENGINE_DEFAULT_LOGPROBS_MODE: dict[str, LogprobsMode] = {
    "sglang": "processed",
    **{f"remote-{api}": d.logprobs_mode for api, d in REMOTE_DIALECTS.items() if d.logprobs_mode != "raw"},
}


def default_logprobs_mode(engine: str, api: str | None = None) -> LogprobsMode:
    """The log-probs ``engine`` returns when ``engine.logprobs_mode`` is unset (a remote engine's: its API's)."""
    return ENGINE_DEFAULT_LOGPROBS_MODE.get(f"{engine}-{api}" if api else engine, "raw")


# help panels of the CLI
INPUTS, ENGINE, LAYOUT, REMOTE, SAMPLING, REFERENCE, CORRECTIONS, SYNC = (
    "Inputs",
    "Engine",
    "Engine layout (multi-GPU, multi-node)",
    "Remote engine (a running server)",
    "Sampling",
    "Reference (the training-side forward)",
    "Correction what-ifs",
    "Weight sync (the trainer's update path)",
)
# How the trainer's weights reach the engine: through the engine's RPC as tensors, through a
# checkpoint on disk, or over a process group (NCCL; GPUs only)
SyncTransfer = Literal["tensor", "disk", "nccl"]
# the start checkpoint the probe makes itself: the model with small deterministic noise
PERTURBED = "perturbed"


class _Settings(BaseModel):
    """A table of the spec: unknown keys are errors, values are checked strictly (no ``"2"`` for an
    integer, no ``"yes"`` for a boolean; an integer is fine for a number), also on assignment."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


# ---- the tables -------------------------------------------------------------------------------


class EngineSpec(_Settings):
    """The inference side (behavior policy).

    Engine-specific settings default to ``None``: "whatever the engine does by default", resolved
    and recorded by the engine itself. A setting the chosen engine does not have is an error, never
    silently ignored (each setting names the engines that honour it; ``engines.EngineEntry``).
    """

    name: str = setting(
        "hf", "Inference engine (see `mismatch-probe engines`).", flag="--engine", affects="rollouts", group=ENGINE
    )
    python: str | None = setting(
        None,
        "Python of a venv with the engine installed; the engine worker runs there.",
        flag="--engine-python",
        affects="run",  # where the engine ran from does not change what it sampled
        group=ENGINE,
        path=True,
        not_an_axis="it is where the engine runs from, not what it computes",
    )
    # the engine may load another export of the model than the reference scores: a quantized one
    # (compressed-tensors, fp8, AWQ/GPTQ), as a run whose rollouts are quantized and whose trainer
    # keeps bf16 weights. Its tokenizer must be the model's (checked before the engine starts).
    # since=5, after FINGERPRINT_SCHEMA: unset, it is in no record or fingerprint, so every run
    # recorded before it existed still resumes.
    checkpoint: str | None = setting(
        None,
        "The checkpoint the engine loads instead of --model, e.g. a quantized export of it (the reference scores --model).",
        flag="--engine-checkpoint",
        affects="rollouts",
        engines=("hf", "vllm", "sglang"),
        group=ENGINE,
        path=True,
        since=5,
    )
    dtype: EngineDtype = setting(
        "auto",
        "Engine dtype (auto: the checkpoint's own).",
        flag="--engine-dtype",
        affects="rollouts",
        engines=EVERY_ENGINE,
        engine_args={"vllm": "dtype", "sglang": "dtype"},
        group=ENGINE,
        choices=("auto", *DTYPES),
    )
    logprobs_mode: LogprobsMode | None = setting(
        None,
        "Engine log-probs: raw or processed (default: the engine's; sglang: processed, logits / T).",
        flag="--logprobs-mode",
        affects="rollouts",
        group=ENGINE,
    )
    record_routing: bool = setting(
        True,
        "MoE models: record each token's top-k experts per layer (2 x layers x k bytes a token, each side).",
        flag="--record-routing/--no-record-routing",
        affects="rollouts",
        group=ENGINE,
    )
    prefill_check: bool = setting(
        True,
        "Re-score samples with the engine's own prefill (decode vs prefill).",
        flag="--prefill-check/--no-prefill-check",
        affects="rollouts",
        group=ENGINE,
    )
    device: Device = setting(
        "auto",
        "Engine device (hf, sglang).",
        flag="--engine-device",
        affects="rollouts",
        engines=("hf", "sglang"),
        engine_args={"sglang": "device"},
        group=ENGINE,
    )
    attn_implementation: AttnImplementation | None = setting(
        None,
        "Engine attention implementation (hf; default auto: sdpa where the architecture supports it, else eager).",
        flag="--engine-attn",
        affects="rollouts",
        engines=("hf",),
        group=ENGINE,
    )
    batch_size: int | None = setting(
        None,
        "Sequences per engine batch (hf; default 32).",
        flag="--engine-batch-size",
        affects="rollouts",
        engines=("hf",),
        group=ENGINE,
        ge=1,
    )
    tensor_parallel_size: int = setting(
        1,
        "Engine tensor-parallel size ({args}).",
        flag="--tp",
        affects="rollouts",
        engine_args={"vllm": "tensor_parallel_size", "sglang": "tp_size"},
        group=ENGINE,
        ge=1,
    )
    # across GPUs and machines (docs/engines-multinode.md); one name means one thing in both engines
    pipeline_parallel_size: int = setting(
        1,
        "Engine pipeline-parallel size ({args}).",
        flag="--pp",
        affects="rollouts",
        engine_args={"vllm": "pipeline_parallel_size", "sglang": "pp_size"},
        group=LAYOUT,
        since=4,
        ge=1,
    )
    data_parallel_size: int = setting(
        1,
        "Engine replicas ({args}).",
        flag="--dp",
        affects="rollouts",
        engine_args={"vllm": "data_parallel_size", "sglang": "dp_size"},
        group=LAYOUT,
        since=4,
        ge=1,
    )
    nnodes: int = setting(
        1,
        "Machines the engine spans (the other nodes are started by hand).",
        flag="--nnodes",
        affects="rollouts",
        engine_args={"vllm": "nnodes", "sglang": "nnodes"},
        group=LAYOUT,
        since=4,
        ge=1,
    )
    node_rank: int = setting(
        0,
        "This machine's rank in the engine's nodes; mismatch-probe drives rank 0.",
        flag="--node-rank",
        affects="run",
        engine_args={"vllm": "node_rank", "sglang": "node_rank"},
        group=LAYOUT,
        since=4,
        not_an_axis="mismatch-probe runs node rank 0",
        ge=0,
    )
    dist_init_addr: str | None = setting(
        None,
        "HOST:PORT of node rank 0 where the engine's nodes meet ({args}).",
        flag="--dist-init-addr",
        affects="run",
        engine_args={"vllm": ("master_addr", "master_port"), "sglang": "dist_init_addr"},
        group=LAYOUT,
        since=4,
        not_an_axis="it is where the nodes meet, not what they compute",
    )
    distributed_executor_backend: ExecutorBackend | None = setting(
        None,
        "vLLM's executor backend (default: vLLM's choice).",
        flag="--distributed-executor-backend",
        affects="rollouts",
        engine_args={"vllm": "distributed_executor_backend"},
        group=LAYOUT,
        since=4,
    )
    enforce_eager: bool | None = setting(
        None,
        "Eager mode, or torch.compile + CUDA graphs ({args}; default: the engine's).",
        flag="--enforce-eager/--compiled",
        affects="rollouts",
        engine_args={"vllm": "enforce_eager", "sglang": "disable_cuda_graph"},
        group=ENGINE,
    )
    cascade_attn: bool | None = setting(
        None,
        "Cascade attention (vllm).",
        flag="--cascade-attn/--no-cascade-attn",
        affects="rollouts",
        engines=("vllm",),
        group=ENGINE,
    )
    chunked_prefill: bool | None = setting(
        None,
        "Chunked prefill ({args}).",
        flag="--chunked-prefill/--no-chunked-prefill",
        affects="rollouts",
        engine_args={"vllm": "enable_chunked_prefill", "sglang": "chunked_prefill_size"},
        group=ENGINE,
    )
    prefix_caching: bool | None = setting(
        None,
        "Prefix caching, SGLang's radix cache ({args}).",
        flag="--prefix-caching/--no-prefix-caching",
        affects="rollouts",
        engine_args={"vllm": "enable_prefix_caching", "sglang": "disable_radix_cache"},
        group=ENGINE,
    )
    batch_invariant: bool = setting(
        False,
        "Batch-invariant kernels (vllm: VLLM_BATCH_INVARIANT=1, GPU builds; {args}).",
        flag="--batch-invariant/--no-batch-invariant",
        affects="rollouts",
        engines=("vllm", "sglang"),
        engine_args={"sglang": "enable_deterministic_inference"},
        group=ENGINE,
    )
    max_num_seqs: int | None = setting(
        None,
        "Most sequences per engine step ({args}).",
        flag="--max-num-seqs",
        affects="rollouts",
        engine_args={"vllm": "max_num_seqs", "sglang": "max_running_requests"},
        group=ENGINE,
        ge=1,
    )
    max_num_batched_tokens: int | None = setting(
        None,
        "Most tokens per engine step ({args}).",
        flag="--max-num-batched-tokens",
        affects="rollouts",
        engine_args={"vllm": "max_num_batched_tokens"},
        group=ENGINE,
        ge=1,
    )
    gpu_memory_utilization: float | None = setting(
        None,
        "Share of accelerator memory the engine may take ({args}; on vLLM's CPU builds, of the NUMA node's memory).",
        flag="--gpu-memory-utilization",
        affects="rollouts",
        engine_args={"vllm": "gpu_memory_utilization", "sglang": "mem_fraction_static"},
        group=ENGINE,
        gt=0,
        le=1,
    )
    kv_cache_dtype: str | None = setting(
        None,
        "KV-cache dtype, e.g. auto, fp8, fp8_e5m2 ({args}).",
        flag="--kv-cache-dtype",
        affects="rollouts",
        engine_args={"vllm": "kv_cache_dtype", "sglang": "kv_cache_dtype"},
        group=ENGINE,
    )
    quantization: str | None = setting(
        None,
        "Weight quantization method, e.g. fp8 ({args}).",
        flag="--quantization",
        affects="rollouts",
        engine_args={"vllm": "quantization", "sglang": "quantization"},
        group=ENGINE,
    )
    max_model_len: int | None = setting(
        None,
        "Engine context length ({args}).",
        flag="--max-model-len",
        affects="rollouts",
        engine_args={"vllm": "max_model_len", "sglang": "context_length"},
        group=ENGINE,
        ge=1,
    )
    kv_cache_memory_bytes: int | None = setting(
        None,
        "KV-cache size in bytes per rank ({args}; default on vLLM's CPU build: what the run needs, capped at half "
        "the NUMA node's free memory).",
        flag="--kv-cache-memory-bytes",
        affects="rollouts",
        engine_args={"vllm": "kv_cache_memory_bytes"},
        group=ENGINE,
        ge=1,
    )
    attention_backend: str | None = setting(
        None,
        "Engine attention backend, e.g. flashinfer, fa3, triton, torch_native ({args}).",
        flag="--attention-backend",
        affects="rollouts",
        engine_args={"sglang": "attention_backend"},
        group=ENGINE,
    )
    rl_on_policy_target: str | None = setting(
        None,
        "SGLang's true on-policy mode for a trainer, e.g. fsdp ({args}; implies deterministic inference).",
        flag="--rl-on-policy-target",
        affects="rollouts",
        engine_args={"sglang": "rl_on_policy_target"},
        group=ENGINE,
    )
    logits_fp32: bool | None = setting(
        None,
        "Engine LM head in float32 ({args}).",
        flag="--engine-logits-fp32/--no-engine-logits-fp32",
        affects="rollouts",
        engine_args={"sglang": "enable_fp32_lm_head"},
        group=ENGINE,
    )
    max_total_tokens: int | None = setting(
        None,
        "Engine KV-cache size in tokens, a memory cap ({args}).",
        flag="--max-total-tokens",
        affects="rollouts",
        engine_args={"sglang": "max_total_tokens"},
        group=ENGINE,
        ge=1,
    )
    extra_args: dict[str, Any] = setting(
        help="Any other engine argument by the engine's own name, as KEY=VALUE with VALUE read as TOML "
        "(repeatable; vllm: EngineArgs fields, sglang: ServerArgs fields).",
        flag="--engine-arg",
        affects="rollouts",
        engines=("vllm", "sglang"),
        group=ENGINE,
        default_factory=dict,
        not_an_axis="it is a table",
        metavar="KEY=VALUE",
    )
    # remote: a rollout server that is already running (engines/remote/)
    url: str | None = setting(
        None,
        "A running rollout server to probe instead of starting an engine: http(s)://HOST:PORT.",
        flag="--engine-url",
        affects="nothing",  # how the server is reached, not what it samples (it is checked instead)
        engines=("remote",),
        group=REMOTE,
        since=4,
    )
    api: RemoteApi = setting(
        "openai",
        api_help(),
        flag="--engine-api",
        affects="rollouts",
        engines=("remote",),
        group=REMOTE,
        since=4,
    )
    served_model: str | None = setting(
        None,
        "The model name requests to the server carry (default: the only one it serves).",
        flag="--engine-model",
        affects="nothing",
        engines=("remote",),
        group=REMOTE,
        since=4,
    )
    api_key_env: str | None = setting(
        None,
        "Environment variable holding the server's API key (the key is never recorded).",
        flag="--engine-api-key-env",
        affects="nothing",
        engines=("remote",),
        group=REMOTE,
        since=4,
    )
    check_model: bool = setting(
        True,
        "Refuse a server whose model is not the checkpoint (names, architectures, tokenizer).",
        flag="--check-model/--no-check-model",
        affects="nothing",
        engines=("remote",),
        group=REMOTE,
        since=4,
    )
    seed_requests: bool = setting(
        True,
        "Send each request its own seed (the same draw on a re-run).",
        flag="--seed-requests/--no-seed-requests",
        affects="rollouts",
        engines=("remote",),
        group=REMOTE,
        since=4,
    )
    max_concurrency: int = setting(
        256,  # vLLM schedules 256 sequences a step by default, and RL trainers send a whole batch at once
        "Requests in flight to the server.",
        flag="--max-concurrency",
        affects="nothing",
        engines=("remote",),
        group=REMOTE,
        since=4,
        ge=1,
    )
    request_timeout_s: float = setting(
        600.0,
        "Seconds a request may take, each attempt.",
        flag="--request-timeout-s",
        affects="nothing",
        engines=("remote",),
        group=REMOTE,
        since=4,
        gt=0,
    )
    max_retries: int = setting(
        5,
        "Retries of a request on 408/429/5xx, refused or reset connections and timeouts.",
        flag="--max-retries",
        affects="nothing",
        engines=("remote",),
        group=REMOTE,
        since=4,
        ge=0,
    )
    retry_backoff_s: float = setting(
        1.0,
        "The first wait before a retry, doubled at each retry (capped at 30 s).",
        flag="--retry-backoff-s",
        affects="nothing",
        engines=("remote",),
        group=REMOTE,
        since=4,
        ge=0,
    )
    tls_verify: bool = setting(
        True,
        "Verify the server's TLS certificate.",
        flag="--tls-verify/--no-tls-verify",
        affects="nothing",
        engines=("remote",),
        group=REMOTE,
        since=4,
    )
    ca_bundle: str | None = setting(
        None,
        "A CA bundle (PEM) for a server with a private certificate.",
        flag="--ca-bundle",
        affects="nothing",
        engines=("remote",),
        group=REMOTE,
        since=4,
    )

    @field_validator("dist_init_addr")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and split_host_port(value) is None:
            raise rule_error(
                f"engine.dist_init_addr {value!r} is not HOST:PORT",
                hint="give node rank 0's address and a free port there, e.g. 10.0.0.1:29500 ([fd00::1]:29500 for IPv6)",
            )
        return value

    @model_validator(mode="after")
    def _layout(self) -> EngineSpec:
        """The multi-GPU / multi-node settings (docs/engines-multinode.md), as far as they hold
        whatever the engine; what one engine cannot run its adapter's ``check_spec`` refuses."""
        if not self.node_rank < self.nnodes:
            raise rule_error(
                f"engine.node_rank must be in [0, nnodes = {self.nnodes}), got {self.node_rank}", key="node_rank"
            )
        if self.dist_init_addr is None and self.nnodes > 1:
            raise rule_error(
                f"engine.nnodes = {self.nnodes} needs engine.dist_init_addr, the HOST:PORT where the other "
                "nodes reach node rank 0",
                key="nnodes",
                hint='set dist_init_addr = "10.0.0.1:29500" in [engine] (node rank 0\'s address and a free port)',
            )
        return self

    def dist_init_host_port(self) -> tuple[str, int] | None:
        """``dist_init_addr`` as ``(host, port)``: ``HOST:PORT``, an IPv6 host in brackets
        (``[fd00::1]:29500``); None when unset."""
        return None if self.dist_init_addr is None else split_host_port(self.dist_init_addr)


def split_host_port(address: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (an IPv6 host in brackets) as ``(host, port)``; None when malformed."""
    host, sep, port = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 host without brackets: which colon starts the port is ambiguous
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        return None
    return host, int(port)


class SamplingSpec(_Settings):
    temperature: float = setting(
        1.0, "Sampling temperature (0 = greedy).", flag="--temperature", affects="rollouts", group=SAMPLING, ge=0
    )
    top_p: float = setting(
        1.0, "Nucleus sampling mass.", flag="--top-p", affects="rollouts", group=SAMPLING, gt=0, le=1
    )
    top_k: int = setting(0, "Top-k (0 or -1 disables it).", flag="--top-k", affects="rollouts", group=SAMPLING, ge=-1)
    max_tokens: int = setting(
        256, "Maximum new tokens per response.", flag="--max-tokens", affects="rollouts", group=SAMPLING, ge=1
    )
    n: int = setting(1, "Samples per prompt.", flag="--n", affects="rollouts", group=SAMPLING, ge=1)
    seed: int = setting(
        0, "Sampling seed.", flag="--seed", affects="rollouts", group=SAMPLING, not_an_axis="the repeats vary the seed"
    )


class ReferenceSpec(_Settings):
    """The training side: a full-sequence forward as a trainer computes it."""

    dtype: Dtype = setting(
        "bfloat16", "Reference dtype.", flag="--train-dtype", affects="run", group=REFERENCE, choices=DTYPES
    )
    logits_fp32: bool = setting(
        False, "Reference LM head in float32.", flag="--logits-fp32/--no-logits-fp32", affects="run", group=REFERENCE
    )
    attn_implementation: AttnImplementation = setting(
        "auto",
        "Reference attention implementation (auto: sdpa where the architecture supports it, else eager).",
        flag="--train-attn",
        affects="run",
        group=REFERENCE,
    )
    packing: bool = setting(
        True,
        "Padding-free packing (sequences concatenated, position ids restarting per sequence) vs padded micro-batches.",
        flag="--packing/--no-packing",
        affects="run",
        group=REFERENCE,
    )
    micro_batch_size: int = setting(
        16, "Reference sequences per forward.", flag="--micro-batch-size", affects="run", group=REFERENCE, ge=1
    )
    max_tokens_per_micro_batch: int = setting(
        4096,
        "Packed mode: the token budget of one forward.",
        flag="--max-tokens-per-micro-batch",
        affects="run",
        group=REFERENCE,
        ge=1,
    )
    device: Device = setting("auto", "Reference device.", flag="--train-device", affects="run", group=REFERENCE)
    # training layouts (one process per rank, torch.distributed): Ulysses sequence parallelism
    # shards the packed row across ranks; tensor parallelism shards attention and MLP weights
    # (DTensor, the model's own column/row-wise plan). world size = sequence x tensor.
    sequence_parallel_size: int = setting(
        1,
        "Reference Ulysses sequence-parallel size (ranks share each packed row; needs --packing).",
        flag="--train-sp",
        affects="run",
        group=REFERENCE,
        ge=1,
    )
    tensor_parallel_size: int = setting(
        1,
        "Reference tensor-parallel size (DTensor column/row-wise plan).",
        flag="--train-tp",
        affects="run",
        group=REFERENCE,
        ge=1,
    )
    # FSDP2 (fully_shard) over the data- and sequence-parallel ranks with a MixedPrecisionPolicy,
    # so the forward runs an FSDP learner's numerics. The defaults are verl's FSDP2 actor's:
    # weights gathered and computed in bfloat16, gradients reduced in float32 (no effect on a
    # forward), outputs left as computed. ``dtype`` is then the master (sharded) weights' dtype.
    fsdp: bool = setting(
        False,
        "Wrap the reference with FSDP2 fully_shard and a mixed-precision policy (dtype: the master weights').",
        flag="--fsdp/--no-fsdp",
        affects="run",
        group=REFERENCE,
        since=4,
    )
    fsdp_param_dtype: Dtype = setting(
        "bfloat16",
        "FSDP2: the dtype weights are gathered and computed in.",
        flag="--fsdp-param-dtype",
        affects="run",
        group=REFERENCE,
        since=4,
        choices=DTYPES,
    )
    fsdp_reduce_dtype: Dtype = setting(
        "float32",
        "FSDP2: the dtype gradients are reduced in (no effect on a forward).",
        flag="--fsdp-reduce-dtype",
        affects="run",
        group=REFERENCE,
        since=4,
        choices=DTYPES,
    )
    fsdp_output_dtype: Dtype | None = setting(
        None,
        "FSDP2: the dtype of the forward's outputs (default: as computed).",
        flag="--fsdp-output-dtype",
        affects="run",
        group=REFERENCE,
        since=4,
        choices=DTYPES,
    )
    logprobs: ReferenceLogprobs = setting(
        "engine",
        "Reference distribution: engine (match it), raw, temperature (logits / T, as verl's actor), processed.",
        flag="--reference-logprobs",
        affects="run",
        group=REFERENCE,
    )
    # the routing replay (R3) what-if: a second reference forward of MoE runs whose engine recorded
    # its routing. since=5: at its default it is in no fingerprint, so earlier runs still resume.
    routing_replay: bool = setting(
        True,
        "MoE runs with the engine's routing: the reference scores the tokens a second time with the routing "
        "behind each model token forced to the engine's experts (R3), for the routing replay what-if.",
        flag="--routing-replay/--no-routing-replay",
        affects="run",
        group=REFERENCE,
        since=5,
    )

    @model_validator(mode="after")
    def _sequence_parallel(self) -> ReferenceSpec:
        if self.sequence_parallel_size > 1:
            if not self.packing:
                raise rule_error(
                    "Ulysses sequence parallelism (--train-sp) shards one packed row across ranks; "
                    "padded micro-batches have no packed row",
                    key="packing",
                    hint="use --packing (reference.packing = true)",
                )
            if self.attn_implementation not in (*SP_ATTN_IMPLEMENTATIONS, "auto"):
                raise rule_error(
                    f"reference.attn_implementation {self.attn_implementation!r} cannot run under sequence "
                    f"parallelism (it needs a mask over the whole row); choose {' or '.join(SP_ATTN_IMPLEMENTATIONS)}",
                    key="attn_implementation",
                )
        return self


class CorrectionThresholds(BaseModel):
    """Thresholds of the correction what-ifs; defaults follow verl's rollout correction.

    verl: ``rollout_is_threshold`` 2.0, RS lower bound the reciprocal of the upper one, geometric
    RS thresholds "typically 1.0002 - 1.001", token veto "typically 1e-4 to 1e-6".
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    token_tis: float = setting(
        2.0, "Token TIS: ratios clipped above this.", flag="--token-tis", affects="run", group=CORRECTIONS, gt=1
    )
    token_mask_low: float = setting(
        0.5,
        "Token masking: tokens with a ratio below this are dropped.",
        flag="--token-mask-low",
        affects="run",
        group=CORRECTIONS,
        gt=0,
        lt=1,
    )
    token_mask_high: float = setting(
        2.0,
        "Token masking: tokens with a ratio above this are dropped.",
        flag="--token-mask-high",
        affects="run",
        group=CORRECTIONS,
        gt=1,
    )
    seq_tis: float = setting(
        2.0,
        "Sequence TIS: sequence ratios clipped above this.",
        flag="--seq-tis",
        affects="run",
        group=CORRECTIONS,
        gt=1,
    )
    seq_mis: float = setting(
        2.0,
        "Sequence masking: sequences with a ratio above this are dropped.",
        flag="--seq-mis",
        affects="run",
        group=CORRECTIONS,
        gt=1,
    )
    geo_eps: float = setting(
        1e-3,
        "Geometric rejection: sequences whose geometric-mean ratio is outside 1 ± this are dropped.",
        flag="--geo-eps",
        affects="run",
        group=CORRECTIONS,
        gt=0,
        lt=1,
    )
    worst_token_tau: float = setting(
        1e-4,
        "Token veto: sequences holding a token ratio below this are dropped.",
        flag="--worst-token-tau",
        affects="run",
        group=CORRECTIONS,
        gt=0,
        lt=1,
    )

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


class SyncSpec(_Settings):
    """[sync]: the engine starts from another checkpoint and then receives the probe's model through
    its own weight-update path before it samples, as an RL engine does after every optimizer step
    (ARCHITECTURE.md, Weight sync). Off while ``start_from`` is unset; a spec without it records and
    fingerprints as before [sync] existed."""

    start_from: str | None = setting(
        None,
        "The checkpoint the engine starts from before the sync: a directory, or 'perturbed' (the model "
        "with small deterministic noise, made by the probe). Unset: no sync.",
        flag="--sync-from",
        affects="rollouts",
        group=SYNC,
        path=True,
        choices=(PERTURBED,),
        since=4,
    )
    transfer: SyncTransfer = setting(
        "tensor",
        "How the weights travel: tensors through the engine's RPC, a checkpoint on disk, or NCCL (GPUs).",
        flag="--sync-transfer",
        affects="rollouts",
        group=SYNC,
        since=4,
    )
    dtype: EngineDtype = setting(
        "auto",
        "The dtype the trainer sends the weights in (auto: the checkpoint's).",
        flag="--sync-dtype",
        affects="rollouts",
        group=SYNC,
        since=4,
    )
    bucket_mb: float = setting(
        512.0,
        "Weights per transfer, in MiB (ms-swift's move_model_batches, verl's bucketed transfer).",
        flag="--sync-bucket-mb",
        affects="rollouts",
        group=SYNC,
        since=4,
        gt=0,
    )
    reset_prefix_cache: bool = setting(
        True,
        "Reset the engine's prefix cache after the sync.",
        flag="--sync-reset-prefix-cache/--no-sync-reset-prefix-cache",
        affects="rollouts",
        group=SYNC,
        since=4,
    )
    repeats: int = setting(
        1,
        "Sync the same weights this many times, sampling after each.",
        flag="--sync-repeats",
        affects="rollouts",
        group=SYNC,
        since=4,
        ge=1,
        le=100,
    )
    warm_cache: bool = setting(
        False,
        "Sample the prompts before the sync, so the prefix cache holds entries of the old weights.",
        flag="--sync-warm-cache/--no-sync-warm-cache",
        affects="rollouts",
        group=SYNC,
        since=4,
    )
    sleep_level: int = setting(
        0,
        "Colocate cycle before the sync: the engine sleeps at this level (1 or 2), then wakes (0: none).",
        flag="--sync-sleep-level",
        affects="rollouts",
        group=SYNC,
        since=4,
        ge=0,
        le=2,
    )

    @property
    def enabled(self) -> bool:
        return self.start_from is not None

    @model_validator(mode="after")
    def _needs_start(self) -> SyncSpec:
        if self.start_from is None:
            changed = [k for k, f in type(self).model_fields.items() if getattr(self, k) != f.default]
            if changed:
                raise rule_error(
                    f"sync.{changed[0]} is set but sync.start_from is not: nothing is synced",
                    key=changed[0],
                    hint="set start_from = 'perturbed' (or a checkpoint directory) in [sync], or --sync-from",
                )
        return self


# the setting tables, by their key in the spec
SECTIONS: dict[str, type[BaseModel]] = {
    "engine": EngineSpec,
    "sampling": SamplingSpec,
    "reference": ReferenceSpec,
    "corrections": CorrectionThresholds,
    "sync": SyncSpec,
}
# the tables a [[variants]] entry may change: those that score the same rollouts
VARIANT_SECTIONS = ("reference", "corrections")


# ---- [[variants]] -------------------------------------------------------------------------------


class _Patch(BaseModel):
    """Some settings of a section, for a variant: only the keys given are set, and only those are
    recorded (run.json's ``variants`` lists what each variant changes)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_serializer(mode="wrap")
    def _only_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


def _patch_of(section: type[BaseModel], name: str) -> type[_Patch]:
    """A patch model of ``section``: each of its settings, optional (checked again once merged)."""
    fields: dict[str, Any] = {}
    for key, field in section.model_fields.items():
        constraints = [m for m in field.metadata if not isinstance(m, SettingInfo)]  # ranges, as the section's
        kind: Any = Annotated[field.annotation, *constraints] if constraints else field.annotation
        fields[key] = (kind | None, Field(None, description=field.description))
    return create_model(name, __base__=_Patch, __doc__=f"Any {section.__name__} setting, for a variant.", **fields)


if TYPE_CHECKING:  # to the type checker, a patch is a patch; pydantic validates the real fields
    ReferencePatch = _Patch
    CorrectionsPatch = _Patch
else:
    ReferencePatch = _patch_of(ReferenceSpec, "ReferencePatch")  # [variants.reference]
    CorrectionsPatch = _patch_of(CorrectionThresholds, "CorrectionsPatch")  # [variants.corrections]

VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class VariantSpec(_Patch):
    """One ``[[variants]]`` entry: a name (its run directory) and the reference and correction
    settings it scores the shared rollouts with."""

    name: str = Field(pattern=VARIANT_NAME.pattern)
    reference: ReferencePatch | None = None
    corrections: CorrectionsPatch | None = None


# ---- the spec -----------------------------------------------------------------------------------


class ProbeSpec(_Settings):
    model: str | None = setting(
        None, "Local Hugging Face checkpoint directory.", flag="--model", affects="rollouts", group=INPUTS, path=True
    )
    prompts: str | None = setting(
        None, "Prompts file (JSON Lines).", flag="--prompts", affects="rollouts", group=INPUTS, path=True
    )
    out: str | None = setting(
        None,
        "Run directory (default reports/<name>-<time>).",
        flag="--out",
        affects="nothing",
        group=INPUTS,
        path=True,
        not_an_axis="it is where the run is written",
    )
    name: str | None = setting(
        None,
        "The run's name in reports (default: the model and engine).",
        flag="--name",
        affects="nothing",
        group=INPUTS,
        not_an_axis="it names the run",
    )
    max_prompts: int | None = setting(
        None, "Use only the first N prompts.", flag="--max-prompts", affects="rollouts", group=INPUTS, ge=1
    )
    shard_size: int = setting(
        256,
        "Samples per rollout and token shard (the unit of resume).",
        flag="--shard-size",
        affects="rollouts",
        group=INPUTS,
        ge=1,
    )
    max_turns: int = setting(
        1,
        "Assistant turns per sample; > 1 runs tool calls between turns.",
        flag="--max-turns",
        affects="rollouts",
        group=INPUTS,
        ge=1,
    )
    trust_remote_code: bool = setting(
        False,
        "Run the checkpoint's own modelling code (Hugging Face trust_remote_code).",
        flag="--trust-remote-code/--no-trust-remote-code",
        affects="rollouts",
        group=INPUTS,
    )
    engine: EngineSpec = Field(default_factory=EngineSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    reference: ReferenceSpec = Field(default_factory=ReferenceSpec)
    corrections: CorrectionThresholds = Field(default_factory=CorrectionThresholds)
    # [sync]: the engine's weights arrive through its update path (dropped from dumps while off)
    sync: SyncSpec = Field(default_factory=SyncSpec)
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
        for i, axis in enumerate(self.sweep.axes if self.sweep is not None else ()):
            where = ("sweep", "axes", i, "key" if axis.key is not None else "levels")
            for key in axis.keys:
                section = key.partition(".")[0]
                if section not in SECTIONS:
                    raise rule_error(
                        f"sweep axis key {key!r} must name a setting as section.setting",
                        key=where,
                        hint=f"section one of {', '.join(SECTIONS)}, e.g. engine.dtype",
                    )
                setting = spec_settings().get(key)
                if setting is not None and setting.info.not_an_axis:
                    raise rule_error(f"{key} cannot be a sweep axis: {setting.info.not_an_axis}", key=where)
        for i, v in enumerate(self.variants):  # every variant is a valid spec, or the file is refused
            for section in VARIANT_SECTIONS:
                patch = getattr(v, section)
                if patch is not None and patch.model_fields_set:
                    try:
                        _merged(getattr(self, section), patch)
                    except ValidationError as exc:
                        err = first_error(exc)
                        at = ("variants", i, section, *err["loc"])
                        what = rule_parts(err)[0] if is_rule(err) else f"{section}.{_dotted(err['loc'])} {phrase(err)}"
                        raise rule_error(f"variant {v.name!r}: {what}", key=at) from None
        return self

    @model_serializer(mode="wrap")
    def _without_empty_sweep(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a spec without [sweep] dumps, records and fingerprints exactly as before [sweep] existed
        d = handler(self)
        if d.get("sweep") is None:
            d.pop("sweep", None)
        return d

    # ---- normalization and readiness ---------------------------------------------------------

    def normalized(self) -> ProbeSpec:
        """A copy with aliases and defaults resolved (idempotent): dtype aliases to their canonical
        names, ``top_k = -1`` to 0, each engine's own ``logprobs_mode`` default, greedy sampling
        comparing raw log-probs, an engine URL selecting the remote engine, a bare interpreter name
        looked up on PATH. Every run, and every fingerprint, is of the normalized spec."""
        spec = self.model_copy(deep=True)
        spec._given_paths = dict(self._given_paths)
        e, s, r = spec.engine, spec.sampling, spec.reference
        if e.dtype != "auto":
            e.dtype = DTYPE_ALIASES[e.dtype]  # type: ignore[assignment]
        r.dtype = DTYPE_ALIASES[r.dtype]  # type: ignore[assignment]
        for name in ("fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_output_dtype"):
            if getattr(r, name) is not None:
                setattr(r, name, DTYPE_ALIASES[getattr(r, name)])
        if e.url is not None and e.name == "hf":  # a server's address means the remote engine
            e.name = "remote"
        if e.logprobs_mode is None:
            # a server's default: vLLM's raw_logprobs; SGLang's log_softmax(logits / T)
            e.logprobs_mode = default_logprobs_mode(e.name, e.api if e.name == "remote" else None)
        if s.top_k == -1:
            s.top_k = 0
        if e.logprobs_mode == "processed" and s.temperature == 0:
            # Greedy decoding has no processed distribution; both sides then use raw logits.
            e.logprobs_mode = "raw"
        if e.python is not None and "/" not in e.python:
            e.python = shutil.which(e.python) or e.python
        return spec

    def check_runnable(self) -> None:
        """What a run needs beyond a valid spec: a model and prompts (a spec file may leave them to
        flags), and an engine interpreter that exists."""
        if not self.model:
            raise ConfigError("no model given", hint="pass --model PATH or set model = ... in the spec file")
        if not self.prompts:
            raise ConfigError(
                "no prompts file given", hint="pass --prompts FILE.jsonl or set prompts = ... in the spec file"
            )
        python = self.engine.python
        found = python if python is None or "/" in python else shutil.which(python)
        if python is not None and not (found and Path(found).is_file()):
            raise ConfigError(
                f"engine.python {python!r} does not exist",
                hint="give the python of a venv that has the engine and mismatch-probe installed, e.g. /opt/vllm/bin/python",
            )

    # ---- what is recorded and fingerprinted --------------------------------------------------

    def dump(self, schema: int = FINGERPRINT_SCHEMA) -> dict[str, Any]:
        """The spec as a record of ``schema`` holds it: every setting, except, for an older schema,
        those it did not record at their default (:attr:`SettingInfo.since`)."""
        return _as_of(self.model_dump(), schema)

    def to_dict(self) -> dict[str, Any]:
        """The spec as run.json records it: paths as given (others relative to the working
        directory when under it), every other value as the run uses it."""
        from mismatch_probe.files import portable_path

        d = self.dump()
        for s in spec_settings().values():
            if not s.info.path:
                continue
            target = d.get(s.section) if s.section else d
            if not target or target.get(s.name) is None or target[s.name] in s.info.choices:
                continue
            given = self.given_paths.get(s.key)
            # a bare interpreter name (python3) is looked up on PATH: keep it as typed
            value = target[s.name]
            target[s.name] = given if given is not None else (portable_path(value) if "/" in value else value)
        return d

    def fingerprint(self, schema: int = FINGERPRINT_SCHEMA) -> str:
        """Hash of everything that changes the results (not where they are written, nor how a server
        is reached), by the rules of ``schema`` (a record's ``fingerprint_schema``)."""
        return _fingerprint(self.normalized().dump(schema))

    def rollout_fingerprint(self, schema: int = FINGERPRINT_SCHEMA) -> str:
        """Hash of what decides the rollouts (model, prompts, engine, sampling), not how they are scored."""
        return rollout_fingerprint(self.normalized().dump(schema))

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
                if patch is not None and patch.model_fields_set:
                    setattr(spec, section, _merged(getattr(spec, section), patch))  # checked at load
            out.append((v.name, spec))
        return out


def _merged(current: BaseModel, patch: _Patch) -> BaseModel:
    return type(current).model_validate({**current.model_dump(), **patch.model_dump()})


def _as_of(d: dict[str, Any], schema: int) -> dict[str, Any]:
    """A dumped spec as a record of ``schema`` holds it (see :meth:`ProbeSpec.dump`). A [sync]
    table that syncs nothing is left out, so such a spec records and fingerprints as before [sync]."""
    d = json.loads(json.dumps(d))  # a copy
    if isinstance(d.get("sync"), dict) and d["sync"].get("start_from") is None:
        del d["sync"]
    for s in spec_settings().values():
        target = d.get(s.section) if s.section else d
        if isinstance(target, dict) and schema < s.info.since and s.name in target and target[s.name] == s.default:
            del target[s.name]
    return d


def _kept(d: dict[str, Any], affects: tuple[str, ...]) -> dict[str, Any]:
    """The settings of a dumped spec that affect one of ``affects`` (keys the dict lacks stay absent)."""
    kept: dict[str, Any] = {}
    for s in spec_settings().values():
        source = (d.get(s.section) or {}) if s.section else d
        if s.info.affects in affects and s.name in source:
            (kept.setdefault(s.section, {}) if s.section else kept)[s.name] = source[s.name]
    return kept


def _hash(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _fingerprint(d: dict[str, Any]) -> str:
    """:meth:`ProbeSpec.fingerprint` of a dumped spec: its settings that affect the rollouts or the
    run, and its ``[[variants]]`` and ``[sweep]`` tables."""
    kept = _kept(d, ("rollouts", "run"))
    for section in SECTIONS:
        if isinstance(d.get(section), dict):
            kept.setdefault(section, {})
    kept.update({k: d[k] for k in ("variants", "sweep") if k in d})
    return _hash(kept)


def rollout_fingerprint(spec_dict: dict[str, Any]) -> str:
    """:meth:`ProbeSpec.rollout_fingerprint` of a dumped spec (e.g. a run.json's ``spec``, which
    older records without a ``rollout_fingerprint`` need). Every top-level key that decides the
    rollouts is in the hash, null when absent, as the first records computed it."""
    kept = _kept(spec_dict, ("rollouts",))
    for s in spec_settings().values():
        if not s.section and s.info.affects == "rollouts":
            kept.setdefault(s.name, None)
    kept.setdefault("engine", {})
    kept.setdefault("sampling", spec_dict.get("sampling"))
    return _hash(kept)


# ---- the settings, as the rest of the package reads them -----------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting of the spec: where it is (``sampling.top_p``), its field and its :class:`SettingInfo`."""

    key: str  # "sampling.top_p"; a top-level setting by its name alone ("model")
    section: str  # "sampling"; "" for a top-level setting
    name: str
    field: FieldInfo
    info: SettingInfo

    @property
    def default(self) -> Any:
        return self.field.get_default(call_default_factory=True)

    @property
    def annotation(self) -> Any:
        return self.field.annotation

    @property
    def value_types(self) -> tuple[Any, ...]:
        """The types a value may have, ``None`` left out: ``(float,)`` for ``float | None``."""
        return tuple(t for t in typing.get_args(self.annotation) or (self.annotation,) if t is not type(None))

    @property
    def choices(self) -> tuple[Any, ...]:
        """The values a message lists: the declared ones, else the type's ``Literal`` values."""
        return self.info.choices or literal_values(self.annotation)

    @property
    def help(self) -> str:
        return self.field.description or ""


def _settings_of(model: type[BaseModel], section: str) -> Iterator[Setting]:
    for name, field in model.model_fields.items():
        info = info_of(field)
        if info is not None:
            yield Setting(f"{section}.{name}" if section else name, section, name, field, info)


@functools.cache
def spec_settings() -> dict[str, Setting]:
    """Every setting of the spec, by dotted key, in declaration order (top level first)."""
    found = list(_settings_of(ProbeSpec, ""))
    for section, model in SECTIONS.items():
        found += _settings_of(model, section)
    return {s.key: s for s in found}


def flag_of(key: str) -> str:
    """The CLI flag of a setting as people type it: ``--top-p``, ``--packing/--no-packing``."""
    return spec_settings()[key].info.flag


def engine_settings(engine: str) -> frozenset[str]:
    """The ``[engine]`` settings ``engine`` honours beyond those every engine honours."""
    return frozenset(
        s.name
        for s in spec_settings().values()
        if s.section == "engine" and s.info.engines is not None and engine in s.info.engines
    )


def engine_arguments(engine: str) -> dict[str, tuple[str, ...]]:
    """The ``[engine]`` settings that ``engine`` takes as arguments of its own, each with its
    argument name(s), in declaration order: ``{"max_num_seqs": ("max_running_requests",), ...}``
    (the declarations' ``engine_args``). The adapters build their arguments, and read back what the
    engine resolved, by these names; how a value converts is the adapter's."""
    return {
        s.name: s.info.args_of(engine)
        for s in spec_settings().values()
        if s.section == "engine" and s.info.args_of(engine)
    }


COMMON_ENGINE_SETTINGS = frozenset(
    s.name for s in spec_settings().values() if s.section == "engine" and s.info.engines is None
)
# where the engine's ranks go across GPUs and nodes (docs/engines-multinode.md)
LAYOUT_SETTINGS = tuple(s.name for s in spec_settings().values() if s.section == "engine" and s.info.group == LAYOUT)
# How a remote engine reaches its server, not what the server samples: a run resumes, and shares its
# rollouts, when the server comes back at another address or under another name, or with other timeouts.
CLIENT_SETTINGS = tuple(
    s.name for s in spec_settings().values() if s.section == "engine" and s.info.affects == "nothing"
)


# ---- reading a spec ------------------------------------------------------------------------------


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
        at_key = loc if key is None else (*loc, *key) if isinstance(key, tuple) else (*loc, key)
        return ConfigError(f"{at(at_key)}: {message}", hint=hint)
    what = phrase(err, _choices(loc))
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


def _choices(loc: tuple[str | int, ...]) -> tuple[Any, ...]:
    """What a message about the value at ``loc`` lists as accepted (a setting's declared choices)."""
    key = _dotted(loc)
    if loc and loc[0] == "variants" and len(loc) >= 4:
        key = _dotted(loc[2:])
    s = spec_settings().get(key)
    return s.choices if s is not None else choices_of(ProbeSpec, loc)


def _known(loc: tuple[str | int, ...]) -> list[str]:
    """The keys of the table that holds ``loc``'s last key."""
    model = model_at(ProbeSpec, loc[:-1])
    return list(model.model_fields) if model is not None else []


def _dotted(loc: tuple[str | int, ...] | Any) -> str:
    return ".".join(str(p) for p in loc)


def spec_from_dict(
    data: dict[str, Any], *, base_dir: Path | None = None, source: str = "spec", text: str | None = None
) -> ProbeSpec:
    """Build a spec from nested dicts (a parsed TOML file, ``text`` its source for line numbers);
    unknown keys are errors."""
    data = dict(data)
    given: dict[str, str] = {}
    if base_dir is not None:
        for s in spec_settings().values():
            if not s.info.path:
                continue
            table = data if not s.section else data.get(s.section)
            value = table.get(s.name) if isinstance(table, dict) else None
            if not isinstance(value, str) or value in s.info.choices:  # a word it takes in a path's place
                continue
            if s.key == "engine.python" and "/" not in value:
                continue  # a bare name (python3) is looked up on PATH
            given[s.key] = value
            # not resolve() for the python: a venv's bin/python is a symlink whose target is not the venv
            resolved = (
                os.path.abspath(base_dir / value) if s.key == "engine.python" else str((base_dir / value).resolve())
            )
            if s.section:
                data[s.section] = {**table, s.name: resolved if not Path(value).is_absolute() else value}  # type: ignore[dict-item]
            else:
                data[s.name] = resolved if not Path(value).is_absolute() else value
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


# How an override names its setting in a message: by its flag (compare --top-p 2), by ``--set``
# (score --set reference.dtype=x), or by its key (a sweep axis).
NAMED_BY: dict[str, Callable[[str], str]] = {
    "flag": flag_of,
    "set": lambda key: f"--set {key}",
    "key": lambda key: key,
}


def apply_overrides(
    spec: ProbeSpec,
    overrides: dict[str, Any],
    *,
    named_by: Literal["flag", "set", "key"] | Callable[[str], str] = "flag",
    base_dir: Path | None = None,
) -> ProbeSpec:
    """A new spec: ``spec`` with ``{"field": v}`` / ``{"section.field": v}`` overrides (flags, ``--set``,
    a sweep axis) applied; ``None`` means unset. The result is validated as a whole, so two settings
    that only hold together can be given together; an error names the setting ``named_by`` says.
    A relative path is relative to ``base_dir`` (a sweep axis: its spec file's directory), else to
    the working directory."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return spec
    settings = spec_settings()
    for key in given:
        if key not in settings:
            section, _, leaf = key.rpartition(".")
            known = [s.name for s in settings.values() if s.section == section]
            raise unknown_key(leaf, known, "override")
    data = spec.model_dump()
    paths = dict(spec.given_paths)
    for key, value in given.items():
        s = settings[key]
        if (
            s.info.path
            and isinstance(value, str)
            and value not in s.info.choices
            and (key != "engine.python" or "/" in value)
        ):
            paths[key] = value  # as typed, relative to base_dir or the working directory
            at = Path(base_dir or ".") / value
            # not resolve() for the python: a venv's bin/python is a symlink whose target is not the venv
            value = os.path.abspath(at) if key == "engine.python" else str(at.resolve())
        target = data[s.section] if s.section else data
        if isinstance(value, dict) and isinstance(target.get(s.name), dict):
            value = {**target[s.name], **value}  # a table's keys given as flags add to the file's
        target[s.name] = value
    try:
        fresh = ProbeSpec.model_validate(data)
    except ValidationError as exc:
        err = first_error(exc)
        if is_rule(err):
            message, _, hint = rule_parts(err)
            raise ConfigError(message, hint=hint) from None
        key = _dotted(err["loc"])
        name_of = named_by if callable(named_by) else NAMED_BY[named_by]
        name = name_of(key) if key in given else flag_of(key) if key in settings else key
        raise ConfigError(f"{name} {phrase(err, _choices(tuple(err['loc'])))}") from None
    fresh._given_paths = paths
    return fresh

"""``[engine]``: the engine's settings, each declared once (``config/settings.py: setting``) with its
flag, the engines that honour it and their own argument names (``engine_args``)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    field_validator,
    model_validator,
)

from mismatch_probe.config.choices import (
    DTYPES,
    ENGINE,
    LAYOUT,
    REMOTE,
    AttnImplementation,
    Device,
    EngineDtype,
    ExecutorBackend,
    LogprobsMode,
    RemoteApi,
    SpecTable,
)
from mismatch_probe.config.remote_dialects import api_help
from mismatch_probe.config.settings import EVERY_ENGINE, setting
from mismatch_probe.config.validation import (
    rule_error,
)

# ---- the tables -------------------------------------------------------------------------------


def bare_name(value: str) -> bool:
    """A name, not a path (no ``/``): an engine interpreter given so (``python3``) is looked up on PATH
    when the spec is normalized, and recorded as typed rather than relative to the spec file."""
    return "/" not in value


class EngineSpec(SpecTable):
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

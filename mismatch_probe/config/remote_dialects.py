"""The remote engine's dialects, one line each: the one list ``engine.api`` chooses from.

A dialect is the API of a kind of rollout server (engines/remote/: ARCHITECTURE.md, Engine contract).
Each line names the dialect class (``"module:Class"``, imported only when a run talks to such a
server: ``engines/remote/dialect.py: dialect_class``), the server that speaks it, the route it
samples through, and what the server's log-probs are when nobody asks. Read from here: the choices
of ``engine.api`` and its help (so the CLI, docs/settings.md and the JSON Schema), each dialect's
default ``engine.logprobs_mode`` (``config/choices.py: ENGINE_DEFAULT_LOGPROBS_MODE``) and the ``remote``
engine's description in ``mismatch-probe engines``. The list lives in the config layer because the
spec's declaration reads it (ARCHITECTURE.md, Layers); what each dialect does is in its module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RemoteDialectEntry:
    target: str  # the dialect class, "module:Class"
    server: str  # what runs it, as people call it
    route: str  # the route it samples through (and what goes in, where that is not token ids)
    logprobs_mode: Literal["raw", "processed"] = (
        "raw"  # what the server's log-probs are when nobody asks (LogprobsMode)
    )


REMOTE_DIALECTS: dict[str, RemoteDialectEntry] = {
    "openai": RemoteDialectEntry("mismatch_probe.engines.remote.openai:OpenAIDialect", "vllm serve", "/v1/completions"),
    # SGLang's sampler returns log_softmax(logits / T)
    "sglang": RemoteDialectEntry(
        "mismatch_probe.engines.remote.sglang:SGLangDialect", "SGLang", "/generate", "processed"
    ),
    # ms-swift forces vLLM's processed_logprobs (swift/pipelines/infer/rollout.py: get_infer_engine)
    "swift": RemoteDialectEntry(
        "mismatch_probe.engines.remote.swift:SwiftDialect",
        "ms-swift's swift rollout",
        "/infer/, chat messages in",
        "processed",
    ),
    # trl vllm-serve starts vLLM with --logprobs-mode processed_logprobs (trl/scripts/vllm_serve.py: build_command)
    "trl": RemoteDialectEntry(
        "mismatch_probe.engines.remote.trl:TRLDialect", "TRL's trl vllm-serve", "/v1/completions", "processed"
    ),
}


def one_of(parts: list[str]) -> str:
    """``a, b or c``."""
    return f"{', '.join(parts[:-1])} or {parts[-1]}" if len(parts) > 1 else "".join(parts)


def api_help() -> str:
    """The help of ``engine.api``: each dialect's name, server and route."""
    return "The server's API: " + one_of([f"{n} ({d.server}: {d.route})" for n, d in REMOTE_DIALECTS.items()]) + "."


def servers_described(flag: str) -> str:
    """The servers the remote engine talks to, each with the value of ``flag`` (``engine.api``'s) that names it."""
    return one_of([f"{d.server} ({flag} {n})" for n, d in REMOTE_DIALECTS.items()])

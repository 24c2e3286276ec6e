"""The engine adapter interface: token ids in, sampled token ids and their log-probs out."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, Protocol, cast, runtime_checkable

import numpy as np

from mismatch_probe.config.keys import did_you_mean
from mismatch_probe.config.spec import LogprobsMode, SamplingSpec, SyncSpec
from mismatch_probe.errors import ConfigError
from mismatch_probe.modeling.logprobs import LogprobSemantics, engine_semantics


def batch_seed(seed: int, batch_key: int | str) -> int:
    """A per-batch (or per-request, or per-tensor) seed, so a resumed run draws the same samples as an
    uninterrupted one."""
    digest = hashlib.sha256(f"{seed}:{batch_key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class GenerationRequest:
    prompt_token_ids: np.ndarray  # int32
    max_tokens: int
    # the chat the ids were rendered from (the prompt's messages, then each turn so far), for a
    # server that takes messages and renders them itself (ms-swift's swift rollout); None: ids only
    messages: list[dict] | None = None


@dataclass
class Completion:
    token_ids: np.ndarray  # int32, the sampled tokens (stop token included when it ended the turn)
    logprobs: np.ndarray  # float32, log-prob of each sampled token, looked up by its id
    finish_reason: str  # "stop" or "length"
    prompt_token_ids: np.ndarray | None = None  # what the engine says it was given, when it says
    experts: np.ndarray | None = None  # int16 [tokens, moe_layers, top_k]: routing behind each token


@dataclass
class ScoreRequest:
    """Score ``token_ids[start:]``, each token given all the ids before it, in one prefill."""

    token_ids: np.ndarray  # int32, the full sequence
    start: int  # >= 1


# ---- what an engine can do (ARCHITECTURE.md, Engine contract) ----------------------------------


@dataclass(frozen=True)
class SelfFlush:
    """An event after which the engine flushes its prefix cache by itself, so a [sync] table that
    keeps the cache (``sync.reset_prefix_cache = false``) cannot be honoured with it."""

    when: Literal["disk", "sleep"]  # a disk transfer; the colocate cycle (sync.sleep_level)
    event: str  # "after update_weights_from_disk": where the message places it
    by: str  # where the engine's source does it (the evidence, recorded with each sync)
    hint: str


@dataclass(frozen=True)
class SyncSupport:
    """The weight-update path an engine offers a ``[sync]`` probe (ARCHITECTURE.md, Weight sync)."""

    transfers: tuple[str, ...]  # the sync.transfer values mismatch-probe drives through it: "tensor", "disk"
    nccl: str  # the engine's own NCCL path, named when sync.transfer = "nccl" is refused
    refused: Mapping[str, str] = field(default_factory=dict)  # another transfer -> why it cannot be driven
    nccl_group: str = "the engine's"  # whose NCCL group a trainer process would have to join
    sleep_levels: tuple[int, ...] = (1, 2)  # sync.sleep_level values it honours (the colocate cycle)
    sleep_cpu_refusal: str | None = None  # why the colocate cycle cannot run on CPU (None: it can)
    cache: str = "prefix cache"  # what the engine calls the cache sync.reset_prefix_cache resets
    flushes: tuple[SelfFlush, ...] = ()  # when the engine flushes that cache by itself
    # why the weights reach one data-parallel replica only through these transfers (None: every replica)
    single_replica: str | None = None
    single_replica_transfers: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond ``generate``, declared as data by each adapter (its class
    attribute ``capabilities``; a remote engine's by its dialect). The worker reads it once, sends it
    in its start reply, and ``EngineProcess.capabilities`` carries it to the stages: nothing else
    probes an engine for methods."""

    prefill: bool = False  # prefill_logprobs: re-scores given tokens in one prefill (decode vs prefill)
    prefill_unavailable: str | None = None  # why not, when not (None: the generic sentence)
    keeps_state: bool = False  # keeps state between calls (a remote engine's journal): gets a state_dir
    weight_digest: bool = False  # weight_digest: its parameters as weight_sync.module_digest digests them
    logprobs_mode: LogprobsMode = "raw"  # what its log-probs are when engine.logprobs_mode is unset
    # "processed" log-probs: after temperature, top-k and top-p ("all"), or after temperature only
    # (SGLang's sampler: top-k/top-p shape the draw, not the log-probs it returns)
    processed_by: Literal["all", "temperature"] = "all"
    sync: SyncSupport | None = None  # the weight-update path ([sync]); None: it has none
    sync_unavailable: str | None = None  # why it has none (None: the generic sentence)
    sync_hint: str = "sync with the vllm or sglang engine, or a remote SGLang server"

    def why_no_prefill(self, engine: str) -> str:
        return self.prefill_unavailable or f"the {engine} engine cannot re-score sequences with its own prefill"

    def semantics(self, mode: LogprobsMode | None, sampling: SamplingSpec) -> LogprobSemantics:
        """What the engine's log-probs are under ``mode`` (unset: its default) and these sampling settings."""
        mode = mode or self.logprobs_mode
        if self.processed_by == "temperature":
            if mode == "raw" or sampling.temperature <= 0:
                return LogprobSemantics("raw")
            return LogprobSemantics("processed", sampling.temperature, 0, 1.0)
        return engine_semantics(mode, sampling.temperature, sampling.top_k, sampling.top_p)

    def to_header(self) -> dict:
        """As the worker sends it (JSON)."""
        return asdict(self)

    @classmethod
    def from_header(cls, header: dict) -> EngineCapabilities:
        sync = header.get("sync")
        if sync is not None:
            flushes = tuple(SelfFlush(**f) for f in sync.get("flushes", ()))
            tuples = {k: tuple(sync[k]) for k in ("transfers", "sleep_levels", "single_replica_transfers") if k in sync}
            sync = SyncSupport(**{**sync, **tuples, "flushes": flushes})
        return cls(**{**header, "sync": sync})


# An adapter that declares nothing optional: generate, semantics, info and close only.
NOTHING_OPTIONAL = EngineCapabilities()


def check_sync(
    sync: SyncSpec,
    capabilities: EngineCapabilities,
    *,
    engine: str,
    on_cpu: bool | None,
    data_parallel_size: int = 1,
) -> None:
    """What ``engine`` (as messages name it: ``"vLLM 0.32.0"``, ``"an SGLang server"``) cannot do of a
    [sync] table, by what it declares; raises :class:`ConfigError` before the engine starts or any
    request is sent. ``on_cpu``: None where not known yet (a server not read: check again once it is)."""
    support = capabilities.sync
    if support is None:
        raise ConfigError(
            f"[sync] on {engine}: {capabilities.sync_unavailable or 'it has no weight-update path'}",
            hint=capabilities.sync_hint,
        )
    transfers = " or ".join(support.transfers)
    if sync.transfer == "nccl":
        raise ConfigError(
            f"sync.transfer = 'nccl' on {engine} ({support.nccl}) is not driven by mismatch-probe yet: it needs "
            f"a trainer process in {support.nccl_group} NCCL group" + (", and NCCL needs GPUs" if on_cpu else ""),
            hint=f"--sync-transfer {transfers}"
            + ("" if on_cpu else "; measure the path with it: the NCCL leg adds no rounding of its own"),
        )
    if sync.transfer not in support.transfers:
        why = support.refused.get(sync.transfer, f"mismatch-probe drives {transfers} only")
        raise ConfigError(f"sync.transfer = {sync.transfer!r} on {engine}: {why}", hint=f"--sync-transfer {transfers}")
    if sync.sleep_level and on_cpu and support.sleep_cpu_refusal:
        raise ConfigError(f"{engine}: {support.sleep_cpu_refusal}", hint="drop --sync-sleep-level on CPU")
    if sync.sleep_level and sync.sleep_level not in support.sleep_levels:
        raise ConfigError(
            f"{engine} has no colocate cycle at sync.sleep_level {sync.sleep_level}",
            hint=f"--sync-sleep-level {' or '.join(map(str, support.sleep_levels))}"
            if support.sleep_levels
            else "drop --sync-sleep-level",
        )
    if data_parallel_size > 1 and support.single_replica and sync.transfer in support.single_replica_transfers:
        others = [t for t in support.transfers if t not in support.single_replica_transfers]
        raise ConfigError(
            f"{engine}: {support.single_replica}; data_parallel_size is {data_parallel_size}",
            hint=f"--sync-transfer {' or '.join(others)}, or data_parallel_size 1"
            if others
            else "run [sync] with data_parallel_size 1",
        )
    if not sync.reset_prefix_cache:
        for flush in support.flushes:
            if (flush.when == "disk" and sync.transfer == "disk") or (flush.when == "sleep" and sync.sleep_level):
                setting = "sync.transfer = 'disk'" if flush.when == "disk" else "sync.sleep_level"
                raise ConfigError(
                    f"{engine} flushes its {support.cache} by itself {flush.event} ({flush.by}), so "
                    f"sync.reset_prefix_cache = false cannot be honored with {setting}",
                    hint=flush.hint,
                )


@runtime_checkable
class Engine(Protocol):
    """What every engine adapter provides. One instance is reused for the whole run."""

    name: str
    # what it can do beyond generate: class data (an instance may narrow it: a remote engine's dialect)
    capabilities: EngineCapabilities

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        sampling: SamplingSpec,
        *,
        stop_token_ids: Sequence[int],
        seed: int,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Sample one completion per request, in request order. ``seed`` makes it repeatable."""
        ...

    def semantics(self, sampling: SamplingSpec) -> LogprobSemantics:
        """What the returned log-probs are log-probs of, under these sampling settings."""
        ...

    def info(self) -> dict:
        """Settings actually in effect and library versions, for run.json."""
        ...

    def close(self) -> None:
        """Release the model and its memory (before the reference forward needs it)."""
        ...


class PrefillScorer(Protocol):
    """Optional: engines that can re-score sequences with their own prefill (decode vs prefill)."""

    def prefill_logprobs(
        self, requests: Sequence[ScoreRequest], on_progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        """Raw log-probs (log_softmax of the logits) of ``token_ids[start:]``, float32, per request."""
        ...


def prefill_scorer(engine: Engine) -> PrefillScorer:
    """``engine`` as the prefill scorer its capabilities declare it is (``capabilities.prefill``)."""
    if not engine.capabilities.prefill:
        raise ConfigError(engine.capabilities.why_no_prefill(engine.name), hint="--no-prefill-check")
    return cast(PrefillScorer, engine)


def check_extra_args(
    extra_args: Mapping, known: Collection[str], set_here: Collection[str], engine: str, args_class: str
) -> None:
    """``[engine.extra_args]`` go to the engine's own constructor, so each must be an argument the
    installed engine has (a typo would otherwise fail deep inside it, or be silently ignored) and
    not one mismatch-probe already sets from a dedicated setting (which would be recorded wrong)."""
    for key in extra_args:
        if key not in known:
            raise ConfigError(
                f"engine.extra_args: {engine} has no argument {key!r} ({args_class})",
                hint=did_you_mean(key, known, otherwise=f"see {args_class}"),
            )
        if key in set_here:
            raise ConfigError(
                f"engine.extra_args sets {key!r}, which mismatch-probe sets itself",
                hint="use the dedicated engine setting (see mismatch-probe compare --help)",
            )

"""The engine adapter interface: token ids in, sampled token ids and their log-probs out."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from mismatch_probe.config.keys import did_you_mean
from mismatch_probe.config.spec import SamplingSpec
from mismatch_probe.errors import ConfigError
from mismatch_probe.modeling.logprobs import LogprobSemantics


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


@runtime_checkable
class Engine(Protocol):
    """What every engine adapter provides. One instance is reused for the whole run."""

    name: str

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

"""What a dialect of the remote engine is, and how it reaches its server.

A dialect (one module each beside this one, listed in ``config/remote_dialects.py``) holds everything
that is particular to one kind of server: its routes, the bodies it sends and how it reads the
answers (:class:`Dialect`), what it reads back of the server (:class:`ServerInfo`), what its log-probs
are, and its weight-sync facts and operations. The engine (``engine.py``) knows none of them by
name: it looks the dialect up by ``engine.api`` (:func:`dialect_class`) and calls it. A dialect
reaches the server only through :class:`Session`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from mismatch_probe.config.remote_dialects import REMOTE_DIALECTS
from mismatch_probe.config.spec import SamplingSpec, SyncSpec, default_logprobs_mode
from mismatch_probe.engines.base import (
    Completion,
    EngineCapabilities,
    GenerationRequest,
    ScoreRequest,
    SyncSupport,
)
from mismatch_probe.engines.http_client import Client, server_message
from mismatch_probe.engines.routed_experts import MoeLayout
from mismatch_probe.errors import ConfigError, EngineError

# the text whose token ids the server's tokenizer must give as the checkpoint's does
TOKENIZER_PROBE = "mismatch-probe: The quick brown fox jumps over 13 lazy dogs. ünïcödé, 漢字, 🙂\n\tend"
# whose NCCL group a trainer process would join to send a server the weights (engines/base.py: check_sync)
SERVER_NCCL_GROUP = "the server's"


def dialect_class(api: str) -> type[Dialect]:
    """The dialect ``engine.api`` names, imported now (``config/remote_dialects.py`` lists them)."""
    module_name, _, class_name = REMOTE_DIALECTS[api].target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def recognize_server(session: Session) -> None:
    """A server that did not answer a dialect's own read: if another dialect's server is there,
    the :class:`ConfigError` that says so (each dialect's :meth:`Dialect.recognize`)."""
    for api in REMOTE_DIALECTS:
        found = dialect_class(api).recognize(session)
        if found is not None:
            raise found


class RouteFailed(EngineError):
    """A weight-sync route that answered with a refusal (its message is the server's)."""

    def __init__(self, message: str, *, status: int, hint: str = "see the server's log"):
        super().__init__(message, hint=hint)
        self.status = status


class Session:
    """The server as a dialect reaches it: reads through the client (with its retries), and the
    weight-sync calls, each sent once (an update is not retried: a timed-out one may still be
    running). ``routes_hint`` says how to get a route the server answers 404 to."""

    def __init__(self, client: Client, routes_hint: str = ""):
        self.client = client
        self.routes_hint = routes_hint

    def where(self, path: str) -> str:
        return self.client.where(path)

    def get(self, path: str, *, params: dict | None = None) -> tuple[int, object]:
        return self.client.get(path, params=params)

    def post(self, path: str, body: dict | None, *, params: dict | None = None) -> tuple[int, object]:
        """A POST that changes nothing on the server (a read), retried as a GET is."""
        return self.client.post(path, body, params=params)

    def update(self, path: str, body: dict | None, what: str, *, params: dict | None = None) -> object:
        """POST once and return the answer; a refusal is :class:`RouteFailed`."""
        ok, answer = self.try_update(path, body, what, params=params)
        if not ok:
            raise RouteFailed(
                f"{what}: the server at {self.where(path)} refused it: {self.client.redact(server_message(answer))}",
                status=answer.get("status", 0) if isinstance(answer, dict) else 0,
            )
        return answer

    def try_update(self, path: str, body: dict | None, what: str, *, params: dict | None = None) -> tuple[bool, object]:
        """POST once: ``(accepted, answer)``, refused on an HTTP error or ``"success": false``; a
        missing route is a :class:`ConfigError` that says how to get it."""
        status, answer = self.client.post(path, body, params=params, attempts=1)
        if status == 404:
            raise ConfigError(
                f"{self.where(path)} answered HTTP 404 to {what}: the server has no such route", hint=self.routes_hint
            )
        refused = status >= 400 or (isinstance(answer, dict) and answer.get("success") is False)
        if refused and not isinstance(answer, dict):
            answer = {"message": answer}
        if refused:
            answer = {**answer, "status": status}  # type: ignore[dict-item]
        return not refused, answer


class ServerInfo:
    """What the server says about itself, in the in-process engines' names where they have one."""

    def __init__(self, *, model: str, names: set[str], software: str | None, version: str | None):
        self.model = model  # the name requests carry
        self.names = names  # every name and path the server gives the model
        self.software = software  # "vllm", "sglang", "ms-swift", or None (another OpenAI-compatible server)
        self.version = version
        self.settings: dict = {}  # in the in-process engines' names
        self.raw: dict = {}  # as the server names them, by endpoint
        self.unknown: dict[str, str] = {}  # setting -> what would expose it
        self.architectures: list[str] | None = None
        self.tokenizer_probe: list[int] | None = None  # the server's ids of TOKENIZER_PROBE
        self.max_model_len: int | None = None


class Dialect:
    """A server's API. Subclasses set the routes and facts below and implement the codec, the
    read-back and, where the server can take the trainer's weights, the sync operations."""

    generate_path: str
    # the server takes chat messages and renders them itself (what to call it in messages); None: token ids
    renders_prompts: str | None = None
    prefill_unavailable: str | None = None  # why it cannot re-score given ids; None: it can
    routing: MoeLayout | None = None  # set when the server returns the routed experts of each answer
    routing_settings_hint = ""  # how to make the server say whether it returns routed experts

    # "processed" log-probs after temperature, top-k and top-p ("all") or temperature only (SGLang's)
    processed_by: Literal["all", "temperature"] = "all"

    # ---- weight sync: what the server can take (engines/base.py: SyncSupport), read by check_sync ----
    sync_server = ""  # the server, as a sync refusal names it
    sync: SyncSupport | None = None  # None: no [sync] can run through this server, for sync_unavailable
    sync_unavailable: str | None = None
    sync_hint: str = EngineCapabilities.sync_hint  # what to do instead, where it has no sync
    routes_hint = ""  # how to get the weight-sync routes on a server that lacks them

    def __init__(self, model_path: Path | None = None) -> None:
        """``model_path``: the checkpoint the server must serve (a dialect that reads it keeps it)."""

    # ---- what the server is ---------------------------------------------------------------------
    @classmethod
    def recognize(cls, session: Session) -> ConfigError | None:
        """The error that names this dialect when its kind of server is at ``session`` (asked when a
        server does not answer another dialect's read; GETs and reads only), else None."""
        return None

    def read_server(self, session: Session, served_model: str | None) -> ServerInfo:
        raise NotImplementedError

    def routing_unavailable(self, server: ServerInfo, session: Session) -> str | None:
        """Why this server's answers cannot carry routed experts (None: they can; ask for them)."""
        returns = server.settings.get("return_routed_experts")
        if returns:
            return None
        if returns is None:
            return (
                f"the server at {session.where('')} does not say whether it returns routed experts "
                f"({self.routing_settings_hint})"
            )
        return f"the server at {session.where('')} runs without --enable-return-routed-experts (restart it with it)"

    @classmethod
    def capabilities(cls, api: str) -> EngineCapabilities:
        """What a server of this dialect can do, in the engine contract's terms (engines/base.py)."""
        return EngineCapabilities(
            prefill=cls.prefill_unavailable is None,
            prefill_unavailable=cls.prefill_unavailable,
            keeps_state=True,  # the journal of answers received
            logprobs_mode=default_logprobs_mode("remote", api),
            processed_by=cls.processed_by,
            # a dialect that says why it has no sync has none, whatever the dialect it extends offers
            sync=None if cls.sync_unavailable else cls.sync,
            sync_unavailable=cls.sync_unavailable,
            sync_hint=cls.sync_hint,
        )

    def seeds_off_because(self, server: ServerInfo) -> str | None:
        """Why a request's own seed must not be sent to this server (None: it may)."""
        return None

    def honors_seeds(self, server: ServerInfo) -> bool:
        """Whether the server samples a seeded request with that seed."""
        return True

    def workarounds(self) -> dict:
        """run.json's ``engine.workarounds``: an engine bug this dialect works around, and how often."""
        return {}

    # ---- the codec ------------------------------------------------------------------------------
    def generate_body(
        self, model: str, r: GenerationRequest, sampling: SamplingSpec, stops: Sequence[int], seed: int | None
    ) -> dict:
        raise NotImplementedError

    def completion(self, answer: dict, request: GenerationRequest, where: str) -> Completion:
        raise NotImplementedError

    def prefill_body(self, model: str, r: ScoreRequest) -> dict:
        raise ConfigError(self.prefill_unavailable or "", hint="--no-prefill-check")

    def prefill(self, answer: dict, request: ScoreRequest, where: str) -> np.ndarray:
        raise ConfigError(self.prefill_unavailable or "", hint="--no-prefill-check")

    # ---- weight sync ----------------------------------------------------------------------------
    def sync_check(self, session: Session, server: ServerInfo, sync: SyncSpec) -> dict:
        """What this server cannot do of ``sync`` (read with GETs only); what the sync needs of it."""
        raise NotImplementedError

    def sleep_cycle(self, session: Session, level: int) -> dict:
        raise NotImplementedError

    def load_from_disk(self, session: Session, work_dir: str, sync: SyncSpec) -> dict:
        raise NotImplementedError

    def load_tensors(self, session: Session, named, sync: SyncSpec, server: dict) -> dict:
        raise NotImplementedError

    def reset_prefix_cache(self, session: Session) -> dict:
        raise NotImplementedError


# ---- what several dialects read the same way ------------------------------------------------------
def first_choice(answer: dict, where: str) -> dict:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineError(f"{where}: the answer has no choices: {str(answer)[:200]}")
    return choices[0]


def finish(reason, where: str) -> str:
    """An OpenAI-style ``finish_reason``: ``stop`` or ``length``, anything else an abort."""
    if reason in ("stop", "length"):
        return reason
    raise EngineError(
        f"{where} ended with finish_reason {reason!r}, not stop or length: the server aborted it",
        hint="see the server's log; a prompt over its context length or a KV cache too small are the usual causes",
    )


def first_found(session: Session, paths: Sequence[str]) -> dict | None:
    """The first of ``paths`` that answers a GET with a JSON object."""
    for path in paths:
        status, answer = session.get(path)
        if status == 200 and isinstance(answer, dict):
            return answer
    return None


def routed_rows(layout: MoeLayout, raw, decode, request: GenerationRequest, completion: Completion, where: str):
    """The routing behind each sampled token from a server's routed experts (asked for from the
    last prompt position), in the probe's rows; a server that returns none is an error: it said it would."""
    if raw is None:
        raise EngineError(f"{where}: the answer has no routed experts, though the server runs with them on")
    what = f"{where}: the server"
    n_prompt = len(request.prompt_token_ids)
    return layout.rows(decode(raw, what=what), n_prompt, n_prompt - 1, len(completion.token_ids), what=what)


def dtype_name(value) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")

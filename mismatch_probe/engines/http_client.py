"""JSON over HTTP to a running rollout server: bounded concurrency, per-request timeouts, retries
with backoff, and a journal of the answers received (ARCHITECTURE.md, Engine contract).

Why a journal: a server that dies mid-run (an OOM, a node drained, a restart) must not cost the
answers it already gave. Each answer is appended to ``received.jsonl`` (in the run directory's
``rollouts/.received/``) the moment it arrives, keyed by a hash of the exact request body; a
re-run sends only the bodies it has no answer for. The body carries the request's seed, so a
re-sent request asks for the same draw.

The API key travels only in the ``Authorization`` header: it is never part of a body, a key, a
message or a log line (:meth:`Client.redact` scrubs it from anything the server echoes back).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from mismatch_probe.errors import ConfigError

RETRY_STATUS = frozenset({408, 429})  # and every 5xx
BACKOFF_CAP_S = 30.0
POOL_CONNECTIONS = 8  # connections per httpx pool (see Client._post_many)
JOURNAL_FILE = "received.jsonl"
AUTH_HINT = "give the server's API key in the environment variable named by engine.api_key_env (--engine-api-key-env)"


def redact_url(url: str) -> str:
    """``url`` without a password in its user part (``http://user:***@host``), for records and messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def body_key(path: str, body: dict) -> str:
    """The journal key of a request: what is sent, where (the model name is left out, so a server
    restarted under another ``--served-model-name`` still matches)."""
    canonical = json.dumps({"path": path, **{k: v for k, v in body.items() if k != "model"}}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


class Journal:
    """Answers received, one JSON line each, appended as they arrive; a torn last line (the
    process killed mid-write) is ignored when read back."""

    def __init__(self, directory: str | Path | None):
        self.path = Path(directory) / JOURNAL_FILE if directory is not None else None
        self.answers: dict[str, dict] = {}
        if self.path is not None and self.path.is_file():
            with open(self.path, "rb") as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                        self.answers[entry["key"]] = entry["answer"]
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a kill
        self._file = None

    def __len__(self) -> int:
        return len(self.answers)

    def get(self, key: str) -> dict | None:
        return self.answers.get(key)

    def put(self, key: str, answer: dict) -> None:
        self.answers[key] = answer
        if self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")
            # after a torn line, start on a fresh one
            if self._file.tell() and not self.path.read_bytes().endswith(b"\n"):
                self._file.write(b"\n")
        self._file.write(json.dumps({"key": key, "answer": answer}, separators=(",", ":")).encode() + b"\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RequestFailed(Exception):
    """A request the server refused (not retried) or that failed every attempt."""

    def __init__(self, message: str, *, status: int | None = None, retried: bool = False):
        super().__init__(message)
        self.status = status
        self.retried = retried


@dataclass
class Client:
    """How to reach the server; one per engine, shared by every call."""

    url: str
    api_key: str | None = None
    timeout_s: float = 600.0
    max_concurrency: int = 256
    max_retries: int = 5
    backoff_s: float = 1.0
    verify: bool | str = True  # TLS verification; a path is a CA bundle
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def redact(self, text: str) -> str:
        text = str(text)
        if self.api_key:
            text = text.replace(self.api_key, "***")
        return text

    def where(self, path: str) -> str:
        return redact_url(self.url.rstrip("/") + path)

    def _tls(self):
        """httpx's ``verify``: True, False, or an SSL context trusting the CA bundle at ``verify``."""
        if isinstance(self.verify, str):
            import ssl

            return ssl.create_default_context(cafile=self.verify)
        return self.verify

    def _timeout(self):
        import httpx

        return httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 30.0))

    # ---- one-off requests (start-up: what the server is and how it runs) ------------------
    def get(self, path: str, *, params: dict | None = None, attempts: int = 3) -> tuple[int, object]:
        """``(status, parsed JSON or text)``; a connection failure raises :class:`ConfigError`
        (the server is not there: a wrong URL, or not started yet)."""
        return self._once("GET", path, None, params, attempts)

    def post(
        self, path: str, body: dict | None, *, params: dict | None = None, attempts: int = 3
    ) -> tuple[int, object]:
        return self._once("POST", path, body, params, attempts)

    def _once(self, method: str, path: str, body: dict | None, params: dict | None, attempts: int):
        import httpx

        last: Exception | None = None
        with httpx.Client(timeout=self._timeout(), verify=self._tls(), headers=self.headers) as http:
            for attempt in range(attempts):
                try:
                    reply = http.request(method, self.url.rstrip("/") + path, json=body, params=params)
                except httpx.TransportError as exc:
                    last = exc
                    time.sleep(min(BACKOFF_CAP_S, self.backoff_s * 2**attempt))
                    continue
                if reply.status_code in (401, 403):
                    raise ConfigError(
                        f"the rollout server at {self.where(path)} refused the request: HTTP {reply.status_code}: "
                        f"{self.redact(server_message(_parse(reply)))}",
                        hint=AUTH_HINT,
                    )
                return reply.status_code, _parse(reply)
        raise ConfigError(
            f"cannot reach the rollout server at {self.where(path)}: {self.redact(_describe(last))}",
            hint="start the server first (docs/how-to/live-server.md), or fix --engine-url",
        )

    # ---- many requests at once ------------------------------------------------------------
    def post_all(
        self,
        path: str,
        bodies: Sequence[dict],
        *,
        what: Callable[[int], str],
        journal: Journal | None = None,
        on_answer: Callable[[int, dict], None] | None = None,
    ) -> list[dict]:
        """POST every body (at most ``max_concurrency`` in flight) and return the JSON answers in
        order. Answers already in ``journal`` are not sent again; new ones are added to it as they
        arrive. ``on_answer(i, answer)`` runs as each arrives, before it is journaled: it may raise
        on an answer that cannot be used, which is then not kept (a re-run against a server set up
        right asks again). ``what(i)`` names request ``i`` in messages."""
        answers: list[dict | None] = [None] * len(bodies)
        keys = [body_key(path, b) for b in bodies]
        todo = []
        for i, key in enumerate(keys):
            known = journal.get(key) if journal is not None else None
            if known is None:
                todo.append(i)
                continue
            answers[i] = known
            if on_answer is not None:
                on_answer(i, known)
        if todo:
            asyncio.run(self._post_many(path, bodies, todo, keys, answers, what, journal, on_answer))
        return answers  # type: ignore[return-value]  # every slot is filled, or an error was raised

    async def _post_many(self, path, bodies, todo, keys, answers, what, journal, on_answer) -> None:
        import httpx

        # max_concurrency workers take requests off one queue. They share connection pools of
        # POOL_CONNECTIONS each: httpcore's pool scans all its connections for every request it
        # assigns, so one pool of 128 cost 7x the CPU per request of pools of 8 (bench_remote.py).
        queue = deque(todo)
        n_workers = min(self.max_concurrency, len(todo))
        limits = httpx.Limits(max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS)
        async with AsyncExitStack() as stack:
            pools = [
                await stack.enter_async_context(
                    httpx.AsyncClient(timeout=self._timeout(), verify=self._tls(), headers=self.headers, limits=limits)
                )
                for _ in range(-(-n_workers // POOL_CONNECTIONS))
            ]

            async def worker(k: int) -> None:
                http = pools[k // POOL_CONNECTIONS]
                while queue:
                    i = queue.popleft()
                    answer = await self._post_retrying(http, path, bodies[i], what(i))
                    answers[i] = answer
                    if on_answer is not None:
                        on_answer(i, answer)  # an answer that cannot be used raises before it is kept
                    if journal is not None:
                        journal.put(keys[i], answer)

            tasks = [asyncio.ensure_future(worker(k)) for k in range(n_workers)]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    async def _post_retrying(self, http, path: str, body: dict, what: str) -> dict:
        import httpx

        url = self.url.rstrip("/") + path
        for attempt in range(self.max_retries + 1):
            retry_after: float | None = None
            try:
                reply = await http.post(url, json=body)
            except httpx.TransportError as exc:  # refused, reset, timed out, cut off mid-answer
                reason = _describe(exc)
            else:
                if reply.status_code < 400:
                    answer = _parse(reply)
                    # an object; ms-swift's /infer/ answers with a list, one entry per request
                    if not isinstance(answer, (dict, list)):
                        raise RequestFailed(f"{what}: the server's answer is not JSON: {str(answer)[:200]}")
                    return answer  # type: ignore[return-value]
                reason = f"HTTP {reply.status_code}: {server_message(_parse(reply))}"
                if reply.status_code not in RETRY_STATUS and reply.status_code < 500:
                    raise RequestFailed(f"{what}: {self.redact(reason)}", status=reply.status_code)
                retry_after = _retry_after(reply.headers.get("retry-after"))
            if attempt == self.max_retries:
                raise RequestFailed(
                    f"{what} failed {attempt + 1} times; last: {self.redact(reason)}", retried=attempt > 0
                )
            delay = retry_after if retry_after is not None else self._backoff(attempt)
            self.log(f"{what}: {self.redact(reason)}; retry {attempt + 1}/{self.max_retries} in {delay:.1f} s")
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int) -> float:
        # exponential, with jitter so that many requests failing together do not return together
        return min(BACKOFF_CAP_S, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)


def _parse(reply) -> object:
    try:
        return reply.json()
    except ValueError:
        return reply.text


def server_message(answer: object) -> str:
    """The server's own error message: OpenAI's ``{"error": {"message": ...}}``, FastAPI's
    ``{"detail": ...}``, SGLang's ``{"error": ...}``, or the text."""
    if isinstance(answer, dict):
        err = answer.get("error", answer.get("detail", answer.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            answer = err
    return " ".join(str(answer).split())[:300]


def _describe(exc: Exception | None) -> str:
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in time ({type(exc).__name__})"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())[:300]


def _retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` in seconds (the date form is not used by rollout servers), capped."""
    try:
        return min(BACKOFF_CAP_S, max(0.0, float(value))) if value else None
    except ValueError:
        return None


def api_key_from(variable: str | None) -> str | None:
    """The key held by the environment variable the user named (``engine.api_key_env``)."""
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ConfigError(
            f"engine.api_key_env names {variable}, which is not set in this environment",
            hint=f"export {variable}=<the server's API key> before the run",
        )
    return key


__all__ = ["AUTH_HINT", "Client", "Journal", "RequestFailed", "api_key_from", "body_key", "redact_url"]

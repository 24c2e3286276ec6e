"""The parent's side of the engine worker (ARCHITECTURE.md, Engine contract): an :class:`Engine` that lives in a child process.

Why a process: vLLM and SGLang pin conflicting dependencies (``--engine-python`` runs the worker
from another venv), an engine holds most of the accelerator's memory until its process exits
(``close()`` waits for that, so the reference forward starts with the memory free), and an engine
crash must not take the parent's written results with it. The parent never imports the engine.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mismatch_probe.config.spec import EngineSpec, SamplingSpec, SyncSpec
from mismatch_probe.engines import wire
from mismatch_probe.engines.base import Completion, EngineCapabilities, GenerationRequest, ScoreRequest
from mismatch_probe.errors import ConfigError, EngineError, ProbeError
from mismatch_probe.files import portable_path
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.version import __version__

CLOSE_TIMEOUT_S = 120


class EngineProcess:
    """Start ``entry``'s adapter in a worker process and forward the Engine protocol to it."""

    def __init__(
        self,
        entry,
        model_path: str | Path,
        spec: EngineSpec,
        *,
        log_path: str | Path,
        trust_remote_code: bool = False,
        state_dir: str | Path | None = None,
        sync: SyncSpec | None = None,
    ):
        self.name = entry.name
        self.sync = sync if sync is not None and sync.enabled else None
        self.memory_hint = entry.memory_hint
        self.python = spec.python or sys.executable
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.peak_rss_mib: float | None = None
        self.exit_code: int | None = None
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== engine worker {entry.name}: {portable_path(self.python)} ===\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    [
                        self.python,
                        "-m",
                        "mismatch_probe.engines.worker",
                        "--requests-fd",
                        str(requests_r),
                        "--replies-fd",
                        str(replies_w),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=(requests_r, replies_w),
                    start_new_session=True,  # its own process group: close() can reap the engine's children too
                )
            except OSError as exc:
                for fd in (requests_r, requests_w, replies_r, replies_w):
                    os.close(fd)
                raise ConfigError(f"cannot run the engine python {self.python!r}: {exc.strerror}") from None
        os.close(requests_r)
        os.close(replies_w)
        self._requests = os.fdopen(requests_w, "wb")
        self._replies = os.fdopen(replies_r, "rb")

        try:
            # engine.checkpoint: the engine loads another export of the model (a quantized one)
            self._start(entry, spec.checkpoint or model_path, spec, trust_remote_code, state_dir)
        except BaseException:
            self._kill()  # a worker whose engine did not start must not linger
            raise

    def _start(self, entry, model_path, spec: EngineSpec, trust_remote_code: bool, state_dir) -> None:
        hello = self._reply("start-up", expect="hello")
        if hello.header.get("protocol") != wire.PROTOCOL_VERSION:
            raise ConfigError(
                f"the engine python {self.python} has mismatch-probe {hello.header.get('version')} "
                f"(worker protocol {hello.header.get('protocol')}), this one is {__version__} "
                f"(protocol {wire.PROTOCOL_VERSION})",
                hint=f"install the same mismatch-probe there: {self.python} -m pip install -e <this checkout>",
            )
        self.worker = {"python": hello.header["python"], "pid": hello.header["pid"], "version": hello.header["version"]}
        started = self._call(
            "start",
            {
                "target": entry.target,
                "model": str(model_path),
                "spec": spec.model_dump(),
                "trust_remote_code": trust_remote_code,
                "state_dir": str(state_dir) if state_dir is not None else None,
                "sync": self.sync.model_dump() if self.sync is not None else None,
            },
            expect="started",
        )
        # what the adapter declared it can do (engines/base.py: EngineCapabilities), as its worker reported it
        self.capabilities = EngineCapabilities.from_header(started.header["capabilities"])

    # ---- Engine protocol -----------------------------------------------------------------
    def semantics(self, sampling: SamplingSpec) -> LogprobSemantics:
        reply = self._call("semantics", {"sampling": sampling.model_dump()}, expect="semantics")
        return LogprobSemantics(**reply.header["semantics"])

    def info(self) -> dict:
        return self._call("info", {}, expect="info").header["info"]

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        sampling: SamplingSpec,
        *,
        stop_token_ids: Sequence[int],
        seed: int,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        reply = self._call(
            "generate",
            {
                "sampling": sampling.model_dump(),
                "stop_token_ids": [int(t) for t in stop_token_ids],
                "seed": seed,
            },
            wire.requests_to_table(list(requests)),
            expect="generated",
            on_progress=on_progress,
        )
        return wire.table_to_completions(reply.table)

    def prefill_logprobs(
        self, requests: Sequence[ScoreRequest], on_progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        reply = self._call(
            "prefill", {}, wire.score_requests_to_table(list(requests)), expect="prefilled", on_progress=on_progress
        )
        return wire.table_to_logprobs(reply.table)

    def sync_weights(
        self, weights_dir: str | Path, work_dir: str | Path, *, fault: str | None = None, transfer: str | None = None
    ) -> dict:
        """Push the checkpoint in ``weights_dir`` through the engine's own weight-update path
        (``[sync]``, given at the start; ``transfer`` another transfer for this sync only); the
        engine's report of what it did. ``fault``: tests only (``engines/weight_sync.py: FAULTS``)."""
        msg = self._call(
            "sync_weights",
            {"weights_dir": str(weights_dir), "work_dir": str(work_dir), "fault": fault, "transfer": transfer},
            expect="synced",
        )
        return msg.header["report"]

    def reset_prefix_cache(self) -> dict:
        return self._call("reset_prefix_cache", {}, expect="reset").header["report"]

    def weight_digest(self, path: str | Path) -> dict[str, np.ndarray]:
        """The engine's parameters as :func:`~mismatch_probe.engines.weight_sync.module_digest`
        digests them, passed through ``path`` (an ``.npz`` file)."""
        self._call("weight_digest", {"path": str(path)}, expect="digested")
        with np.load(path) as data:
            return {k: data[k] for k in data.files}

    def close(self) -> None:
        """Ask the engine to shut down and wait until its process (and its memory) is gone."""
        if self.proc.poll() is None:
            try:
                wire.send(self._requests, {"op": "close"})
                if self._wait_readable(CLOSE_TIMEOUT_S):
                    msg = wire.receive(self._replies)
                    if msg is not None and msg.header.get("op") == "closed":
                        self.peak_rss_mib = msg.header.get("peak_rss_mib")
                self.proc.wait(timeout=CLOSE_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self._kill()

    def describe(self) -> dict:
        # paths that travel with the record: the interpreter as seen from here, the log by its name
        # (it sits in the run directory)
        return {
            **self.worker,
            "python": portable_path(self.worker["python"]),
            "exit_code": self.exit_code,
            "peak_rss_mib": self.peak_rss_mib,
            "log": self.log_path.name,
        }

    # ---- plumbing ------------------------------------------------------------------------
    def _call(self, op: str, header: dict, table=None, *, expect: str, on_progress=None) -> wire.Message:
        try:
            wire.send(self._requests, {"op": op, **header}, table)
        except (BrokenPipeError, ValueError):
            raise self._died(op) from None
        return self._reply(op, expect=expect, on_progress=on_progress)

    def _reply(self, op: str, *, expect: str, on_progress=None) -> wire.Message:
        while True:
            msg = wire.receive(self._replies)
            if msg is None:
                raise self._died(op)
            kind = msg.header.get("op")
            if kind == "progress":
                if on_progress is not None:
                    on_progress(int(msg.header["n"]))
                continue
            if kind == "error":
                raise self._failed(msg.header)
            if kind != expect:
                raise EngineError(f"engine worker answered {kind!r} to {op!r} (expected {expect!r})")
            return msg

    def _failed(self, err: dict) -> ProbeError:
        """An exception inside the engine, with the engine's own message."""
        if err.get("probe_error"):  # raised by our adapter: already a message for people
            cls = ConfigError if err.get("exit_code") == ConfigError.exit_code else EngineError
            return cls(err["message"], hint=err.get("hint"))
        message = f"{self.name} engine failed during {err.get('during')}: {err['type']}: {err['message']}"
        cause = log_errors(self.log_path, exclude=err["message"])
        if cause:
            message += "\nengine log:\n  " + "\n  ".join(cause)
        if (
            self.memory_hint
            and err.get("during") == "start"
            and any(is_memory_refusal(m) for m in [err["message"], *cause])
        ):
            # the engine's message names its own flags; these are the ones that reach it through us
            return ConfigError(message, hint=f"{self.memory_hint}; full engine log: {self.log_path}")
        return EngineError(message, hint=f"full engine log: {self.log_path}")

    def _died(self, op: str) -> ProbeError:
        """The worker process is gone: say how it ended and what it last said."""
        try:
            self.exit_code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
        self._kill()
        code = self.exit_code
        how = f"exit code {code}"
        errors = log_errors(self.log_path)
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            # an engine that hit an error may kill its own process tree (SGLang does); only a
            # silent SIGKILL points at the kernel's OOM killer
            how = f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" and not errors else "")
        tail = errors or log_tail(self.log_path, 8)
        missing_module = next((line for line in tail if "No module named" in line), None)
        if op == "start-up" and missing_module:
            return ConfigError(
                f"the engine python {self.python} cannot run the engine worker ({missing_module})",
                hint=f"install mismatch-probe there: {self.python} -m pip install -e <this checkout>",
            )
        return EngineError(
            f"the {self.name} engine worker died during {op} ({how}); its last words:\n  " + "\n  ".join(tail),
            hint=f"full engine log: {self.log_path}",
        )

    def _wait_readable(self, timeout: float) -> bool:
        # Requests and replies alternate strictly, so nothing is left in the reader's buffer here.
        ready, _, _ = select.select([self._replies], [], [], timeout)
        return bool(ready)

    def _kill(self) -> None:
        """Make sure neither the worker nor anything it spawned outlives the engine."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group (engine-core processes)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait()
        self.exit_code = self.proc.returncode
        for stream in (self._requests, self._replies) if hasattr(self, "_replies") else ():
            try:
                stream.close()
            except OSError:
                pass


def is_memory_refusal(message: str) -> bool:
    """An engine refusing to start because the memory it was told to take is not there (vLLM:
    "Available memory on node 0 ... is less than desired CPU memory utilization", "No available
    memory for the cache blocks. Try increasing ...", "... larger than the available KV cache memory")."""
    m = message.lower()
    return ("memory" in m or "kv cache" in m) and any(
        k in m for k in ("less than", "insufficient", "not enough", "too large", "larger than", "increas", "decreas")
    )


_LOG_PREFIX = re.compile(r"^(\([^)]*\)\s*)?([A-Z]+ \d\d-\d\d [\d:.]+ \[[^\]]*\]\s*)?")
_ERROR_LINE = re.compile(r"^(\S+(Error|Exception|Exit)|RuntimeError|Killed|Segmentation fault)\b.*")


def log_tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return [line.rstrip() for line in lines if line.strip()][-n:]


def log_errors(path: Path, exclude: str | None = None, limit: int = 3) -> list[str]:
    """The last distinct exception lines of the engine log (the engine core's own error message)."""
    found: list[str] = []
    for line in reversed(log_tail(path, 400)):
        # engine processes prefix their lines, e.g.
        # "(VllmWorker-0 pid=12) ERROR 11-22 06:24:22 [multiproc_executor.py:953] ValueError: ..."
        text = _LOG_PREFIX.sub("", line).strip()
        if _ERROR_LINE.match(text) and text not in found and (not exclude or exclude[:200] not in text):
            found.append(text[:500])
            if len(found) == limit:
                break
    return found[::-1]

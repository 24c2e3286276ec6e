"""Servers for the remote engine's tests: the scripted one (tests/remote_server.py) and real vLLM /
SGLang servers, each on 127.0.0.1 with a free port, stopped (with every process they started) at exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process in its own process group, so that stopping it stops its children too."""

    def __init__(self, cmd: list[str], *, log: Path, env: dict | None = None, port: int | None = None):
        self.log = log
        self.port = port
        self._log_file = open(log, "ab")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE if port is None else self._log_file,
            stderr=self._log_file,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        if port is None:  # the scripted server picks a free port and says which
            line = self.proc.stdout.readline().decode()
            if not line.startswith("PORT "):
                self.stop()
                raise RuntimeError(f"the scripted server did not start: {line!r}; log: {log.read_text()[-2000:]}")
            self.port = int(line.split()[1])

    scheme = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def wait_ready(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited ({self.proc.returncode}); log tail:\n{self.log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"the server was not ready in {timeout_s} s; log tail:\n{self.log.read_text()[-3000:]}")

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=5, verify=False).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log_file.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def scripted_server(tmp_path: Path, *args: str) -> Server:
    """tests/remote_server.py with these options (see its docstring)."""
    log = tmp_path / f"scripted-server-{time.monotonic_ns()}.log"
    return Server([sys.executable, str(HERE / "remote_server.py"), "--port", "0", *args], log=log)


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made by the system's openssl."""
    cert, key = directory / "server.pem", directory / "server.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key

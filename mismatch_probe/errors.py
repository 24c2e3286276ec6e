"""Errors meant for people: one line that says what is wrong and how to fix it."""

from __future__ import annotations


class ProbeError(Exception):
    """A problem with the user's input or environment; the CLI prints it without a traceback.

    ``exit_code`` follows the CLI's convention: 2 for bad usage or configuration, 1 for a run that
    started and failed.
    """

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ConfigError(ProbeError):
    """Bad spec file, flag, prompt file or model path."""

    exit_code = 2


class DataError(ProbeError):
    """A table or log-prob array that violates the per-token table's contract (NaN, +inf, ...)."""

    exit_code = 1


class EngineError(ProbeError):
    """The inference engine failed or its worker process died; carries the engine's own message."""

    exit_code = 1

"""A Ray cluster for the work that spreads over machines (``sweep --executor ray``, ``timeline
--executor ray``): connecting with a one-line error, and handing work back as it finishes.

Ray is an optional extra (``pip install 'mismatch-probe[ray]'``), imported only here and only when
asked for. Every node needs this package and the paths the work names (a shared filesystem).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mismatch_probe.errors import ConfigError, ProbeError

MAX_RETRIES = 3  # a task whose worker died is run again; its work resumes from what is on disk


@contextmanager
def connected(address: str | None) -> Iterator[Any]:
    """The ``ray`` module, connected to the cluster at ``address`` (default: ``RAY_ADDRESS``, else a
    local one started for the block); disconnected after."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--executor ray needs Ray, which is not installed", hint="pip install 'mismatch-probe[ray]'"
        ) from None
    try:
        ray.init(address=address or os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"could not reach a Ray cluster at {address!r}: {str(exc).splitlines()[0]}",
            hint="start one with `ray start --head`, or pass its address with --ray-address",
        ) from None
    try:
        yield ray
    finally:
        ray.shutdown()


def finished(ray: Any, running: dict[Any, Any]) -> Iterator[tuple[Any, Any]]:
    """(what each task was submitted for, its result) as the tasks of ``running`` (object refs to
    anything) finish. A task's own error (a refused setting, a bad input) is raised as itself, its
    one line for people, not Ray's wrapping of it with the worker's traceback."""
    while running:
        ready, _ = ray.wait(list(running), num_returns=1)
        for ref in ready:
            key = running.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, ProbeError):
                    raise exc.cause from None
                raise
            yield key, result

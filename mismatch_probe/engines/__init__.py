"""Engine registry. Nothing here imports an engine library: entries name a module and the
packages it needs, and :func:`load_engine` imports the adapter only when a run asks for it.

Third-party adapters register through the ``mismatch_probe.engines`` entry-point group
(``name = "package.module:AdapterClass"``).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import entry_points

from ..errors import ConfigError
from .base import Completion, Engine, GenerationRequest

ENTRY_POINT_GROUP = "mismatch_probe.engines"


@dataclass(frozen=True)
class EngineEntry:
    name: str
    target: str  # "module:Class"
    requires: tuple[str, ...]  # importable top-level packages
    install_hint: str
    description: str

    def missing(self) -> list[str]:
        return [pkg for pkg in self.requires if importlib.util.find_spec(pkg) is None]


BUILTIN_ENGINES = {
    "hf": EngineEntry(
        name="hf",
        target="mismatch_probe.engines.hf:HFEngine",
        requires=("torch", "transformers"),
        install_hint="pip install mismatch-probe",
        description="Hugging Face transformers: batched sampling with a KV cache",
    ),
}


def registered_engines() -> dict[str, EngineEntry]:
    engines = dict(BUILTIN_ENGINES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        engines.setdefault(
            ep.name,
            EngineEntry(ep.name, ep.value, (), f"installed by {ep.dist.name if ep.dist else 'a plugin'}", "plugin"),
        )
    return engines


def get_entry(name: str) -> EngineEntry:
    engines = registered_engines()
    if name not in engines:
        close = difflib.get_close_matches(name, list(engines), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"available: {', '.join(sorted(engines))}"
        raise ConfigError(f"unknown engine {name!r}", hint=hint)
    return engines[name]


def load_engine(name: str) -> type:
    """The adapter class for ``name``; raises :class:`ConfigError` if its packages are missing."""
    entry = get_entry(name)
    missing = entry.missing()
    if missing:
        raise ConfigError(f"engine {name!r} needs {', '.join(missing)}, which is not installed", hint=entry.install_hint)
    module_name, _, class_name = entry.target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = [
    "BUILTIN_ENGINES", "Completion", "Engine", "EngineEntry", "GenerationRequest", "get_entry",
    "load_engine", "registered_engines",
]

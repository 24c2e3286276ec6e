"""The ``[sweep]`` table of a probe spec: which settings ``mismatch-probe sweep`` varies, and how.

    [sweep]
    mode = "one-at-a-time"         # or "grid": every combination of the axes' values
    repeats = 3                    # the baseline sampled this many times (seeds s, s+1, ...)

    [[sweep.axes]]
    key = "engine.dtype"           # any [engine], [reference], [sampling] or [corrections] setting
    values = ["bfloat16", "float32"]

    [[sweep.axes]]                 # or named levels, each setting several keys together
    name = "rollout"
    [sweep.axes.levels]
    bf16 = {}                                        # the spec as written
    fp16 = { "engine.dtype" = "float16" }
    W8A8 = { "engine.checkpoint" = "../fixtures/models/tiny-qwen2-w8a8" }

Only the table's shape is checked here; what each value means is checked by applying it to the
spec (``config.sweep.sweep_points``), with the same rules as the spec's own keys.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from mismatch_probe.config.validation import rule_error

SWEEP_MODES = ("one-at-a-time", "grid")


AxisValue = bool | int | float | str


def value_name(value: AxisValue) -> str:
    """How a value names its level: ``true``, ``float32``; an absolute path by its last part."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and value.startswith("/"):
        return value.rstrip("/").rpartition("/")[2] or value
    return str(value)


def _dotted(key: str) -> str:
    # which tables and settings may be axes is the spec's to say (ProbeSpec checks its [sweep])
    section, _, leaf = key.partition(".")
    if not section or not leaf:
        raise rule_error(f"sweep axis key {key!r} must name a setting as section.setting", hint="e.g. engine.dtype")
    return key


class SweepAxis(BaseModel):
    """One axis: a setting and its values (``key``, ``values``), or named levels that each set one
    or more settings together (``name``, ``levels``): a rollout precision is a dtype, a quantized
    checkpoint or a KV-cache dtype, and a grid over it should not cross them with each other."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    key: str | None = None
    values: list[AxisValue] | None = Field(default=None, min_length=1)
    name: str | None = None
    levels: dict[str, dict[str, AxisValue]] | None = Field(default=None, min_length=1)

    @field_validator("key")
    @classmethod
    def _key(cls, key: str | None) -> str | None:
        return key if key is None else _dotted(key)

    @field_validator("values")
    @classmethod
    def _distinct(cls, values: list[AxisValue] | None) -> list[AxisValue] | None:
        seen: list[AxisValue] = []
        for v in values or ():
            # 1 and true are equal in Python but not the same setting
            if any(type(v) is type(s) and v == s for s in seen):
                raise rule_error(f"the value {v!r} is listed twice")
            seen.append(v)
        return values

    @field_validator("levels")
    @classmethod
    def _level_keys(cls, levels: dict[str, dict[str, AxisValue]] | None) -> dict[str, dict[str, AxisValue]] | None:
        for label, settings in (levels or {}).items():
            if not label.strip():
                raise rule_error("a sweep level needs a name")
            for key in settings:
                _dotted(key)
        return levels

    @model_validator(mode="after")
    def _one_form(self) -> SweepAxis:
        if (self.key is None) == (self.name is None) or (self.key is None) != (self.values is None):
            raise rule_error(
                "a sweep axis is key = ... with values = [...], or name = ... with [levels]",
                hint='e.g. key = "engine.dtype", values = ["bfloat16", "float32"]',
            )
        if (self.name is None) != (self.levels is None):
            raise rule_error(f"the sweep axis {self.name!r} needs [levels]: name = {{ setting = value, ... }}")
        return self

    @model_serializer(mode="wrap")
    def _given_form(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # the other form's keys are left out, so a key/values axis dumps, and fingerprints, as it
        # did before named levels existed
        return {k: v for k, v in handler(self).items() if v is not None}

    @property
    def label(self) -> str:
        """What the axis is called on the page and in point names: its key or its name."""
        return self.key if self.key is not None else str(self.name)

    @property
    def keys(self) -> list[str]:
        """The settings the axis varies."""
        if self.key is not None:
            return [self.key]
        return list(dict.fromkeys(k for settings in (self.levels or {}).values() for k in settings))

    def options(self) -> list[tuple[str, dict[str, AxisValue]]]:
        """Each level: its name and the settings it makes."""
        if self.key is not None:
            return [(value_name(v), {self.key: v}) for v in self.values or ()]
        return [(label, dict(settings)) for label, settings in (self.levels or {}).items()]


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    mode: str = "one-at-a-time"
    # the baseline is sampled this many times with seeds seed, seed + 1, ...: the noise floor
    repeats: int = 3
    axes: list[SweepAxis] = Field(min_length=1)
    # re-score the baseline's sequences in other batch compositions and sample twice with one seed
    determinism: bool = True
    determinism_sequences: int = 32  # how many of the baseline's sequences the checks re-score
    n_boot: int = 1000  # bootstrap replicates per interval
    level: float = 0.95  # the intervals' coverage

    @field_validator("mode")
    @classmethod
    def _mode(cls, mode: str) -> str:
        if mode not in SWEEP_MODES:
            raise rule_error(f"sweep.mode is {mode!r}; choose {' or '.join(SWEEP_MODES)}")
        return mode

    @model_validator(mode="after")
    def _bounds(self) -> SweepSpec:
        if self.repeats < 1:
            raise rule_error(f"sweep.repeats must be >= 1, got {self.repeats}", key="repeats")
        if self.determinism_sequences < 1:
            raise rule_error("sweep.determinism_sequences must be >= 1", key="determinism_sequences")
        if self.n_boot < 100:
            raise rule_error(f"sweep.n_boot must be >= 100, got {self.n_boot}", key="n_boot")
        if not 0.5 <= self.level < 1.0:
            raise rule_error(f"sweep.level must be in [0.5, 1), got {self.level}", key="level")
        keys = [k for a in self.axes for k in a.keys]
        for key in keys:
            if keys.count(key) > 1:
                raise rule_error(f"the setting {key} is on two sweep axes", hint="give it on one axis")
        labels = [a.label for a in self.axes]
        for label in labels:
            if labels.count(label) > 1:
                raise rule_error(f"two sweep axes are called {label}", hint="give each axis its own name")
        return self

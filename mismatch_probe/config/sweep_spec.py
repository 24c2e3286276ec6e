"""The ``[sweep]`` table of a probe spec: which settings ``mismatch-probe sweep`` varies, and how.

    [sweep]
    mode = "one-at-a-time"         # or "grid": every combination of the axes' values
    repeats = 3                    # the baseline sampled this many times (seeds s, s+1, ...)

    [[sweep.axes]]
    key = "engine.dtype"           # any [engine], [reference], [sampling] or [corrections] setting
    values = ["bfloat16", "float32"]

Only the table's shape is checked here; what each value means is checked by applying it to the
spec (``config.sweep.sweep_points``), with the same rules as the spec's own keys.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mismatch_probe.config.validation import rule_error

SWEEP_MODES = ("one-at-a-time", "grid")


AxisValue = bool | int | float | str


class SweepAxis(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    key: str
    values: list[AxisValue] = Field(min_length=1)

    @field_validator("key")
    @classmethod
    def _dotted(cls, key: str) -> str:
        # which tables and settings may be axes is the spec's to say (ProbeSpec checks its [sweep])
        section, _, leaf = key.partition(".")
        if not section or not leaf:
            raise rule_error(f"sweep axis key {key!r} must name a setting as section.setting", hint="e.g. engine.dtype")
        return key

    @field_validator("values")
    @classmethod
    def _distinct(cls, values: list[AxisValue]) -> list[AxisValue]:
        seen: list[AxisValue] = []
        for v in values:
            # 1 and true are equal in Python but not the same setting
            if any(type(v) is type(s) and v == s for s in seen):
                raise rule_error(f"the value {v!r} is listed twice")
            seen.append(v)
        return values


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
        keys = [a.key for a in self.axes]
        for key in keys:
            if keys.count(key) > 1:
                raise rule_error(f"the sweep axis {key} is listed twice", hint="give it one list of values")
        return self

"""``sweep.json``: the record of a sweep, the source of truth its sweep.md and sweep.html render.

Each point is also a normal run directory (``points/<name>/run.json``); this record holds what
only the sweep knows: which points share tokens or an engine, the effects against the baseline with
their intervals, the noise floor, the determinism checks, cost and the recommendation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mismatch_probe.errors import ConfigError
from mismatch_probe.files import write_atomic
from mismatch_probe.record import json_safe

SWEEP_JSON = "sweep.json"
SWEEP_SCHEMA_VERSION = 1


class _Section(BaseModel):
    # later versions may add keys; this one keeps them
    model_config = ConfigDict(extra="allow")


class SweepPointRecord(_Section):
    name: str
    status: Literal["ok", "refused", "failed"]
    settings: dict[str, Any] = Field(default_factory=dict)  # what differs from the baseline
    levels: dict[str, str | None] = Field(default_factory=dict)  # its level on each axis, by axis label
    run: str | None = None  # its run directory, relative to the sweep directory
    reason: str | None = None  # refused or failed: the engine's (or the spec's) own message
    engine_config: str | None = None  # points with the same one shared an engine start
    rollouts_from: str | None = None  # the point whose tokens it re-scored (paired with it)
    metrics: dict[str, Any] = Field(default_factory=dict)
    corrections: dict[str, Any] = Field(default_factory=dict)  # run.json's: what each correction clips or drops
    intervals: dict[str, list[float | None]] = Field(default_factory=dict)  # [estimate, low, high]
    delta_vs_baseline: dict[str, dict[str, Any]] = Field(default_factory=dict)
    cost: dict[str, Any] = Field(default_factory=dict)
    gate: str | None = None  # PASS | WARN | FAIL | ERROR with --gate

    def effect(self, metric: str) -> dict[str, Any]:
        """The point's effect on ``metric`` against the baseline (``delta_vs_baseline``: ratio with its
        interval, within_noise); empty when not measured."""
        return self.delta_vs_baseline.get(metric) or {}


class SweepRecord(_Section):
    schema_version: int = SWEEP_SCHEMA_VERSION
    probe_version: str
    status: str  # running | complete
    spec_fingerprint: str
    spec: dict[str, Any]
    mode: str
    repeats: int
    level: float
    points: list[SweepPointRecord]
    noise_floor: dict[str, Any] = Field(default_factory=dict)
    determinism: dict[str, Any] | None = None
    recommendation: dict[str, Any] | None = None
    attribution: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    engine_configs: int = 0  # distinct engine configurations among the points
    # engines started, over every invocation that finished (a kill between start and summary is not counted)
    engine_starts: int = 0
    gate: dict[str, Any] | None = None  # the thresholds file and what it checks
    timings: dict[str, float] = Field(default_factory=dict)  # of the last invocation
    # each invocation that reached the summary: finished_at, engine_starts, timings
    invocations: list[dict[str, Any]] = Field(default_factory=list)

    def floor(self, metric: str) -> dict[str, Any]:
        """The noise floor of ``metric`` (``noise_floor.metrics``: its repeats' values, range, spread);
        empty when the sweep measured none."""
        metrics = self.noise_floor.get("metrics")
        floor = metrics.get(metric) if isinstance(metrics, dict) else None
        return floor if isinstance(floor, dict) else {}

    def gate_bounds(self) -> dict[str, Any]:
        """The thresholds the sweep's points were gated on (``gate.bounds``); empty without --gate."""
        bounds = self.gate.get("bounds") if self.gate else None
        return dict(bounds or {})

    def prefill_determinism(self, check: str) -> dict[str, Any] | None:
        """One of the baseline engine's prefill determinism checks (``determinism.prefill``), or None."""
        prefill = self.determinism.get("prefill") if self.determinism else None
        return prefill.get(check) if prefill else None

    def determinism_note(self, key: str) -> str | None:
        """A note of the determinism checks (``prefill_skipped``, ``same_seed_note``), or None."""
        return self.determinism.get(key) if self.determinism else None

    def repeat_values(self, metric: str) -> list[float]:
        """The finite values of ``metric`` over the baseline's repeats (the noise floor's runs)."""
        values = self.floor(metric).get("values") or []
        return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]

    def point(self, name: str) -> SweepPointRecord:
        for p in self.points:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(self.model_dump())

    def write(self, sweep_dir: Path) -> None:
        write_atomic(sweep_dir / SWEEP_JSON, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")


def read_sweep(sweep_dir: str | Path) -> SweepRecord:
    path = Path(sweep_dir) / SWEEP_JSON
    if not path.is_file():
        raise ConfigError(f"{sweep_dir} holds no sweep ({SWEEP_JSON} is missing)", hint="run mismatch-probe sweep")
    try:
        return SweepRecord.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ConfigError(f"{path} is not a sweep record this version reads: {exc}") from None

"""``timeline.json``: the record of a timeline, and the layout of its directory.

A timeline is the mismatch of an RL run over its training steps. ``steps.parquet`` holds one row
per step and turn group (``analysis/timeline.py: STEP_SCHEMA``); this record holds what only the
timeline knows: where the steps came from, which steps were kept as full run directories and why,
the drift test of each metric, and the gate's verdict. ``timeline.html`` and ``timeline.md`` render
it with ``steps.parquet``.

Layout (ARCHITECTURE.md, Timeline)::

    timeline.json            this record
    steps.parquet            every step's rows, sorted by step (rebuilt from steps/ after each pass)
    steps/step-NNNNNNNN.parquet   one step's rows, written atomically once the step is analysed
    runs/step-NNNNNNNN/      a full run directory of a step worth opening (first, last, worst, change)
    sequences/step-NNNNNNNN.parquet   a monitor's sampled sequences of a step (token by token)
    figures/*.svg, timeline.html, timeline.md
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mismatch_probe.errors import ConfigError
from mismatch_probe.files import write_atomic
from mismatch_probe.record import json_safe

TIMELINE_JSON = "timeline.json"
STEPS_PARQUET = "steps.parquet"
STEP_PARTS = "steps"
KEPT_RUNS = "runs"
SAMPLED_SEQUENCES = "sequences"
TIMELINE_SCHEMA_VERSION = 1


def step_name(step: int) -> str:
    return f"step-{step:08d}"


class _Section(BaseModel):
    # later versions may add keys; this one keeps them
    model_config = ConfigDict(extra="allow")


class KeptStep(_Section):
    step: int
    why: list[str]  # first | last | worst <metric> | change <metric> | all
    run: str | None = None  # its run directory, relative to the timeline directory (None: not written)
    reason: str | None = None  # why it has no run directory (no --model, the import failed)


class TimelineRecord(_Section):
    schema_version: int = TIMELINE_SCHEMA_VERSION
    probe_version: str
    status: str  # running | following | complete
    source: dict[str, Any]  # format, path (or "monitor"), model
    steps: dict[str, Any] = Field(default_factory=dict)  # count, first, last, gaps, tokens
    options: dict[str, Any] = Field(default_factory=dict)  # baseline window, alpha, keep, workers
    drift: dict[str, dict[str, Any]] = Field(default_factory=dict)  # metric -> DriftResult.to_dict()
    kept: list[KeptStep] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)  # one line each: what the importers said
    gate: dict[str, Any] | None = None
    figures: list[str] = Field(default_factory=list)
    timings: dict[str, Any] = Field(default_factory=dict)

    def drift_of(self, metric: str) -> dict[str, Any]:
        """The drift test of ``metric`` (analysis/drift.py: DriftResult.to_dict()); empty when not tested."""
        return self.drift.get(metric) or {}

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / TIMELINE_JSON
        write_atomic(path, json.dumps(json_safe(self.model_dump(mode="python")), indent=2, allow_nan=False) + "\n")
        return path


def read_timeline(directory: str | Path) -> TimelineRecord:
    path = Path(directory) / TIMELINE_JSON
    if not path.is_file():
        raise ConfigError(
            f"{directory} is not a timeline directory (no {TIMELINE_JSON})",
            hint="make one with `mismatch-probe timeline SOURCE --format F` or mismatch_probe.Monitor",
        )
    try:
        return TimelineRecord.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, ValidationError) as exc:
        raise ConfigError(f"{path} is not a timeline record: {exc}") from None


def is_timeline(directory: str | Path) -> bool:
    return (Path(directory) / TIMELINE_JSON).is_file()

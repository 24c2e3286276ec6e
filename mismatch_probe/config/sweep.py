"""The points of a sweep: one probe spec per combination of settings a ``[sweep]`` table asks for.

``one-at-a-time``: the baseline (the spec as written), then each axis level (a value, or a named
level's settings) that differs from the baseline's own, alone. ``grid``: every combination of the
axes' levels (the combination equal to the baseline is the baseline). Each point is a complete, validated :class:`ProbeSpec` without
``[sweep]``; what decides how it runs is read from it:

* :func:`engine_key`: points with the same key share one engine start;
* ``rollout_fingerprint()``: points with the same one score the same tokens (a reference-only change),
  so their difference from each other is paired.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch_probe.config.keys import unknown_key
from mismatch_probe.config.spec import FINGERPRINT_SCHEMA, ProbeSpec
from mismatch_probe.config.spec_reading import apply_overrides
from mismatch_probe.config.sweep_spec import AxisValue, SweepAxis, SweepSpec, value_name
from mismatch_probe.errors import ConfigError

BASELINE = "baseline"


@dataclass
class SweepPoint:
    name: str
    settings: dict[str, AxisValue]  # what differs from the baseline, by dotted key
    spec: ProbeSpec | None  # None: the settings are not a valid spec (refused, with ``refusal``)
    run_dir: Path  # DIR/points/<name>: the spec's out
    repeat: int = 0  # the baseline's repeats: 1, 2, ... (seed + repeat)
    refusal: str | None = None
    # its level on each axis, by axis label (None: the baseline's setting is none of the axis' levels)
    levels: dict[str, str | None] = field(default_factory=dict)

    @property
    def is_baseline(self) -> bool:
        return self.name == BASELINE


@dataclass
class SweepPlan:
    baseline: SweepPoint
    repeats: list[SweepPoint]  # the baseline again with other seeds (repeats - 1 of them)
    points: list[SweepPoint]  # every other point, in the order the axes list them
    sweep: SweepSpec
    spec: ProbeSpec  # the spec with its [sweep] table, as given

    @property
    def runs(self) -> list[SweepPoint]:
        return [self.baseline, *self.repeats, *self.points]

    def fingerprint(self, schema: int = FINGERPRINT_SCHEMA) -> str:
        """Of the whole sweep (the spec and its [sweep] table, not where it is written), by the
        rules of ``schema`` (what an earlier sweep's sweep-state.json was written by)."""
        d = self.spec.dump(schema)
        d.pop("out", None)
        d.pop("name", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def point_name(settings: dict[str, AxisValue] | dict[str, str]) -> str:
    """``engine.dtype=float32`` (or ``rollout=W8A8``, a named level); a grid point joins its
    coordinates with ``+``. Only characters a directory name can hold safely everywhere."""
    raw = "+".join(f"{k}={value_name(v)}" for k, v in settings.items())
    return re.sub(r"[^A-Za-z0-9._=+-]", "-", raw)


def engine_key(spec: ProbeSpec) -> str:
    """What one engine start serves: the model and every engine setting (sampling is per request)."""
    d = {"model": spec.model, "trust_remote_code": spec.trust_remote_code, "engine": spec.engine.model_dump()}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _current(spec: ProbeSpec, key: str) -> Any:
    section, _, leaf = key.partition(".")
    return getattr(getattr(spec, section), leaf)


def spec_dir(spec: ProbeSpec) -> Path | None:
    """The directory of the spec file (a sweep axis' paths are relative to it, as the file's own are)."""
    given = spec.given_paths.get("spec_file")
    return Path(given).resolve().parent if given else None


def _point(
    base: ProbeSpec, settings: dict[str, AxisValue], out: Path, *, strict: bool, name: str | None = None
) -> SweepPoint:
    name = name or point_name(settings)
    spec = base.model_copy(deep=True, update={"sweep": None, "out": str(out / name), "name": name})
    spec._given_paths = {k: p for k, p in base.given_paths.items() if k != "out"}
    try:
        spec = apply_overrides(spec, dict(settings), named_by="key", base_dir=spec_dir(base)).normalized()
    except ConfigError as exc:
        where = ", ".join(f"{k} = {value_name(v)}" for k, v in settings.items())
        if strict:
            raise ConfigError(f"[sweep] {where}: {exc.message}", hint=exc.hint) from None
        return SweepPoint(name, settings, None, out / name, refusal=f"not a valid setting: {exc}")
    return SweepPoint(name, settings, spec, out / name)


POINTS_DIR = "points"  # a sweep's point runs: SWEEP_DIR/points/<name>
STATE_JSON = "sweep-state.json"  # the sweep's fingerprint and its refused points, written when it starts
# where a sweep's engine configurations run: local (this process, or the share --shard names), or
# each one as a Ray task (sweeps/ray_executor.py)
EXECUTORS = ("local", "ray")


def sweep_of(run_dir: str | Path) -> Path | None:
    """The sweep directory ``run_dir`` is a point of, or None for a run of its own."""
    parent = Path(run_dir).resolve().parent
    return parent.parent if parent.name == POINTS_DIR and (parent.parent / STATE_JSON).is_file() else None


def sweep_points(spec: ProbeSpec, out: str | Path) -> SweepPlan:
    """Every point of ``spec``'s ``[sweep]``, each writing to ``out/points/<name>``.

    Raises :class:`ConfigError` for an axis that names no setting or a value the setting cannot
    take; in a grid, a combination the spec's rules forbid (e.g. sequence parallelism without
    packing) becomes a refused point instead, shown with its reason."""
    sweep = spec.sweep
    if sweep is None:
        raise ConfigError(
            "the spec has no [sweep] table", hint="add [sweep] and [[sweep.axes]] (see probes/sweep-demo.toml)"
        )
    points_dir = Path(out) / POINTS_DIR
    base = spec.model_copy(deep=True, update={"sweep": None})
    base._given_paths = dict(spec.given_paths)
    base.check_runnable()
    base = base.normalized()
    for axis in sweep.axes:
        for key in axis.keys:
            section, _, leaf = key.partition(".")
            if leaf not in type(getattr(base, section)).model_fields:
                raise unknown_key(leaf, list(type(getattr(base, section)).model_fields), f"[sweep] axis [{section}]")
    baseline = _point(base, {}, points_dir, strict=True, name=BASELINE)
    assert baseline.spec is not None  # strict: a ConfigError otherwise
    base_spec = baseline.spec
    # each axis' levels with the settings that differ from the baseline's own (computed once: a
    # setting's sameness can take a validation of the spec); a level with none is the baseline's
    options = [
        [
            (label, {k: v for k, v in level.items() if not _same(_current(base_spec, k), v, base_spec, k)})
            for label, level in axis.options()
        ]
        for axis in sweep.axes
    ]
    base_levels = {
        a.label: next((label for label, changed in levels if not changed), None)
        for a, levels in zip(sweep.axes, options)
    }
    baseline.levels = dict(base_levels)
    repeats = []
    for r in range(1, sweep.repeats):
        p = _point(
            base, {"sampling.seed": base.sampling.seed + r}, points_dir, strict=True, name=f"{BASELINE}-repeat{r}"
        )
        p.repeat, p.settings, p.levels = r, {}, dict(base_levels)  # the seed is what a repeat is, not a setting
        repeats.append(p)

    points: list[SweepPoint] = []
    if sweep.mode == "grid":
        for combo in itertools.product(*options):
            settings = {k: v for _, changed in combo for k, v in changed.items()}
            if settings:
                levels: dict[str, str | None] = {a.label: label for a, (label, _) in zip(sweep.axes, combo)}
                moved = {a.label: label for a, (label, changed) in zip(sweep.axes, combo) if changed}
                point = _point(base, settings, points_dir, strict=False, name=_name(sweep.axes, moved, settings))
                point.levels = levels
                points.append(point)
    else:
        for axis, levels_of_axis in zip(sweep.axes, options):
            for label, settings in levels_of_axis:
                if settings:
                    point = _point(
                        base, settings, points_dir, strict=True, name=_name([axis], {axis.label: label}, settings)
                    )
                    point.levels = {**base_levels, axis.label: label}
                    points.append(point)
    seen: dict[str, str] = {}
    unique = []
    for p in points:  # two spellings of one setting (bf16, bfloat16) are one point
        fp = p.spec.fingerprint() if p.spec is not None else p.name
        if fp == baseline.spec.fingerprint() or fp in seen:
            continue
        seen[fp] = p.name
        unique.append(p)
    return SweepPlan(baseline, repeats, unique, sweep, spec)


def _name(axes: list[SweepAxis], moved: dict[str, str], settings: dict[str, AxisValue]) -> str:
    """A point's name: its settings (``engine.dtype=float32``) on value axes, its level names
    (``rollout=W8A8``) on named-level axes."""
    named = {a.label for a in axes if a.name is not None}
    if not named & set(moved):
        return point_name(settings)
    return point_name({label: level for label, level in moved.items()})


def _same(current: Any, value: AxisValue, baseline: ProbeSpec, key: str) -> bool:
    """Is ``value`` the baseline's own setting (after the spec's normalization: bf16 is bfloat16)?"""
    if isinstance(current, bool) != isinstance(value, bool):  # true is not 1
        return False
    if current == value:
        return True
    try:
        probe = apply_overrides(baseline, {key: value}, named_by="key", base_dir=spec_dir(baseline)).normalized()
    except ConfigError:
        return False
    return _current(probe, key) == current

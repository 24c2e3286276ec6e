"""A sweep split over machines: its engine-configuration groups, the share of them one process runs,
and what every such process leaves in the sweep's directory.

A sweep's unit of work is one **engine-configuration group** (``config.sweep.engine_key``): the
points one engine start serves and the points that re-score their tokens. Groups share nothing but
the output directory, so they can run anywhere that directory is mounted, at once:

* ``sweep SPEC --shard i/N`` (a Slurm array task, or any scheduler's) runs the groups
  :func:`shard_groups` gives shard ``i`` of ``N``: the same split on every machine, from the spec
  alone, with whole groups so no engine starts twice;
* ``sweep SPEC --executor ray`` submits each group as a Ray task (``sweeps.ray_executor``).

Each such process keeps what only it knows (the points it refused or saw fail, its invocations) in a
file of its own under ``shards/`` (:class:`SweepState`), never in another's, so they never race.
The summary (``sweep.json``) is written once every point is complete, refused or failed: by the
shard that finds it so, or by ``sweep SPEC --summarize``.
"""

from __future__ import annotations

import fcntl
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.config.sweep import STATE_JSON, SweepPoint, engine_key
from mismatch_probe.errors import ConfigError
from mismatch_probe.files import write_atomic

UNITS_DIR = "shards"  # one state file per shard (or Ray task) that ran a share of the groups
LOCK_FILE = ".sweep.lock"  # held while the summary is written: two shards finishing at once take turns


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based, as ``--shard 1/4``; a Slurm array ``--array=1-4``
    passes ``--shard $SLURM_ARRAY_TASK_ID/4``)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if m is None or not 1 <= int(m.group(1)) <= int(m.group(2)):
            raise ConfigError(
                f"--shard {text!r} is not I/N with 1 <= I <= N", hint="e.g. --shard 1/4 (shards are numbered from 1)"
            )
        return cls(int(m.group(1)), int(m.group(2)))

    @property
    def unit(self) -> str:
        return f"shard-{self.index}-of-{self.count}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass
class Group:
    """One engine configuration's points: ``samplers`` sample with its engine, ``rescorers`` score a
    sampler's tokens again (``source``: the sampler of each)."""

    key: str
    members: list[SweepPoint]
    source: dict[str, SweepPoint]

    @property
    def unit(self) -> str:
        return f"group-{self.key}"

    def layout(self) -> dict[str, int]:
        """The devices the group holds at once: its engine's (TP x PP x DP) while it samples, the
        largest reference layout (SP x TP ranks) while it scores; never both (the engine is closed
        before any point scores)."""
        engine = reference = 1
        for p in self.members:
            spec: ProbeSpec | None = p.spec
            if spec is None:
                continue
            e = spec.engine
            engine = max(engine, e.tensor_parallel_size * e.pipeline_parallel_size * e.data_parallel_size)
            r = spec.reference
            reference = max(reference, r.sequence_parallel_size * r.tensor_parallel_size)
        return {"engine": engine, "reference": reference, "devices": max(engine, reference)}


def engine_groups(runnable: list[SweepPoint]) -> list[Group]:
    """The runnable points by engine configuration, in the plan's order; a point whose rollout
    fingerprint an earlier point has re-scores that point's tokens (same engine settings and sampling,
    so always within its group)."""
    sampler_of: dict[str, SweepPoint] = {}
    group_of: dict[str, Group] = {}  # by the name of each sampling point
    groups: dict[str, Group] = {}
    for p in runnable:
        assert p.spec is not None
        fp = p.spec.rollout_fingerprint()
        if fp in sampler_of:
            # with its source's engine configuration, which its own always is unless an engine setting
            # that does not decide the rollouts differs: either way it must run after its source
            source = sampler_of[fp]
            group_of[source.name].members.append(p)
            group_of[source.name].source[p.name] = source
            continue
        sampler_of[fp] = p
        key = engine_key(p.spec)
        group = groups.setdefault(key, Group(key, [], {}))
        group.members.append(p)
        group_of[p.name] = group
    return list(groups.values())


def shard_groups(groups: list[Group], shard: Shard) -> list[Group]:
    """Shard ``shard``'s groups: the largest first, each to the shard with the fewest points so far
    (ties: the lower shard), the same on every machine. The baseline's group (baseline, repeats,
    sampling changes, the determinism check) is usually the largest and so goes to shard 1."""
    load = [0] * shard.count
    owner: dict[str, int] = {}
    order = sorted(range(len(groups)), key=lambda i: (-len(groups[i].members), i))
    for i in order:
        s = min(range(shard.count), key=lambda k: (load[k], k))
        owner[groups[i].key] = s
        load[s] += len(groups[i].members)
    return [g for g in groups if owner[g.key] == shard.index - 1]


class SweepState:
    """What a sweep keeps beside its points. ``sweep-state.json``: the spec's fingerprint, and for a
    sweep run in one process its refusals and invocations; the throughputs measured (the summary's).
    ``shards/<unit>.json``: the same of one shard or Ray task. Reads merge them all; a process writes
    only its own file."""

    def __init__(self, out: Path, unit: str | None) -> None:
        self.out, self.unit = out, unit
        self.main: dict[str, Any] = self._read(out / STATE_JSON)
        self.main.setdefault("refused", {})
        self.own: dict[str, Any] = self.main if unit is None else self._read(self.unit_path(unit))
        self.own.setdefault("refused", {})

    def begin(self) -> None:
        """A process about to run points: the failures it records are this invocation's (a point
        that failed before is tried again)."""
        self.own["failures"] = {}

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        return json.loads(path.read_text()) if path.is_file() else {}

    def unit_path(self, unit: str) -> Path:
        return self.out / UNITS_DIR / f"{unit}.json"

    def units(self) -> list[dict[str, Any]]:
        found = sorted((self.out / UNITS_DIR).glob("*.json")) if (self.out / UNITS_DIR).is_dir() else []
        return [self.own if self.unit is not None and p.stem == self.unit else self._read(p) for p in found]

    def _all(self) -> list[dict[str, Any]]:
        units = self.units()
        if self.unit is not None and not any(u is self.own for u in units):
            units.append(self.own)
        return [self.main, *units]

    @property
    def refused(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for s in self._all():
            merged.update(s.get("refused", {}))
        return merged

    @property
    def failures(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for s in self._all():
            merged.update(s.get("failures", {}))
        return merged

    @property
    def invocations(self) -> list[dict[str, Any]]:
        found = [i for s in self._all() for i in s.get("invocations", [])]
        return sorted(found, key=lambda i: i.get("finished_at", ""))

    def refuse(self, name: str, reason: str) -> None:
        self.own["refused"][name] = reason
        self.save()

    def fail(self, name: str, reason: str) -> None:
        self.own["failures"][name] = reason
        self.save()

    def add_invocation(self, entry: dict[str, Any]) -> None:
        self.own.setdefault("invocations", []).append(entry)
        self.save()

    def save(self) -> None:
        path = self.out / STATE_JSON if self.unit is None else self.unit_path(self.unit)
        write_atomic(path, json.dumps(self.own, indent=2) + "\n")

    def reload_main(self) -> None:
        """sweep-state.json as on disk (a shard's process: another may have written it since)."""
        if self.unit is not None:
            self.main = self._read(self.out / STATE_JSON)
            self.main.setdefault("refused", {})

    def save_main(self) -> None:
        """sweep-state.json itself (the summary's throughputs), whoever writes the summary."""
        write_atomic(self.out / STATE_JSON, json.dumps(self.main, indent=2) + "\n")


@contextmanager
def summary_lock(out: Path) -> Iterator[None]:
    """One summary at a time in ``out`` (an advisory lock: on a shared filesystem without locks, two
    shards finishing at once both write the same sweep.json, each atomically)."""
    with open(out / LOCK_FILE, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield

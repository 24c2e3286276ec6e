"""``sweep SPEC --executor ray``: each engine-configuration group of a sweep as a Ray task.

The driver (the CLI's process) prepares the directory and refuses the invalid points as a local
sweep does; then it submits one task per group that is not complete, each asking the cluster for
what the group's layout holds at once (``Group.layout``: the engine's TP x PP x DP while it samples,
the reference's SP x TP while it scores): as GPUs where the cluster has GPUs, else as CPUs. A task
runs its group exactly as a local sweep runs it (one engine start, then scoring), writing into the
shared output directory, and keeps its state in ``shards/group-<key>.json``. The driver writes the
summary once every task is back, so ``sweep.json`` is the one a local run writes.

A task whose worker dies (a node lost, a kill) is retried by Ray (``max_retries``); it resumes its
group from the points and shards already on disk, as a re-run sweep does. Every node needs this
package and the spec's paths (the model, the prompts, ``--out``) at the same place: a shared
filesystem, as a Slurm array needs. The driver's working directory is each task's, so relative paths
in the spec mean what they mean on the driver.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.errors import ConfigError
from mismatch_probe.sweeps.units import Group

MAX_RETRIES = 3  # a group whose worker died is run again, from what it left on disk


class _PrintProgress:
    """A task's progress: one line per event on its stdout, which Ray forwards to the driver."""

    def __init__(self, unit: str) -> None:
        self.unit = unit

    def stage(self, name: str, total: int) -> None: ...

    def advance(self, name: str, amount: int) -> None: ...

    def log(self, message: str) -> None:
        print(f"[{self.unit}] {message}", file=sys.stderr, flush=True)

    def point(self, name: str, done: int, total: int, engine_starts: int) -> None:
        self.log(f"{name} done ({done}/{total} runs of this group, {engine_starts} engine starts)")


def run_group(spec: ProbeSpec, out: str, gate: str | None, key: str, cwd: str) -> dict[str, Any]:
    """One group of the sweep in ``out`` (a Ray task's body; also callable in-process)."""
    from mismatch_probe.sweeps.runner import _default_engine_factory, _Sweep

    if Path(cwd).is_dir():
        os.chdir(cwd)  # the spec's relative paths are the driver's
    unit = Group(key, [], {}).unit
    sweep = _Sweep(spec, out, gate, True, _PrintProgress(unit), _default_engine_factory, unit=unit)  # type: ignore[arg-type]
    sweep.run(lambda groups: [g for g in groups if g.key == key], summarize=False)
    return {"group": key, "engine_starts": sweep.engine_starts}


def resources(group: Group, cluster_gpus: float) -> dict[str, float]:
    """What a group's task asks of the cluster: its layout's devices as GPUs on a cluster that has
    them, else as CPUs (a CPU engine and reference use the cores they are given)."""
    devices = group.layout()["devices"]
    if cluster_gpus > 0:
        return {"num_gpus": devices, "num_cpus": 1}
    return {"num_gpus": 0, "num_cpus": devices}


def run_on_ray(spec: ProbeSpec, *, out, gate, resume: bool, progress, address: str | None):
    """Prepare the sweep here, run its groups as Ray tasks, write the summary here (the module)."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--executor ray needs Ray, which is not installed", hint="pip install 'mismatch-probe[ray]'"
        ) from None
    from mismatch_probe.sweeps.runner import _default_engine_factory, _Sweep

    driver = _Sweep(spec, out, gate, resume, progress, _default_engine_factory, unit=None)
    groups = driver.groups()
    waiting = set(driver.waiting())
    todo = [g for g in groups if any(p.name in waiting for p in g.members)]
    out_dir, gate_path = str(driver.out.resolve()), None if gate is None else str(Path(gate).resolve())
    if todo:
        try:
            ray.init(address=address or os.environ.get("RAY_ADDRESS"), log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(
                f"could not reach a Ray cluster at {address!r}: {str(exc).splitlines()[0]}",
                hint="start one with `ray start --head`, or pass its address with --ray-address",
            ) from None
        try:
            gpus = float(ray.cluster_resources().get("GPU", 0))
            task = ray.remote(run_group)
            running = {
                task.options(
                    name=f"mismatch-probe sweep {g.unit}", max_retries=MAX_RETRIES, **resources(g, gpus)
                ).remote(spec, out_dir, gate_path, g.key, os.getcwd()): g
                for g in todo
            }
            progress.log(f"submitted {len(running)} engine configuration(s) as Ray tasks")
            done = starts = 0
            while running:
                ready, _ = ray.wait(list(running), num_returns=1)
                for ref in ready:
                    group = running.pop(ref)
                    starts += ray.get(ref)["engine_starts"]  # a task's error is raised here, as its cause's type
                    done += 1
                    progress.point(group.unit, done, len(todo), starts)
        finally:
            ray.shutdown()
    return driver.summarize_only()

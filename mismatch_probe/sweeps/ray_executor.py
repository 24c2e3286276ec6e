"""``sweep SPEC --executor ray``: each engine-configuration group of a sweep as a Ray task.

The driver (the CLI's process) prepares the directory and refuses the invalid points as a local
sweep does (``sweeps.runner``); then it submits one task per group that is not complete, each asking
the cluster for what the group's layout holds at once (``Group.layout``: the engine's TP x PP x DP
while it samples, the reference's SP x TP while it scores): as GPUs where the cluster has GPUs, else
as CPUs. A task (``runner.run_group``) runs its group exactly as a local sweep runs it (one engine
start, then scoring), writing into the shared output directory, and keeps its state in
``shards/group-<key>.json``. The driver writes the summary once every task is back, so
``sweep.json`` is the one a local run writes.

A task whose worker dies (a node lost, a kill) is retried by Ray; it resumes its group from the
points and shards already on disk, as a re-run sweep does. Every node needs this package and the
spec's paths (the model, the prompts, ``--out``) at the same place: a shared filesystem, as a Slurm
array needs. The driver's working directory is each task's, so relative paths in the spec mean what
they mean on the driver.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mismatch_probe.ray_cluster import MAX_RETRIES, connected, finished
from mismatch_probe.sweeps.units import Group


def resources(group: Group, cluster_gpus: float) -> dict[str, float]:
    """What a group's task asks of the cluster: its layout's devices as GPUs on a cluster that has
    them, else as CPUs (a CPU engine and reference use the cores they are given)."""
    devices = group.layout()["devices"]
    if cluster_gpus > 0:
        return {"num_gpus": devices, "num_cpus": 1}
    return {"num_gpus": 0, "num_cpus": devices}


def run_groups_on_ray(
    groups: list[Group], body: Callable[..., dict[str, Any]], *, spec, out: Path, gate, progress, address: str | None
) -> None:
    """Run ``body(spec, out, gate, key, cwd)`` for each of ``groups`` as a Ray task (the module)."""
    if not groups:
        return
    out_dir, gate_path = str(out.resolve()), None if gate is None else str(Path(gate).resolve())
    with connected(address) as ray:
        gpus = float(ray.cluster_resources().get("GPU", 0))
        task = ray.remote(body)
        running = {
            task.options(name=f"mismatch-probe sweep {g.unit}", max_retries=MAX_RETRIES, **resources(g, gpus)).remote(
                spec, out_dir, gate_path, g.key, os.getcwd()
            ): g
            for g in groups
        }
        progress.log(f"submitted {len(running)} engine configuration(s) as Ray tasks")
        starts = 0
        for done, (group, result) in enumerate(finished(ray, running), start=1):
            starts += result["engine_starts"]
            progress.point(group.unit, done, len(groups), starts)

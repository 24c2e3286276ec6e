"""The reference under ``torchrun``: the launcher's process group instead of spawning our own.

``torchrun`` (one node or several, c10d rendezvous; under Slurm, ``srun torchrun``) starts one
process per rank and tells each where it stands through the environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...). ``mismatch-probe score`` finds that
environment (:func:`torchrun_launch`), joins the group (``env://``) and lays the ranks out as a
``(dp, sp, tp)`` device mesh: ``world / (sp * tp)`` data-parallel groups, each a training layout
of its own (:mod:`mismatch_probe.reference.parallel`). Each group scores its share of every
shard's sequences, balanced by token count (:func:`split_by_tokens`), and writes them as a piece
that rank 0 merges (:mod:`mismatch_probe.reference.data_parallel`).

Nothing here starts a process: a rank that fails exits, and torchrun stops the others.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import numpy as np

from mismatch_probe.errors import ConfigError, DataError, ProbeError

# what torchrun sets for every worker (torch.distributed.run); RANK alone could be anyone's
_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# a collective waits this long for a peer (gloo's default is 30 min): a rank that hangs in its
# forward fails the job rather than holding every node
COLLECTIVE_TIMEOUT = timedelta(minutes=int(os.environ.get("MISMATCH_PROBE_COLLECTIVE_TIMEOUT_MIN", "30")))
_ERRORS: dict[str, type[ProbeError]] = {"ConfigError": ConfigError, "DataError": DataError, "ProbeError": ProbeError}
T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """Where this process stands in a torchrun launch."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    run_id: str | None
    master: str

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return (
            f"torchrun: {self.world_size} ranks on {self.nnodes} node(s) x {self.local_world_size} "
            f"(rendezvous {self.master}{f', run id {self.run_id}' if self.run_id else ''})"
        )


def torchrun_launch(environ: Mapping[str, str] | None = None) -> Launch | None:
    """This process's place in a torchrun launch, or None when it was not started by one."""
    env = os.environ if environ is None else environ
    if not all(k in env for k in _REQUIRED):
        return None
    try:
        world = int(env["WORLD_SIZE"])
        return Launch(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))),
            run_id=env.get("TORCHELASTIC_RUN_ID"),
            master=f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
        )
    except ValueError as exc:
        raise ConfigError(f"torchrun's environment does not parse ({exc})") from None


def join(launch: Launch, device_type: str) -> str:
    """Join torchrun's process group (once); returns this rank's device."""
    import torch
    import torch.distributed as dist

    device = "cpu"
    if device_type == "cuda":
        if torch.cuda.device_count() <= launch.local_rank:
            raise ConfigError(
                f"rank {launch.rank} is local rank {launch.local_rank} and torch sees "
                f"{torch.cuda.device_count()} GPUs on this node",
                hint="launch at most one process per GPU: torchrun --nproc-per-node <GPUs per node>",
            )
        torch.cuda.set_device(launch.local_rank)
        device = f"cuda:{launch.local_rank}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    elif dist.get_world_size() != launch.world_size:
        raise RuntimeError("a process group of another size is already initialized")
    if device_type == "cpu":  # the node's ranks share its cores; oversubscribing slows every collective
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, launch.local_world_size)))
    return device


def data_parallel_size(world_size: int, sp: int, tp: int) -> int:
    """How many data-parallel groups ``world_size`` ranks make with ``sp * tp`` ranks each."""
    if world_size % (sp * tp):
        raise ConfigError(
            f"torchrun started {world_size} ranks, which do not split into groups of sequence-parallel {sp} x "
            f"tensor-parallel {tp} = {sp * tp}",
            hint=f"launch a multiple of {sp * tp} ranks (nnodes x nproc-per-node), or change the layout",
        )
    return world_size // (sp * tp)


def split_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``parts`` groups with token totals as equal as a greedy split
    gets them (longest first, each to the lightest group; ties to the lowest group), each
    group in its original order. Deterministic, so every rank computes the same split."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    tokens = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-tokens, kind="stable")
    totals = np.zeros(parts, dtype=np.int64)
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        g = int(np.argmin(totals))  # argmin returns the first minimum: ties go to the lowest group
        groups[g].append(int(i))
        totals[g] += tokens[i]
    return [sorted(g) for g in groups]


def on_lead(fn: Callable[[], T]) -> T:
    """Run ``fn`` on global rank 0 alone; every rank returns its result or raises its error, so
    a refusal on rank 0 (a run directory that exists, say) does not leave the others waiting."""
    import torch.distributed as dist

    box: list = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except ProbeError as exc:
            error = exc
            box[0] = ("error", type(exc).__name__, exc.message, exc.hint)
        except BaseException as exc:
            error = exc
            box[0] = ("error", "ProbeError", f"rank 0 failed: {type(exc).__name__}: {exc}", None)
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0][0] == "error":
        _, kind, message, hint = box[0]
        raise _ERRORS.get(kind, ProbeError)(message, hint=hint)
    return box[0][1]

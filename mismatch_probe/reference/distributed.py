"""The reference forward over several ranks: processes started with torch.multiprocessing.

:class:`DistributedReferenceScorer` has :class:`~mismatch_probe.reference.scorer.ReferenceScorer`'s
interface (``info``, ``score``, ``close``), so the pipeline does not care about the layout. It
spawns ``sp * tp`` processes (``torch.multiprocessing.start_processes``, spawn start method);
each joins one process group (gloo on CPU, NCCL with one GPU per rank) through a file store in a
private temporary directory, loads the model and takes its place in the layout. Every rank gets
the same rollouts; rank 0 sends back progress and the scores, which are identical in shape
whatever the layout.

A rank that fails reports its error before it exits; the parent then stops all ranks (the
others would wait in a collective forever) and raises it. Ranks write their output to a log file
when one is given, so the terminal shows only the parent's progress bars.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from mismatch_probe.config.spec import SP_ATTN_IMPLEMENTATIONS, ReferenceSpec
from mismatch_probe.errors import ConfigError, DataError, ProbeError
from mismatch_probe.modeling.loading import check_model_dir, choose_attention, read_config, resolve_device
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.reference.parallel import CPU_MALLOC_ENV
from mismatch_probe.table.tokens import Rollout

STOP_TIMEOUT_S = 60
_ERRORS = {"ConfigError": ConfigError, "DataError": DataError}


class ReferenceRankError(ProbeError):
    """A reference rank failed; carries the rank's traceback for --debug."""

    def __init__(self, message: str, *, remote_traceback: str = "", hint: str | None = None):
        super().__init__(message, hint=hint)
        self.remote_traceback = remote_traceback


def check_reference_layout(
    model_path: Path, spec: ReferenceSpec, *, trust_remote_code: bool = False, gpus: bool = True
) -> str:
    """Fail early (before the engine samples anything) when the model's heads do not split over
    the layout or (``gpus``: all ranks on this machine) there are too few GPUs; returns the device
    type the ranks will use."""
    import torch

    from mismatch_probe.reference.parallel import check_layout, check_tensor_parallel_plan

    sp, tp = spec.sequence_parallel_size, spec.tensor_parallel_size
    check_layout(read_config(model_path), sp, tp)
    if tp > 1:
        from transformers import AutoConfig

        check_tensor_parallel_plan(AutoConfig.from_pretrained(str(model_path), trust_remote_code=trust_remote_code))
    if sp > 1:
        attention = choose_attention(model_path, spec.attn_implementation, trust_remote_code=trust_remote_code)
        if attention.used not in SP_ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"Ulysses sequence parallelism (--train-sp) needs per-sequence attention "
                f"({' or '.join(SP_ATTN_IMPLEMENTATIONS)}), and this model runs {attention.used}"
                + (f": {attention.fallback_reason}" if attention.fallback_reason else ""),
                hint="score it with --train-sp 1 (--train-tp is fine)",
            )
    device_type = resolve_device(spec.device)
    if gpus and device_type == "cuda" and torch.cuda.device_count() < sp * tp:
        raise ConfigError(
            f"the reference layout needs {sp * tp} GPUs (sp {sp} x tp {tp}), and torch "
            f"sees {torch.cuda.device_count()}",
            hint="lower --train-sp / --train-tp",
        )
    return device_type


class DistributedReferenceScorer:
    def __init__(
        self,
        model_path: str | Path,
        spec: ReferenceSpec,
        *,
        trust_remote_code: bool = False,
        log_path: str | Path | None = None,
    ):
        import torch.multiprocessing as mp

        self.log_path = log_path
        self._peaks: list[dict] = []
        sp, tp = spec.sequence_parallel_size, spec.tensor_parallel_size
        self.world_size = sp * tp
        model_path = check_model_dir(model_path)
        device_type = check_reference_layout(model_path, spec, trust_remote_code=trust_remote_code)
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._store_dir = tempfile.mkdtemp(prefix="mismatch-probe-ranks-")
        init_method = f"file://{self._store_dir}/store"
        name, value = CPU_MALLOC_ENV
        # read by each rank's allocator at its start (see CPU_MALLOC_ENV): set for the ranks only
        child_env = {name: value} if device_type == "cpu" and spec.fsdp and name not in os.environ else {}
        os.environ.update(child_env)
        try:
            self._procs = mp.start_processes(
                _rank_main,
                nprocs=self.world_size,
                join=False,
                start_method="spawn",
                args=(
                    sp,
                    tp,
                    init_method,
                    device_type,
                    str(model_path),
                    spec,
                    trust_remote_code,
                    self._tasks,
                    self._results,
                    str(log_path) if log_path else None,
                ),
            )
        finally:
            for key in child_env:
                os.environ.pop(key, None)
        try:
            self._info = self._wait("ready")[1]
        except BaseException:
            self._kill()
            raise

    def info(self) -> dict:
        return self._info

    def peak_memory(self) -> list[dict]:
        """Each rank's peak memory (:func:`~mismatch_probe.environment.peak_memory`), in rank order,
        as of the last :meth:`score`."""
        return list(self._peaks)

    def score(
        self,
        rollouts: Sequence[Rollout],
        semantics: LogprobSemantics,
        on_progress: Callable[[int], None] | None = None,
    ):
        rollouts = list(rollouts)
        for tasks in self._tasks:
            tasks.put(("score", rollouts, semantics))
        try:
            _, scores, self._peaks = self._wait("scores", on_progress)
            return scores
        except BaseException:
            self._kill()
            raise

    def close(self) -> None:
        if self._procs is None:
            return
        try:
            for tasks in self._tasks:
                tasks.put(("stop",))
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while not self._procs.join(timeout=1):
                if time.monotonic() > deadline:
                    break
        except Exception:  # a rank that failed while stopping: nothing left to return
            pass
        finally:
            self._kill()

    # ---- internals --------------------------------------------------------------------------

    def _wait(self, kind: str, on_progress: Callable[[int], None] | None = None) -> tuple:
        while True:
            try:
                msg = self._results.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                continue
            if msg[0] == "progress":
                if on_progress:
                    on_progress(msg[1])
            elif msg[0] == "error":
                # a rank killed from outside (OOM killer, a signal) makes its peers fail in their
                # next collective; the dead one is the news, not its peers' broken connection
                time.sleep(0.5)
                raise self._killed_rank() or self._error(*msg[1:])
            elif msg[0] == kind:
                return msg
            else:
                raise RuntimeError(f"unexpected message from reference rank 0: {msg[0]!r}")

    def _check_alive(self) -> None:
        if all(p.exitcode is None for p in self._procs.processes):
            return
        if killed := self._killed_rank():
            raise killed
        try:  # a rank that exited on an error reports it before it goes
            msg = self._results.get(timeout=2)
            if msg[0] == "error":
                raise self._error(*msg[1:])
        except queue.Empty:
            pass
        codes = {rank: p.exitcode for rank, p in enumerate(self._procs.processes) if p.exitcode is not None}
        raise ReferenceRankError(f"a reference rank died: exit codes {codes}", hint=self._where())

    def _killed_rank(self) -> ProbeError | None:
        import signal

        for rank, p in enumerate(self._procs.processes):
            if p.exitcode is not None and p.exitcode < 0:
                name = signal.Signals(-p.exitcode).name
                return ReferenceRankError(
                    f"a reference rank died: rank {rank} was killed by {name}"
                    + (" (out of memory?)" if name == "SIGKILL" else ""),
                    hint=self._where(),
                )
        return None

    def _where(self) -> str:
        return f"see {self.log_path} for what it printed" if self.log_path else "its output is above"

    def _error(self, rank: int, kind: str, message: str, hint: str | None, remote: str) -> ProbeError:
        if kind in _ERRORS:
            return _ERRORS[kind](message, hint=hint)
        return ReferenceRankError(
            f"reference rank {rank} failed: {kind}: {message}",
            remote_traceback=remote,
            hint="--debug shows its traceback",
        )

    def _kill(self) -> None:
        if self._procs is None:
            return
        for p in self._procs.processes:
            if p.is_alive():
                p.terminate()
        for p in self._procs.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = None
        self._results.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)


def _rank_main(
    rank: int,
    sp: int,
    tp: int,
    init_method: str,
    device_type: str,
    model_path: str,
    spec: ReferenceSpec,
    trust_remote_code: bool,
    tasks,
    results,
    log_path: str | None,
) -> None:
    """One rank: join the group, load the model into its place in the layout, score what comes."""
    if log_path:  # before torch: library warnings go to the log, not over the parent's progress bars
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import torch
    import torch.distributed as dist

    from mismatch_probe.environment import peak_memory
    from mismatch_probe.reference.parallel import init_rank
    from mismatch_probe.reference.scorer import ReferenceScorer

    world = sp * tp
    if device_type == "cpu":  # the ranks share the cores; oversubscribing them slows every collective
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        ctx = init_rank(rank, sp, tp, init_method, device_type)
        scorer = ReferenceScorer(model_path, spec, trust_remote_code=trust_remote_code, parallel=ctx)
        if rank == 0:
            results.put(("ready", scorer.info()))
        while True:
            task = tasks[rank].get()
            if task[0] == "stop":
                break
            _, rollouts, semantics = task
            report = (lambda k: results.put(("progress", k))) if rank == 0 else None
            scores = scorer.score(rollouts, semantics, on_progress=report)
            peaks: list = [None] * world
            dist.all_gather_object(peaks, peak_memory(ctx.device))
            if rank == 0:
                results.put(("scores", scores, peaks))
    except BaseException as exc:
        hint = getattr(exc, "hint", None)
        results.put(
            ("error", rank, type(exc).__name__, getattr(exc, "message", None) or str(exc), hint, traceback.format_exc())
        )
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

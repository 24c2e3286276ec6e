"""``mismatch_probe.Monitor``: a timeline written from inside a training loop.

The trainer already holds both sides of the mismatch at each step: the engine's log-probs of the
sampled tokens (the rollout's) and its own (the "old" log-probs it recomputes before the update).
:meth:`Monitor.log_step` reduces them to the step's rows (``analysis/timeline.py: step_rows``, the
same function an import of the step's dump runs) and writes the timeline directory
(``timeline_record.py``) as the run goes:

- every step: its rows, atomically, to ``steps/step-NNNNNNNN.parquet`` (``timeline/store.py: write_step``),
  and the token-level rows of a few sequences to ``sequences/step-NNNNNNNN.parquet``;
- every ``flush_every`` steps and at :meth:`Monitor.close`: ``steps.parquet``, the drift tests,
  ``timeline.json`` and the page (``timeline/runner.py: finish``).

The log-probs are rounded as an import rounds a dump's (``dumps/samples.py: to_rollout``: float32,
values in (0, 1e-3] set to 0), so a step's rows equal those of importing the same step's generic
dump, column for column. Re-opening a directory continues it (a trainer restarted from a
checkpoint): the steps on disk are kept, a step logged again replaces its files.
"""

from __future__ import annotations

import importlib.util
import queue
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_probe.analysis.metrics import CORRECTION_KEYS, KEPT_K3, METRIC_KEYS
from mismatch_probe.analysis.timeline import (
    COUNT_COLUMNS,
    DRIFT_METRICS,
    N_BOOT,
    ROUTING_COLUMNS,
    StepTokens,
    step_rows,
)
from mismatch_probe.config.spec import CorrectionThresholds
from mismatch_probe.dumps.samples import LOGP_ROUNDING
from mismatch_probe.errors import ConfigError, DataError
from mismatch_probe.files import atomic_path
from mismatch_probe.timeline import store
from mismatch_probe.timeline_record import SAMPLED_SEQUENCES, TIMELINE_JSON, TimelineRecord, read_timeline, step_name

# timeline.json's source format and every step file's fingerprint: what tells a monitor's directory
# from an import's (a monitor's steps have no source files to fingerprint)
MONITOR = "monitor"
# the scalars exported to TensorBoard / W&B per step (the "all" row; null values are left out)
EXPORTED = tuple(
    dict.fromkeys(
        (
            *COUNT_COLUMNS,
            *DRIFT_METRICS,
            *METRIC_KEYS,
            *(k for key in CORRECTION_KEYS for k in (key, KEPT_K3[key])),
            *ROUTING_COLUMNS,
        )
    )
)
# sequences/step-NNNNNNNN.parquet: every token of a sampled sequence, in order (log-probs null off
# the generated tokens); why: "worst" (largest max |p_train - p_infer| of the step) or "random"
SEQUENCE_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("sample_id", pa.int64()),
        ("why", pa.string()),
        ("position", pa.int32()),
        ("token_id", pa.int64()),
        ("is_model_token", pa.bool_()),
        ("turn", pa.int16()),
        ("logp_infer", pa.float32()),
        ("logp_train", pa.float32()),
    ]
)
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # the package each export needs -> its extra


def _missing_extra(package: str) -> ConfigError:
    return ConfigError(
        f"the {package} export needs the {package} package, which is not installed",
        hint=f"pip install 'mismatch-probe[{EXTRAS[package]}]'",
    )


@dataclass
class _Work:
    """One step's generated tokens in sample order, checked and rounded, and its sampled
    sequences' rows: what ``step_rows`` and the step's files are made from."""

    step: int
    n_samples: int
    sample_id: np.ndarray  # int64, the sequence's index in the batch
    position: np.ndarray  # int64, the token's index in its row
    turn: np.ndarray  # int16
    logp_infer: np.ndarray  # float32, rounded as an import rounds
    logp_train: np.ndarray
    experts_infer: np.ndarray | None
    experts_train: np.ndarray | None
    sequences: pa.Table | None

    def tokens(self) -> StepTokens:
        return StepTokens(
            sample_id=self.sample_id,
            turn=self.turn,
            position=self.position,
            logp_infer=self.logp_infer.astype(np.float64),
            logp_train=self.logp_train.astype(np.float64),
            n_samples=self.n_samples,
            experts_infer=self.experts_infer,
            experts_train=self.experts_train,
        )


@dataclass
class _Captured:
    """One step's arrays as NumPy ``[B, T]`` (copies with ``background``): the little the caller
    does before the step is reduced, in its thread or the worker's."""

    step: int
    mask: np.ndarray  # bool
    lengths: np.ndarray | None  # each sequence's length, when they came as a list
    logp_infer: np.ndarray  # float32
    logp_train: np.ndarray
    token_ids: np.ndarray | None  # when sequences are kept
    turn: np.ndarray | None
    experts: tuple[np.ndarray, np.ndarray] | None  # at the generated tokens (row-major), sorted


class Monitor:
    """The mismatch of a training run, step by step, into the timeline directory ``out_dir``.

    Call :meth:`log_step` once per training step with the step's sampled sequences, after the
    trainer has recomputed its own log-probs of them (verl: after ``compute_log_prob``, with
    ``rollout_log_probs`` and ``old_log_probs``; TRL's GRPO: ``sampling_per_token_logps`` and
    ``old_per_token_logps``; see ``examples/monitor_*.py``), then :meth:`close` (or use it as a
    context manager). ``mismatch-probe gate`` and the page read the directory like an import's.

    Options: ``sample_sequences`` sequences per step keep their tokens (the worst half by max
    |p_train - p_infer|, the rest a seeded random choice; 0: none): about 15 bytes a token on
    disk (zstd Parquet), so 130 kB a step at 8 sequences of 1,000 tokens, plus 20 kB for the
    step's rows, whatever the batch size (``benchmarks/bench_monitor.py``'s step of 1,024
    sequences). ``baseline_steps`` and ``alpha`` are the drift test's
    (``mismatch-probe timeline``'s options of those names; ``alpha`` bounds the run's false alarms
    over every metric tested, as there); ``corrections`` the correction
    thresholds (``[corrections]`` keys). ``flush_every``: steps between refreshes of
    ``steps.parquet``, ``timeline.json`` and the page (each refresh reads every step file and draws
    the figures, a second or two, so not every step). ``tensorboard``: True (a ``tensorboard/``
    folder inside ``out_dir``) or a log directory; ``wandb``: True (the active run, else a new one
    that :meth:`close` finishes) or a run object. Each gets the step's ``all`` row (the metrics of
    :data:`~mismatch_probe.analysis.timeline.DRIFT_METRICS`, every batch metric, the correction
    shares and the counts) as scalars named ``prefix + key``; W&B's are plotted against
    ``prefix + "step"`` (``define_metric``, as transformers' own W&B callback does), so a step that
    arrives late is kept. Both are optional extras: ``pip install 'mismatch-probe[tensorboard]'``,
    ``'mismatch-probe[wandb]'``.

    Distributed trainers: when ``torch.distributed`` is initialized and this process's rank is not 0,
    every method does nothing (``log_step`` returns None): gather the step's sequences to rank 0
    first, or pass ``rank_zero_only=False`` and give each rank a directory of its own. The rank is
    read at each call, so the monitor may be made before the process group.

    Threads: the methods may be called from any thread (an async rollout loop's); a lock keeps
    the directory consistent, and steps may arrive in any order. With ``background=True``,
    :meth:`log_step` only moves its inputs to the host, checks their shapes and copies them (10 to
    60 ms for a million tokens on a CPU, against about a second for the whole step in the caller's
    thread; ``benchmarks/bench_monitor.py``) and queues the step; a worker
    thread checks the values, reduces and writes it (at most ``queue_size`` steps wait, then the
    caller waits), :meth:`close` and :meth:`flush` wait for the queue to drain, and an error of the
    worker (a NaN log-prob, a full disk) is raised by the next call.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        sample_sequences: int = 8,
        baseline_steps: int = 20,
        alpha: float = 0.05,
        corrections: dict[str, Any] | None = None,
        tensorboard: bool | str | Path | None = None,
        wandb: Any = None,
        prefix: str = "mismatch/",
        flush_every: int = 50,
        n_boot: int = N_BOOT,
        seed: int = 0,
        background: bool = False,
        queue_size: int = 2,
        rank_zero_only: bool = True,
    ) -> None:
        if sample_sequences < 0:
            raise ConfigError(f"sample_sequences must be >= 0, got {sample_sequences}")
        if flush_every < 1:
            raise ConfigError(f"flush_every must be >= 1, got {flush_every}")
        if baseline_steps < 2:
            raise ConfigError(f"baseline_steps must be >= 2, got {baseline_steps}")
        if not 0.0 < alpha < 0.5:
            raise ConfigError(f"alpha must be in (0, 0.5), got {alpha}")
        if n_boot < 1 or queue_size < 1:
            raise ConfigError("n_boot and queue_size must be >= 1")
        try:
            self.thresholds = CorrectionThresholds(**(corrections or {}))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"corrections: {exc}".splitlines()[0]) from None
        for wanted, package in ((tensorboard, "tensorboard"), (wandb, "wandb")):
            if (wanted is True or isinstance(wanted, str | Path)) and importlib.util.find_spec(package) is None:
                raise _missing_extra(package)
        self.out = Path(out_dir)
        self.sample_sequences = sample_sequences
        self.baseline_steps = baseline_steps
        self.alpha = alpha
        self.corrections = dict(corrections or {})
        self.prefix = prefix
        self.flush_every = flush_every
        self.n_boot = n_boot
        self.seed = seed
        self.rank_zero_only = rank_zero_only
        self._tensorboard_option = tensorboard
        self._wandb_option = wandb
        self._tb: Any = None
        self._wandb: Any = None
        self._wandb_owned = False
        self._lock = threading.RLock()  # the directory and the exporters
        self._enqueue = threading.Lock()  # the closed flag and the queue
        self._opened = False
        self._closed = False
        self._record: TimelineRecord | None = None
        self._since_flush = 0
        self._seconds = 0.0  # time spent reducing and writing steps (the caller's or the worker's)
        self._notes: list[str] = []
        self._queue: queue.Queue[_Captured | None] | None = queue.Queue(maxsize=queue_size) if background else None
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    # --- the public methods -----------------------------------------------------------------

    @property
    def active(self) -> bool:
        """False on a rank other than 0 of an initialized process group (with ``rank_zero_only``)."""
        if not self.rank_zero_only:
            return True
        torch = sys.modules.get("torch")  # not imported: no process group can exist
        if torch is None:
            return True
        dist = getattr(torch, "distributed", None)
        return not (dist is not None and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)

    def log_step(
        self,
        step: int,
        token_ids: Any,
        logp_infer: Any,
        logp_train: Any,
        mask: Any,
        *,
        turn: Any = None,
        experts: tuple[Any, Any] | None = None,
    ) -> dict | None:
        """Reduce and write one training step; returns its ``all`` row (None on a rank other than
        0, and with ``background=True``, where the row is computed later).

        Each array is a padded batch ``[B, T]`` (torch tensors on any device and of any dtype, or
        NumPy arrays) or a list of B one-dimensional per-sequence arrays. ``token_ids``: the tokens;
        ``mask``: 1 (or True) on the tokens the policy generated, 0 on prompt, tool output and
        padding; ``logp_infer`` / ``logp_train``: the engine's and the trainer's log-prob of token t
        given the tokens before it, at t (values off the mask are ignored). Sequence ``b``'s sample
        id is ``b``; B counts every row. ``turn`` ``[B, T]``: the assistant turn of each generated
        token (default: each run of generated tokens is a turn, as ``dumps/samples.py: infer_turns``
        reads a dump). ``experts``: (engine's, trainer's) routed expert ids, int ``[B, T, MoE
        layers, top-k]``, row i the routing while reading token i (verl's ``routed_experts``), so
        the arrays must hold whole sequences (prompt included); gives ``routing_flip_share``."""
        if not self.active:
            return None
        self._raise_worker_error()
        if not self._opened:  # once; the worker holds the lock while it writes a step
            with self._lock:
                self._open()
        t0 = time.perf_counter()
        captured = self._capture(int(step), token_ids, logp_infer, logp_train, mask, turn, experts)
        if self._queue is None:
            with self._lock:
                if self._closed:
                    raise ConfigError("the monitor is closed: log_step after close()")
                row = self._reduce(self._digest(captured))
                self._seconds += time.perf_counter() - t0
                return row
        with self._enqueue:
            if self._closed:
                raise ConfigError("the monitor is closed: log_step after close()")
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="mismatch-probe-monitor", daemon=True)
                self._worker.start()
            self._seconds += time.perf_counter() - t0
            self._queue.put(captured)
        return None

    def flush(self) -> TimelineRecord | None:
        """Write ``steps.parquet``, ``timeline.json`` and the page now (after the queued steps)."""
        if not self.active:
            return None
        if self._queue is not None:
            self._queue.join()
        self._raise_worker_error()
        with self._lock:
            return self._finish("running")

    def close(self, *, status: str = "complete") -> TimelineRecord | None:
        """Drain the queue, write the final ``steps.parquet``, drift tests, ``timeline.json`` and
        page, and close the exporters. Returns the record (None when no step was ever logged, or
        on a rank other than 0). Closing twice is harmless."""
        if not self.active:
            return None
        with self._enqueue:
            if self._closed:
                return self._record
            self._closed = True
            if self._worker is not None and self._queue is not None:
                self._queue.put(None)
        if self._worker is not None:
            self._worker.join()
        try:
            self._raise_worker_error()
            with self._lock:
                return self._finish(status)
        finally:
            self._close_exporters()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._notes.append(f"the training loop stopped with {exc_type.__name__ if exc_type else 'an error'}: {exc}")
            try:
                self.close(status="stopped")
            except Exception:
                pass  # the loop's own error is the one to see
            return
        self.close()

    # --- the directory ----------------------------------------------------------------------

    def _open(self) -> None:
        """Create the directory (or continue one) and start the exporters: on the first step, so a
        monitor made on every rank before the process group writes only on rank 0."""
        if self._opened:
            return
        out = self.out
        if (out / TIMELINE_JSON).is_file():
            previous = read_timeline(out)
            if previous.source.get("format") != MONITOR:
                raise ConfigError(
                    f"{out} is the timeline of a {previous.source.get('format')} dump, not a monitor's",
                    hint="give the Monitor a directory of its own",
                )
        foreign = sorted(s for s, f in store.done_steps(out).items() if f != MONITOR)
        if foreign:
            raise ConfigError(
                f"{out} holds imported steps ({len(foreign)}, the first {foreign[0]}); a monitor continues only its own",
                hint="give the Monitor a directory of its own",
            )
        out.mkdir(parents=True, exist_ok=True)
        self._start_exporters()
        self._opened = True

    def _finish(self, status: str) -> TimelineRecord | None:
        if not self._opened or not store.done_steps(self.out):
            return None
        from mismatch_probe.timeline.runner import TimelineOptions, finish

        opts = TimelineOptions(
            format=MONITOR,
            source=MONITOR,
            out=str(self.out),
            workers=1,
            baseline_steps=self.baseline_steps,
            alpha=self.alpha,
            corrections=self.corrections,
            n_boot=self.n_boot,
        )
        self._record = finish(self.out, opts, None, {}, list(self._notes), self._seconds, status=status)
        self._since_flush = 0
        if self._tb is not None:
            self._tb.flush()
        return self._record

    # --- one step: the caller's part (convert, check shapes, copy) ----------------------------

    def _capture(
        self, step: int, token_ids: Any, logp_infer: Any, logp_train: Any, mask: Any, turn: Any, experts: Any
    ) -> _Captured:
        """The step's arrays, moved to the host once each; copied when a worker reads them later
        (the trainer may reuse its buffers as soon as log_step returns)."""
        if step < 0:
            raise DataError(f"step {step}: steps are numbered from 0")
        m, lengths = _batch(mask, "mask", "bool")
        like = (m.shape, lengths)
        li, _ = _batch(logp_infer, "logp_infer", "float", like=like)
        lt, _ = _batch(logp_train, "logp_train", "float", like=like)
        if self.sample_sequences:
            ids: np.ndarray | None = _batch(token_ids, "token_ids", "int", like=like)[0]
        else:
            _check_shape(token_ids, "token_ids", m.shape, lengths)
            ids = None
        t = None if turn is None else _batch(turn, "turn", "int", like=like)[0]
        routing = None
        if experts is not None:  # picked at the generated tokens where they lie: [B, T, ...] may be large
            rows, cols = np.nonzero(m)
            routing = _routing(experts, rows, cols, m.shape, lengths, step)
        if self._queue is not None and lengths is None:  # a list's arrays are new already
            m, li, lt = m.copy(), li.copy(), lt.copy()
            ids = None if ids is None else ids.copy()
            t = None if t is None else t.copy()
        return _Captured(step, m, lengths, li, lt, ids, t, routing)

    # --- one step: the reduction (the caller's, or the worker's with background=True) ----------

    def _digest(self, c: _Captured) -> _Work:
        """The generated tokens in sample order, checked and rounded, their turns, and the sampled
        sequences."""
        step, m = c.step, c.mask
        rows, cols = np.nonzero(m)  # row-major: sample order, positions ascending
        if not len(rows):
            raise DataError(f"step {step}: no generated token (the mask is 0 everywhere in {len(m)} sequences)")
        li = _checked(c.logp_infer[m], rows, cols, step, "logp_infer", engine=True)
        lt = _checked(c.logp_train[m], rows, cols, step, "logp_train", engine=False)
        if c.turn is None:
            starts = m.copy()
            starts[:, 1:] &= ~m[:, :-1]
            turns = (np.cumsum(starts, axis=1, dtype=np.int64) - 1)[m].astype(np.int16)
        else:
            given = c.turn[m]
            bad = (given < 0) | (given > np.iinfo(np.int16).max)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                raise DataError(
                    f"step {step}: sequence {rows[k]}, position {cols[k]} has turn {int(given[k])}; "
                    "turns of generated tokens are 0..32767"
                )
            turns = given.astype(np.int16)
        ei, et = c.experts if c.experts is not None else (None, None)
        sequences = None
        if self.sample_sequences and c.token_ids is not None:
            sequences = self._sampled(step, c.token_ids, rows, cols, li, lt, turns, c.lengths)
        return _Work(step, len(m), rows.astype(np.int64), cols.astype(np.int64), turns, li, lt, ei, et, sequences)

    def _sampled(
        self,
        step: int,
        token_ids: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        li: np.ndarray,
        lt: np.ndarray,
        turns: np.ndarray,
        lengths: np.ndarray | None,
    ) -> pa.Table:
        """The token rows of ``sample_sequences`` sequences: the worst half by their largest
        |p_train - p_infer|, the rest drawn at random (seeded by the step)."""
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        seq_rows = rows[starts]
        with np.errstate(over="ignore", invalid="ignore"):
            diff = np.abs(np.exp(lt.astype(np.float64)) - np.exp(li.astype(np.float64)))
        worst_value = np.maximum.reduceat(diff, starts)
        n = min(self.sample_sequences, len(seq_rows))
        n_worst = (n + 1) // 2
        order = np.lexsort((seq_rows, -worst_value))
        worst = order[:n_worst]
        rest = order[n_worst:]
        rng = np.random.default_rng([self.seed, step])
        drawn = rng.choice(rest, size=n - n_worst, replace=False) if n > n_worst else np.zeros(0, np.int64)
        chosen = sorted([(int(j), "worst") for j in worst] + [(int(j), "random") for j in drawn])
        ends = np.r_[starts[1:], len(rows)]
        parts: dict[str, list[np.ndarray]] = {name: [] for name in SEQUENCE_SCHEMA.names}
        for j, why in chosen:
            b = int(seq_rows[j])
            lo, hi = int(starts[j]), int(ends[j])
            length = int(lengths[b]) if lengths is not None else int(cols[hi - 1]) + 1
            at = cols[lo:hi]
            model = np.zeros(length, bool)
            model[at] = True
            turn = np.full(length, -1, np.int16)
            turn[at] = turns[lo:hi]
            logp = {}
            for name, values in (("logp_infer", li), ("logp_train", lt)):
                full = np.zeros(length, np.float32)
                full[at] = values[lo:hi]
                logp[name] = full
            parts["step"].append(np.full(length, step, np.int64))
            parts["sample_id"].append(np.full(length, b, np.int64))
            parts["why"].append(np.full(length, why, object))
            parts["position"].append(np.arange(length, dtype=np.int32))
            parts["token_id"].append(token_ids[b, :length].astype(np.int64))
            parts["is_model_token"].append(model)
            parts["turn"].append(turn)
            parts["logp_infer"].append(logp["logp_infer"])
            parts["logp_train"].append(logp["logp_train"])
        model_all = np.concatenate(parts["is_model_token"])
        arrays = []
        for field in SEQUENCE_SCHEMA:
            values = np.concatenate(parts[field.name])
            null = ~model_all if field.name.startswith("logp_") else None
            arrays.append(pa.array(values, type=field.type, mask=null))
        return pa.Table.from_arrays(arrays, schema=SEQUENCE_SCHEMA)

    def _reduce(self, work: _Work) -> dict:
        rows = step_rows(work.step, work.tokens(), self.thresholds, n_boot=self.n_boot)
        store.write_step(self.out, work.step, rows, MONITOR)
        seq_path = self.out / SAMPLED_SEQUENCES / f"{step_name(work.step)}.parquet"
        if work.sequences is not None:
            with atomic_path(seq_path) as tmp:
                pq.write_table(work.sequences, tmp, compression="zstd")
        else:
            seq_path.unlink(missing_ok=True)  # a step logged again without sequences keeps none
        row = rows[0]
        self._export(work.step, row)
        self._since_flush += 1
        if self._since_flush >= self.flush_every:
            try:
                self._finish("running")
            except Exception as exc:  # a refresh must not stop the training; close() tries again
                self._since_flush = 0
                warnings.warn(f"mismatch_probe.Monitor: refreshing {self.out} failed: {exc}", stacklevel=2)
        return row

    def _work(self) -> None:
        assert self._queue is not None
        while True:
            work = self._queue.get()
            try:
                if work is None:
                    return
                t0 = time.perf_counter()
                with self._lock:
                    self._reduce(self._digest(work))
                    self._seconds += time.perf_counter() - t0
            except BaseException as exc:
                if self._error is None:
                    self._error = exc
            finally:
                self._queue.task_done()

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    # --- TensorBoard and W&B --------------------------------------------------------------

    def _start_exporters(self) -> None:
        tb = self._tensorboard_option
        if tb is not None and tb is not False:
            if importlib.util.find_spec("tensorboard") is None:
                raise _missing_extra("tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out / "tensorboard" if tb is True else Path(tb)))
        wb = self._wandb_option
        if wb is None or wb is False:
            return
        if wb is True:
            if importlib.util.find_spec("wandb") is None:
                raise _missing_extra("wandb")
            import wandb

            run = wandb.run
            if run is None:
                run = wandb.init(project="mismatch-probe", name=self.out.name, dir=str(self.out))
                self._wandb_owned = True
            wb = run
        wb.define_metric(f"{self.prefix}step")
        wb.define_metric(f"{self.prefix}*", step_metric=f"{self.prefix}step")
        self._wandb = wb

    def _export(self, step: int, row: dict) -> None:
        if self._tb is None and self._wandb is None:
            return
        values = {f"{self.prefix}{k}": row[k] for k in EXPORTED if row.get(k) is not None}
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log({f"{self.prefix}step": step, **values})

    def _close_exporters(self) -> None:
        with self._lock:
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            if self._wandb is not None and self._wandb_owned:
                self._wandb.finish()
            self._wandb = None


# --- inputs: torch tensors or NumPy arrays, padded or one array per sequence -------------------


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _numpy(x: Any, kind: str) -> np.ndarray:
    """One array as NumPy: a tensor detached and moved once (floats as float32, as ``.float()``)."""
    if _is_torch(x):
        x = x.detach()
        if kind == "float":
            x = x.float()
        return x.cpu().numpy()
    return np.asarray(x)


def _as(a: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bool":
        return a != 0 if a.dtype != bool else a
    if kind == "float":
        return a.astype(np.float32, copy=False)
    if a.dtype.kind not in "iu":
        raise DataError(f"expected integers, got {a.dtype}")
    return a


def _batch(
    x: Any, what: str, kind: str, like: tuple[tuple[int, ...], np.ndarray | None] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """``x`` as a padded ``[B, T]`` array, and each sequence's length when it came as a list."""
    if isinstance(x, list | tuple):
        if like is not None and like[1] is None:
            raise DataError(f"{what} is a list of sequences but mask is a padded batch: give both alike")
        if not x:
            raise DataError(f"{what}: no sequences")
        if all(_is_torch(s) for s in x):
            import torch

            flat = [s.detach().reshape(-1) for s in x]
            lengths = np.array([len(s) for s in flat], np.int64)
            padded = torch.nn.utils.rnn.pad_sequence(flat, batch_first=True)  # on the tensors' device
            out = _as(_numpy(padded, kind), kind)
        else:
            seqs = [_as(_numpy(s, kind).reshape(-1), kind) for s in x]
            lengths = np.array([len(s) for s in seqs], np.int64)
            out = np.zeros((len(seqs), int(lengths.max(initial=0))), dtype=seqs[0].dtype)
            for i, s in enumerate(seqs):
                out[i, : len(s)] = s
        if like is not None and like[1] is not None and not np.array_equal(lengths, like[1]):
            raise DataError(f"{what}: sequence lengths {_first_difference(lengths, like[1])}")
        return out, lengths
    if like is not None and like[1] is not None:
        raise DataError(f"{what} is a padded batch but mask is a list of sequences: give both alike")
    out = _as(_numpy(x, kind), kind)
    if out.ndim != 2:
        raise DataError(f"{what} has shape {list(out.shape)}; expected a padded batch [B, T] or a list of sequences")
    if like is not None and out.shape != like[0]:
        raise DataError(f"{what} has shape {list(out.shape)}, mask {list(like[0])}")
    return out, None


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    if len(got) != len(want):
        return f"of {len(got)} sequences, mask has {len(want)}"
    b = int(np.flatnonzero(got != want)[0])
    return f"differ from mask's (sequence {b}: {got[b]} tokens, mask {want[b]})"


def _check_shape(x: Any, what: str, shape: tuple[int, ...], lengths: np.ndarray | None) -> None:
    """``token_ids`` is only read for the sampled sequences: its shape is checked without copying it."""
    if lengths is not None:
        if not isinstance(x, list | tuple) or len(x) != len(lengths):
            raise DataError(f"{what}: expected a list of {len(lengths)} sequences, like mask")
        got = np.array([int(np.prod(tuple(s.shape))) if hasattr(s, "shape") else len(s) for s in x])
        if not np.array_equal(got, lengths):
            raise DataError(f"{what}: sequence lengths {_first_difference(got, lengths)}")
        return
    got_shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
    if tuple(got_shape) != shape:
        raise DataError(f"{what} has shape {list(got_shape)}, mask {list(shape)}")


def _checked(
    values: np.ndarray, rows: np.ndarray, cols: np.ndarray, step: int, what: str, *, engine: bool
) -> np.ndarray:
    """The log-probs of the generated tokens, rounded as an import rounds a dump's: float32, and
    values in (0, 1e-3] (bf16/fp16 rounding of a near-certain token) set to 0. NaN, +inf and larger
    values are refused, as is -inf from the engine (it sampled the token); the trainer's -inf is a
    zero probability, counted as such (``n_zero_prob_train``)."""
    bad = np.isnan(values) | (values > LOGP_ROUNDING)
    if engine:
        bad |= np.isneginf(values)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"step {step}: {what} of sequence {rows[k]} at position {cols[k]} is {float(values[k])} "
            f"({int(bad.sum())} such values); log-probs of generated tokens are finite and <= 0"
        )
    return np.minimum(values, np.float32(0.0))


def _routing(
    experts: Any, rows: np.ndarray, cols: np.ndarray, shape: tuple[int, ...], lengths: np.ndarray | None, step: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each generated token's routed experts on both sides, sorted: row t - 1 (the routing while
    reading the token before it) for the token at t."""
    if not isinstance(experts, Sequence) or len(experts) != 2:
        raise DataError("experts: give a pair (the engine's, the trainer's) of [B, T, MoE layers, top-k] arrays")
    if np.any(cols == 0):
        b = int(rows[np.flatnonzero(cols == 0)[0]])
        raise DataError(
            f"step {step}: sequence {b} has a generated token at position 0; with experts, pass whole sequences "
            "(the prompt included): a token's routing is that of the position before it"
        )
    out = []
    for side, x in zip(("engine", "trainer"), experts):
        if isinstance(x, list | tuple):
            if lengths is None or len(x) != len(lengths):
                raise DataError(
                    f"experts ({side}): a list of sequences goes with a list of sequences of the same count"
                )
            first = _numpy(x[0], "int")
            full = np.zeros((len(x), shape[1], *first.shape[1:]), dtype=np.int64)
            for b, s in enumerate(x):
                a = _numpy(s, "int")
                if a.ndim != 3 or a.shape[0] not in (lengths[b], lengths[b] - 1):
                    raise DataError(
                        f"experts ({side}): sequence {b} has shape {list(a.shape)}; expected "
                        f"[{lengths[b]} or {lengths[b] - 1} positions, MoE layers, top-k]"
                    )
                full[b, : len(a)] = a
            picked = full[rows, cols - 1]
        elif _is_torch(x):
            import torch

            if tuple(x.shape[:2]) != tuple(shape) or x.ndim != 4:
                raise DataError(
                    f"experts ({side}) has shape {list(x.shape)}; expected [{shape[0]}, {shape[1]}, layers, k]"
                )
            r = torch.as_tensor(rows, device=x.device)
            c = torch.as_tensor(cols - 1, device=x.device)
            picked = x.detach()[r, c].cpu().numpy()
        else:
            a = np.asarray(x)
            if a.ndim != 4 or a.shape[:2] != tuple(shape):
                raise DataError(
                    f"experts ({side}) has shape {list(a.shape)}; expected [{shape[0]}, {shape[1]}, layers, k]"
                )
            picked = a[rows, cols - 1]
        if picked.dtype.kind not in "iu":
            raise DataError(f"experts ({side}): expert ids are integers, got {picked.dtype}")
        out.append(np.sort(picked, axis=-1).astype(np.int32))
    if out[0].shape != out[1].shape:
        raise DataError(
            f"experts: the engine's are {list(out[0].shape[1:])} per token, the trainer's {list(out[1].shape[1:])}"
        )
    return out[0], out[1]

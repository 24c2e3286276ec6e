"""One step of a framework's dump, read as the model tokens a timeline row reduces.

The same readers and the same checks as ``mismatch-probe import`` (``dumps/``,
:func:`~mismatch_probe.dumps.samples.to_rollout`), without a run directory: a timeline keeps one row
per step, and full run directories only for the steps worth opening. The trainer's own log-probs
in the dump are the reference side, so a step whose dump lacks them cannot be diagnosed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mismatch_probe.analysis.timeline import StepTokens
from mismatch_probe.dumps import get_format, open_dump
from mismatch_probe.dumps.samples import (
    DumpSample,
    SampleColumns,
    runs_begun,
    sampled_logp_ok,
    scatter_to_full,
    to_rollout,
)
from mismatch_probe.errors import ConfigError

# without --model a token id is checked only against what a table can hold
NO_VOCABULARY = 2**31 - 1


@dataclass(frozen=True)
class DumpSource:
    """Where a run's steps are and how to read them (what ``import`` takes as flags)."""

    format: str
    path: str
    trust_pickle: bool = False
    trainer_path: str | None = None
    vocab_size: int = NO_VOCABULARY
    options: dict = field(default_factory=dict)  # recorded in each step's fingerprint


@dataclass
class ReadStep:
    tokens: StepTokens
    notes: list[str]
    settings: dict


CHUNK = 256  # samples checked together: one vectorized pass over their tokens instead of one per sample


def read_step(source: DumpSource, step: int) -> ReadStep:
    """The model tokens of ``step`` with the engine's and the trainer's log-probs.

    Every sample passes the checks of :func:`~mismatch_probe.dumps.samples.to_rollout` (token ids
    in the vocabulary, the first token not sampled, one log-prob per model token or per token,
    finite log-probs <= 0, turns), made on many samples' tokens at once and without building a
    rollout: a reader's batches of flat columns where it has them (``sample_columns``: generic
    Parquet, verl), else :data:`CHUNK` samples gathered (:class:`_Chunk`). A batch or chunk that
    fails, and a sample that is unusual (ids stored as floats, turns given, no trainer log-probs),
    go through ``to_rollout`` one sample at a time, in order, so an error is the import's, to the
    message, and names the first sample it finds amiss, whatever else follows it."""
    fmt = get_format(source.format)

    def reader():
        return open_dump(
            fmt, source.path, step=step, trust_pickle=source.trust_pickle, trainer_path=source.trainer_path
        )

    dump = reader()
    batches = dump.sample_columns()
    if batches is None:
        parts, n_samples, first_where = _read_samples(dump.samples(), 0, source.vocab_size, fmt.name, step)
    else:
        parts, n_samples, first_where = [], 0, None
        for batch in batches:
            checked = _batch_tokens(batch, n_samples, source.vocab_size)
            if checked is not None:
                parts.append(checked)
            else:
                parts += _read_samples(batch.samples(), n_samples, source.vocab_size, fmt.name, step)[0]
            n_samples += batch.n
        if not any(len(p[1]) for p in parts):  # the sample reader's own refusal, to the word
            dump = reader()
            parts, n_samples, first_where = _read_samples(dump.samples(), 0, source.vocab_size, fmt.name, step)
    parts = [p for p in parts if len(p[1])]
    if not parts:
        where = first_where or f"{source.path} (step {step})"
        raise ConfigError(
            f"step {step}: no sample has a generated token ({n_samples} samples; the first is {where})",
            hint="the dump's masks or lengths cover only the prompts: check the step's files",
        )
    sample_id, position, turn, engine, trainer = (np.concatenate(column) for column in zip(*parts, strict=True))
    tokens = StepTokens(
        sample_id=sample_id.astype(np.int64, copy=False),
        turn=turn.astype(np.int16, copy=False),
        position=position.astype(np.int64, copy=False),
        logp_infer=engine.astype(np.float64),
        logp_train=trainer.astype(np.float64),
        n_samples=n_samples,
    )
    return ReadStep(tokens, list(dump.notes), dict(dump.settings))


def _read_samples(samples, k0: int, vocab_size: int, fmt: str, step: int) -> tuple[list, int, str | None]:
    """Samples one at a time, numbered from ``k0``, gathered in chunks (:class:`_Chunk`): (their model
    tokens, how many samples, the first one's ``where``). A reader's error is raised once the
    samples before it are checked."""
    parts: list[ModelTokens] = []
    chunk = _Chunk(vocab_size)
    n_samples = 0
    first_where = None
    numbered = enumerate(samples, k0)
    failed: Exception | None = None
    while True:
        try:
            k, sample = next(numbered)
        except StopIteration:
            break
        except Exception as exc:  # the reader's own error, raised once the samples before it are checked
            failed = exc
            break
        first_where = first_where or sample.where
        n_samples += 1
        if not chunk.add(k, sample):
            chunk.flush(parts, fmt, step)
            parts.append(_one_sample(k, sample, vocab_size, fmt, step))
        elif len(chunk) >= CHUNK:
            chunk.flush(parts, fmt, step)
    chunk.flush(parts, fmt, step)
    if failed is not None:
        raise failed
    return parts, n_samples, first_where


def _batch_tokens(batch: SampleColumns, k0: int, vocab_size: int) -> ModelTokens | None:
    """A batch's model tokens (its samples numbered from ``k0``) once its flat columns pass the
    checks :class:`_Chunk` makes; None: its samples go one at a time."""
    flat = batch.flat
    if flat is None or batch.n == 0:
        return None
    ids, mask, offsets = flat.token_ids, flat.model_mask, flat.offsets
    lengths = np.diff(offsets)
    if lengths.min() < 2 or mask[offsets[:-1]].any():
        return None
    at = np.flatnonzero(mask)
    counts = np.diff(np.searchsorted(at, offsets))
    engine = _at_model_tokens(flat.logp_engine, flat.engine_offsets, offsets, counts, at)
    trainer = _at_model_tokens(flat.logp_trainer, flat.trainer_offsets, offsets, counts, at)
    if engine is None or trainer is None:
        return None
    return _model_tokens(np.arange(k0, k0 + batch.n), lengths, ids, mask, at, counts, engine, trainer, vocab_size)


def _at_model_tokens(values, offsets, token_offsets, counts, at) -> np.ndarray | None:
    """float64 log-probs at the model tokens, from one per token or one per model token in every
    row (``scatter_to_full``'s two counts); None for rows that mix them or have another count."""
    if np.array_equal(offsets, token_offsets):
        return values[at].astype(np.float64, copy=False)
    if np.array_equal(np.diff(offsets), counts):
        return values.astype(np.float64, copy=False)
    return None


def _model_tokens(ks, lengths, ids, mask, at, counts, engine, trainer, vocab_size) -> ModelTokens | None:
    """The model tokens of samples ``ks`` laid end to end (``lengths`` tokens each; ``at`` the
    model tokens' indices, ``counts`` per sample; ``engine``, ``trainer``: float64 log-probs at
    them) once every check passes; None otherwise."""
    if ids.min() < 0 or ids.max() >= vocab_size:
        return None
    engine, trainer = _checked_logp(engine), _checked_logp(trainer)
    if engine is None or trainer is None:
        return None
    starts = np.cumsum(lengths) - lengths
    sample_id = np.repeat(ks, counts)
    # each run of model tokens is a turn (infer_turns): the runs begun in the sample so far, less one
    # (a sample's first token is never a model token, so a run never spans two samples)
    runs = runs_begun(mask)[at]
    some = counts > 0
    first = (np.cumsum(counts) - counts)[some]
    turn = runs - np.repeat(runs[first], counts[some])
    return sample_id, at - np.repeat(starts, counts), turn.astype(np.int16), engine, trainer


# the model tokens of samples: sample ids, positions, int16 turns, both sides' log-probs (float32,
# min(logp, 0), as to_rollout stores them)
ModelTokens = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class _Chunk:
    """Samples waiting to be checked together. :meth:`add` takes a sample whose shapes are
    ``to_rollout``'s (its values are checked at :meth:`flush`) and refuses any other."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._clear()

    def _clear(self) -> None:
        self.samples: list[tuple[int, DumpSample]] = []
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.engine: list[np.ndarray] = []
        self.trainer: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, k: int, sample: DumpSample) -> bool:
        if sample.logp_trainer is None or sample.turn is not None:
            return False
        try:
            ids = np.asarray(sample.token_ids).reshape(-1)
            mask = np.asarray(sample.model_mask).reshape(-1)
            mask = mask if mask.dtype == bool else mask.astype(bool)
            n = len(ids)
            if ids.dtype.kind not in "iu" or n < 2 or len(mask) != n or mask[0]:
                return False
            engine = _full_length(sample.logp_engine, mask)
            trainer = _full_length(sample.logp_trainer, mask)
        except (TypeError, ValueError, OverflowError):  # not numbers: to_rollout says so (or raises as it does)
            return False
        if engine is None or trainer is None:
            return False
        self.samples.append((k, sample))
        self.ids.append(ids)
        self.masks.append(mask)
        self.engine.append(engine)
        self.trainer.append(trainer)
        return True

    def flush(self, parts: list[ModelTokens], fmt: str, step: int) -> None:
        """The waiting samples' model tokens onto ``parts``, once checked; a chunk that fails goes
        through ``to_rollout`` sample by sample, raising the first sample's error."""
        if not self.samples:
            return
        checked = self._checked()
        if checked is not None:
            parts.append(checked)
        else:
            parts.extend(_one_sample(k, sample, self.vocab_size, fmt, step) for k, sample in self.samples)
        self._clear()

    def _checked(self) -> ModelTokens | None:
        mask = np.concatenate(self.masks)
        lengths = np.fromiter((len(m) for m in self.masks), np.int64, len(self.masks))
        at = np.flatnonzero(mask)
        counts = np.diff(np.searchsorted(at, np.append(np.cumsum(lengths) - lengths, len(mask))))
        ks = np.fromiter((k for k, _ in self.samples), np.int64, len(self.samples))
        engine, trainer = np.concatenate(self.engine)[at], np.concatenate(self.trainer)[at]
        return _model_tokens(ks, lengths, np.concatenate(self.ids), mask, at, counts, engine, trainer, self.vocab_size)


def _full_length(values, mask: np.ndarray) -> np.ndarray | None:
    """Log-probs as ``to_rollout`` reads them (``scatter_to_full``); None for a count it refuses
    (``to_rollout`` then says so)."""
    try:
        return scatter_to_full(values, mask, "log-probs", "")
    except ConfigError:
        return None


def _checked_logp(v: np.ndarray) -> np.ndarray | None:
    """float32 of ``min(logp, 0)``, as ``to_rollout`` stores a sampled token's log-prob; None
    unless every one passes its rule (``sampled_logp_ok``)."""
    return np.minimum(v, 0.0).astype(np.float32) if sampled_logp_ok(v) else None


def _one_sample(k: int, sample: DumpSample, vocab_size: int, fmt: str, step: int) -> ModelTokens:
    """One sample through ``to_rollout``: its error, or its model tokens."""
    # a dump's routing is the engine's alone: there is no trainer routing to compare it with
    sample.experts = None
    checked = to_rollout(sample, k, vocab_size=vocab_size)
    if checked.logp_trainer is None:
        raise ConfigError(
            f"step {step}: {sample.where} has no trainer log-probs, so the step has no mismatch to measure "
            "without re-scoring",
            hint=f"import the step (mismatch-probe import {fmt} ... --step {step}) and score it with the reference",
        )
    r = checked.rollout
    at = np.flatnonzero(r.is_model_token)
    return np.full(len(at), k, np.int64), at, r.turn[at], r.logp_infer[at], checked.logp_trainer[at]


def step_files(source: DumpSource) -> dict[int, list[Path]]:
    """Every step the source holds, with the files each step's import reads."""
    from mismatch_probe.dumps import list_steps

    return list_steps(get_format(source.format), Path(source.path))

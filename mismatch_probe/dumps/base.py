"""What a dump reader is: the files of one training step, read one sample at a time.

Readers stream: :meth:`DumpReader.samples` yields one :class:`~mismatch_probe.dumps.samples.DumpSample`
at a time, reading a file (or a batch of rows) at a time, so an import holds one file and one shard
of rollouts in memory, never the whole dump.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mismatch_probe.dumps.samples import DumpSample, SampleColumns, check_step_has_model_tokens
from mismatch_probe.errors import ConfigError

# the step of a dump whose names carry no step number (a single file, a flat directory)
UNNUMBERED = 0


Listing = dict[int, list[Path]]  # step -> the files its import reads


class DumpReader:
    """One training step's dump. Subclasses implement :meth:`available_steps` (every step a path
    holds and the files each one's import reads), set :attr:`files` and :attr:`step` in
    ``__init__`` from it (checking that the path is what their framework writes) and implement
    :meth:`read_samples`."""

    format = ""

    def __init__(self, path: Path, listing: Listing | None = None) -> None:
        self.path = path
        # the caller's available_steps(path), made already (a timeline lists a run's steps once
        # per pass, not once for each step it opens)
        self._listing = listing
        self.files: list[Path] = []
        self.step: int | None = None
        # what the reader found out about the dump, for run.json and the report (one line each)
        self.notes: list[str] = []
        # what the dump itself says about how it was sampled (e.g. a temperature), by spec key
        self.settings: dict[str, Any] = {}
        # whether the dump carries the trainer's log-probs (None: known once read)
        self.has_trainer: bool | None = None
        # False: the import takes the engine side alone (readers then skip the trainer's files)
        self.want_trainer = True
        # the tokenizer the run saved beside its dump (slime's --dump-details), checked against --model's
        self.tokenizer_dir: Path | None = None

    @classmethod
    def available_steps(cls, path: Path) -> dict[int, list[Path]]:
        """The steps ``path`` holds, each with every file its import reads (what a live run's
        watcher checks has finished writing), found from names alone: nothing is opened. A dump
        whose names carry no step number is one step, :data:`UNNUMBERED`. Empty when ``path``
        holds none; a path that is not this format's is refused."""
        raise NotImplementedError

    def listed_steps(self, path: Path) -> Listing:
        return self._listing if self._listing is not None else self.available_steps(path)

    def samples(self) -> Iterator[DumpSample]:
        """The step's samples, one at a time; a step in which no sample has a generated token is
        refused once read (:func:`~mismatch_probe.dumps.samples.check_step_has_model_tokens`)."""
        return check_step_has_model_tokens(self.read_samples())

    def read_samples(self) -> Iterator[DumpSample]:
        raise NotImplementedError

    def sample_columns(self) -> Iterator[SampleColumns] | None:
        """The step's samples as batches of flat columns, in :meth:`read_samples`' order, where
        the format stores them so (a timeline reads them without a Python object per sample); None:
        one at a time only. Unlike :meth:`samples`, a step without model tokens is not refused here."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"files": [f.name for f in self.files], "step": self.step, "notes": list(self.notes)}


STEP_NUMBER = re.compile(r"(\d+)")


def files_by_step(directory: Path, pattern: str) -> dict[int, list[Path]]:
    """The files under ``directory`` matching ``pattern`` (a glob), grouped by the last number in
    their name (the step or rollout id)."""
    grouped: dict[int, list[Path]] = {}
    for f in sorted(directory.glob(pattern)):
        numbers = STEP_NUMBER.findall(f.stem)
        if f.is_file() and numbers:
            grouped.setdefault(int(numbers[-1]), []).append(f)
    return grouped


def select_step(
    steps: dict[int, list[Path]], step: int | None, path: Path, what: str, *, missing_hint: str | None = None
) -> tuple[int, list[Path]]:
    """The files of ``step`` in ``steps`` (a reader's :meth:`DumpReader.available_steps`); without
    one, the dump's only step. Several steps were sampled with several versions of the weights,
    and only one is the checkpoint the reference loads."""
    if not steps:
        raise ConfigError(f"{path} holds no {what}")
    if step is None:
        if len(steps) > 1:
            ordered = sorted(steps)
            shown = ", ".join(map(str, ordered[:8])) + (", ..." if len(ordered) > 8 else "")
            raise ConfigError(
                f"{path} holds {what} of {len(ordered)} steps ({shown})",
                hint="pass --step N: the step sampled with the weights --model holds",
            )
        step = next(iter(steps))
    if step not in steps:
        raise ConfigError(
            f"{path} has no {what} of step {step}",
            hint=missing_hint or f"its steps: {', '.join(map(str, sorted(steps)))}",
        )
    return step, steps[step]


def one_file_per_step(grouped: dict[int, list[Path]], path: Path, *, hint: str) -> dict[int, Path]:
    """Each step's single file. Two files of one step are two runs' (``hint`` says how to pick
    one): refused for every step, so neither an import nor a timeline mixes runs."""
    for step, files in grouped.items():
        if len(files) > 1:
            raise ConfigError(
                f"{path} holds step {step} of {len(files)} runs: {', '.join(str(f) for f in files)}", hint=hint
            )
    return {step: files[0] for step, files in grouped.items()}


def pick_step(
    grouped: dict[int, list[Path]], step: int | None, path: Path, what: str, *, one_run: str
) -> tuple[int, Path]:
    """The file of ``step``; without one, the dump's only step. Two files of one step are two
    runs (``one_run`` says how to pick one)."""
    step, files = select_step(grouped, step, path, what)
    if len(files) > 1:
        raise ConfigError(
            f"{path} holds step {step} of {len(files)} runs: {', '.join(str(f) for f in files)}", hint=one_run
        )
    return step, files[0]

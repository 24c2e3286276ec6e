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

from mismatch_probe.dumps.samples import DumpSample
from mismatch_probe.errors import ConfigError


class DumpReader:
    """One training step's dump. Subclasses set :attr:`files` and :attr:`step` in ``__init__``
    (checking that the path is what their framework writes) and implement :meth:`samples`."""

    format = ""

    def __init__(self, path: Path) -> None:
        self.path = path
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

    def samples(self) -> Iterator[DumpSample]:
        raise NotImplementedError

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


def pick_step(
    grouped: dict[int, list[Path]], step: int | None, path: Path, what: str, *, one_run: str
) -> tuple[int, Path]:
    """The file of ``step``; without one, the dump's only step. Several steps were sampled with
    several versions of the weights, and only one is the checkpoint the reference loads. Two files
    of one step are two runs (``one_run`` says how to pick one)."""
    if not grouped:
        raise ConfigError(f"{path} holds no {what}")
    if step is None:
        if len(grouped) > 1:
            steps = sorted(grouped)
            shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
            raise ConfigError(
                f"{path} holds {what} of {len(steps)} steps ({shown})",
                hint="pass --step N: the step sampled with the weights --model holds",
            )
        step = next(iter(grouped))
    if step not in grouped:
        raise ConfigError(
            f"{path} has no {what} of step {step}", hint=f"its steps: {', '.join(map(str, sorted(grouped)))}"
        )
    files = grouped[step]
    if len(files) > 1:
        raise ConfigError(
            f"{path} holds step {step} of {len(files)} runs: {', '.join(str(f) for f in files)}", hint=one_run
        )
    return step, files[0]

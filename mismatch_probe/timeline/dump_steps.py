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
from mismatch_probe.dumps.samples import to_rollout
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


def read_step(source: DumpSource, step: int) -> ReadStep:
    """The model tokens of ``step`` with the engine's and the trainer's log-probs."""
    fmt = get_format(source.format)
    reader = open_dump(fmt, source.path, step=step, trust_pickle=source.trust_pickle, trainer_path=source.trainer_path)
    sample_ids, turns, positions, li, lt = [], [], [], [], []
    n_samples = 0
    first_where = None
    for k, sample in enumerate(reader.samples()):
        first_where = first_where or sample.where
        # a dump's routing is the engine's alone: there is no trainer routing to compare it with
        sample.experts = None
        checked = to_rollout(sample, k, vocab_size=source.vocab_size)
        r = checked.rollout
        n_samples += 1
        if checked.logp_trainer is None:
            raise ConfigError(
                f"step {step}: {sample.where} has no trainer log-probs, so the step has no mismatch to measure "
                "without re-scoring",
                hint=f"import the step (mismatch-probe import {fmt.name} ... --step {step}) and score it with the reference",
            )
        at = np.flatnonzero(r.is_model_token)
        if not len(at):
            continue
        sample_ids.append(np.full(len(at), k, np.int64))
        turns.append(r.turn[at])
        positions.append(at)
        li.append(r.logp_infer[at])
        lt.append(checked.logp_trainer[at])
    if not li:
        where = first_where or f"{source.path} (step {step})"
        raise ConfigError(
            f"step {step}: no sample has a generated token ({n_samples} samples; the first is {where})",
            hint="the dump's masks or lengths cover only the prompts: check the step's files",
        )
    tokens = StepTokens(
        sample_id=np.concatenate(sample_ids),
        turn=np.concatenate(turns).astype(np.int16),
        position=np.concatenate(positions).astype(np.int64),
        logp_infer=np.concatenate(li).astype(np.float64),
        logp_train=np.concatenate(lt).astype(np.float64),
        n_samples=n_samples,
    )
    return ReadStep(tokens, list(reader.notes), dict(reader.settings))


def step_files(source: DumpSource) -> dict[int, list[Path]]:
    """Every step the source holds, with the files each step's import reads."""
    from mismatch_probe.dumps import list_steps

    return list_steps(get_format(source.format), Path(source.path))

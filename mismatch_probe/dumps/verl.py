"""verl's rollout cache: the agent loop's output ``DataProto``, pickled by ``save_to_disk``.

Where verl writes it (``RolloutSkip``; needs ``actor_rollout_ref.rollout.calculate_log_probs=True``
for the engine's log-probs):

- 0.9: ``skip.rollout.enable=True skip.rollout.steps=[N]`` ->
  ``{dump_dir}/{experiment}_{project}/GBS{b}_N{n}_in{P}_out{R}/{step}/gen_batch.dp``;
- 0.8: ``actor_rollout_ref.rollout.skip.enable=True`` -> ``.../genstep_{step:06d}/gen_batch.dp``;
- 0.7 and before: one file, ``{dump_dir}/{experiment}_{project}_GBS{b}__N{n}``, one step whose
  number it does not record (step 0 in a listing).

The batch (verl/experimental/agent_loop/agent_loop.py ``_postprocess``): ``prompts`` [B, P]
left-padded, ``responses`` [B, R] right-padded (model and tool tokens), ``attention_mask``
[B, P + R] (0 on both paddings), ``response_mask`` [B, R] (1 on model tokens; 0 on tool output and
padding), ``rollout_log_probs`` [B, R] (0.0 off model tokens), optionally ``routed_experts``
[B, P + R, layers, k] (R3; the row of each input position, 0 where not recorded) and, in a batch
saved after ``compute_log_prob``, ``old_log_probs`` [B, R] (the trainer's). verl's vLLM rollout
returns ``processed_logprobs`` (temperature, top-k, top-p); its actor scores ``logits / T``.

Loading it unpickles, so it needs ``--trust-pickle`` and goes through :mod:`.safe_pickle`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.dumps.base import UNNUMBERED, DumpReader, Listing, one_file_per_step, select_step
from mismatch_probe.dumps.samples import DumpSample, FlatSamples, SampleColumns
from mismatch_probe.errors import ConfigError

GEN_BATCH = "gen_batch.dp"
STEP_DIR = re.compile(r"^(?:genstep_)?(\d+)$")
SINGLE_FILE = "*_GBS*__N*"  # 0.7's one-file cache, {experiment}_{project}_GBS{b}__N{n}
WHAT = f"verl rollout caches (<step>/{GEN_BATCH})"
TEXT_ONLY = (
    "{path} looks like verl's trainer.rollout_data_dir output, which holds decoded text (input, output, score), "
    "not token ids or log-probs"
)
HOW_TO_DUMP = (
    "dump the rollout cache instead: skip.rollout.enable=True skip.rollout.steps=[N] (verl 0.9; "
    "actor_rollout_ref.rollout.skip.enable=True in 0.8) with actor_rollout_ref.rollout.calculate_log_probs=True, "
    "then import its gen_batch.dp with --trust-pickle"
)


class VerlDump(DumpReader):
    format = "verl"

    def __init__(
        self,
        path: Path,
        *,
        step: int | None = None,
        listing: Listing | None = None,
        trust_pickle: bool = False,
        **_: Any,
    ) -> None:
        super().__init__(path, listing=listing)
        picked, self.files = select_step(self.listed_steps(path), step, path, WHAT)
        numbered = STEP_DIR.match(self.files[0].parent.name) is not None
        self.step = picked if numbered else step
        if not trust_pickle:
            raise ConfigError(
                f"{self.files[0]} is a pickle (verl's DataProto); unpickling a file can run code it names",
                hint="pass --trust-pickle to read it through an allow-list of what a DataProto holds "
                "(tensors, NumPy arrays, plain data); nothing else is run or imported",
            )

    @classmethod
    def available_steps(cls, path: Path) -> dict[int, list[Path]]:
        """Each ``<step>/gen_batch.dp`` (0.9) or ``genstep_<step>/gen_batch.dp`` (0.8) under
        ``path``; a 0.7 cache (one file) is one step."""
        if path.is_file():
            _refuse_text(path)
            match = STEP_DIR.match(path.parent.name)
            return {int(match.group(1)) if match else UNNUMBERED: [path]}
        grouped: dict[int, list[Path]] = {}
        for f in sorted(path.rglob(GEN_BATCH)):
            match = STEP_DIR.match(f.parent.name)
            if match:
                grouped.setdefault(int(match.group(1)), []).append(f)
        if not grouped:
            single = [f for f in sorted(path.glob(SINGLE_FILE)) if f.is_file()]
            if single:
                grouped = {UNNUMBERED: single}
            elif any(path.glob("*.jsonl")):
                _refuse_text(next(iter(sorted(path.glob("*.jsonl")))))
        one = "give that run's directory, or the gen_batch.dp file itself"
        return {s: [f] for s, f in sorted(one_file_per_step(grouped, path, hint=one).items())}

    def read_samples(self) -> Iterator[DumpSample]:
        yield from _samples(self.files[0].name, self._load())

    def sample_columns(self) -> Iterator[SampleColumns] | None:
        """The batch as one :class:`SampleColumns`: its tensors' rows gathered flat at once."""
        return self._columns()

    def _columns(self) -> Iterator[SampleColumns]:
        batch = self._load()
        yield SampleColumns(len(batch.prompts), lambda: _samples(self.files[0].name, batch), _flat(batch))

    def _load(self) -> _Batch:
        """The rollout's tensors as NumPy (its checks made, its notes recorded)."""
        from mismatch_probe.dumps.safe_pickle import UnsafePickle, load_data_proto

        f = self.files[0]
        try:
            content = load_data_proto(f.read_bytes())
        except UnsafePickle as exc:
            raise ConfigError(f"{f} was refused: {exc}", hint="nothing in it was run") from None
        except Exception as exc:  # truncated, not a pickle at all
            raise ConfigError(f"{f} is not a readable verl DataProto ({type(exc).__name__}: {exc})") from None
        batch = content.batch or {}
        missing = [k for k in ("prompts", "responses", "attention_mask", "response_mask") if k not in batch]
        if missing:
            raise ConfigError(f"{f}: the DataProto's batch has no {', '.join(missing)}; it is not a rollout's output")
        if "rollout_log_probs" not in batch:
            raise ConfigError(
                f"{f}: the rollout recorded no log-probs (no rollout_log_probs in the batch)",
                hint="set actor_rollout_ref.rollout.calculate_log_probs=True and dump again",
            )
        trainer = batch.get("old_log_probs")
        self.has_trainer = trainer is not None and self.want_trainer
        if trainer is not None:
            self.notes.append("the batch has old_log_probs (the actor's): they are the trainer side")
        uids = content.non_tensor_batch.get("uid")
        return _Batch(
            prompts=batch["prompts"].numpy(),
            responses=batch["responses"].numpy(),
            attention=batch["attention_mask"].numpy() != 0,
            response_mask=batch["response_mask"].numpy(),
            engine=_floats(batch["rollout_log_probs"]),
            trainer=None if trainer is None or not self.want_trainer else _floats(trainer),
            experts=batch.get("routed_experts"),
            uids=uids,
        )


@dataclass
class _Batch:
    """A rollout's tensors: [B, P] left-padded prompts, [B, R] right-padded responses and their masks
    and log-probs (the module's docstring); ``attention`` as booleans."""

    prompts: np.ndarray
    responses: np.ndarray
    attention: np.ndarray
    response_mask: np.ndarray
    engine: np.ndarray  # as saved (float32), float64 once cut
    trainer: np.ndarray | None  # likewise; None: none in the batch, or not wanted
    experts: Any  # a torch tensor [B, P + R, layers, k], or None
    uids: Any


def _floats(tensor) -> np.ndarray:
    """A tensor of log-probs as NumPy: float32 and float64 as they are (cast once cut, not whole);
    bf16 and fp16, which NumPy has not, as float64."""
    return tensor.numpy() if tensor.dtype.itemsize >= 4 else tensor.double().numpy()


def _samples(name: str, b: _Batch) -> Iterator[DumpSample]:
    n_prompt_width = b.prompts.shape[1]
    for i in range(b.prompts.shape[0]):
        attn = b.attention[i]
        n_p, n_r = int(attn[:n_prompt_width].sum()), int(attn[n_prompt_width:].sum())
        full = np.full(n_p, np.nan)
        yield DumpSample(
            where=f"{name}, sample {i}",
            token_ids=np.concatenate([b.prompts[i][n_prompt_width - n_p :], b.responses[i][:n_r]]),
            model_mask=np.concatenate([np.zeros(n_p, bool), b.response_mask[i][:n_r] != 0]),
            logp_engine=np.concatenate([full, b.engine[i][:n_r]], dtype=np.float64),
            logp_trainer=None if b.trainer is None else np.concatenate([full, b.trainer[i][:n_r]], dtype=np.float64),
            experts=None if b.experts is None else b.experts[i].numpy()[attn],
            prompt_id=None if b.uids is None else str(b.uids[i]),
        )


def _flat(b: _Batch) -> FlatSamples | None:
    """Every sample's tokens as :func:`_samples` cuts them (the prompt's last n_p, the response's
    first n_r, n_p and n_r from the attention mask) and its log-probs at its model tokens (one per
    model token), gathered from the padded tensors at once, without a padded copy of any."""
    if b.trainer is None:
        return None
    n_rows, width = b.prompts.shape
    n_p, n_r = b.attention[:, :width].sum(axis=1), b.attention[:, width:].sum(axis=1)
    keep_p = np.arange(width) >= (width - n_p)[:, None]
    keep_r = np.arange(b.responses.shape[1]) < n_r[:, None]
    sampled = b.response_mask != 0
    model = keep_r & sampled
    in_prompt = np.repeat(np.tile([True, False], n_rows), np.stack([n_p, n_r], axis=1).ravel())
    ids = np.empty(len(in_prompt), np.result_type(b.prompts, b.responses))
    ids[in_prompt], ids[~in_prompt] = b.prompts[keep_p], b.responses[keep_r]
    mask = np.zeros(len(in_prompt), bool)
    mask[~in_prompt] = sampled[keep_r]
    offsets = np.concatenate([[0], np.cumsum(n_p + n_r)]).astype(np.int64)
    logp_offsets = np.concatenate([[0], np.cumsum(model.sum(axis=1))]).astype(np.int64)
    return FlatSamples(
        offsets=offsets,
        token_ids=ids,
        model_mask=mask,
        logp_engine=b.engine[model],
        engine_offsets=logp_offsets,
        logp_trainer=b.trainer[model],
        trainer_offsets=logp_offsets,
    )


def _refuse_text(path: Path) -> None:
    """verl's rollout_data_dir files are JSON Lines of decoded text: say what to dump instead."""
    if path.suffix != ".jsonl":
        return
    try:
        with open(path, encoding="utf-8") as fh:
            first = json.loads(fh.readline() or "{}")
    except (OSError, ValueError):
        first = {}
    if isinstance(first, dict) and ("input" in first or "output" in first):
        raise ConfigError(TEXT_ONLY.format(path=path), hint=HOW_TO_DUMP)
    raise ConfigError(f"{path} is not a verl rollout cache ({GEN_BATCH})", hint=HOW_TO_DUMP)

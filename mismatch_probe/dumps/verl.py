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
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.dumps.base import UNNUMBERED, DumpReader, Listing, one_file_per_step, select_step
from mismatch_probe.dumps.samples import DumpSample
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
        prompts, responses = batch["prompts"].numpy(), batch["responses"].numpy()
        attention, response_mask = batch["attention_mask"].numpy(), batch["response_mask"].numpy()
        floats = {k: batch[k].double().numpy() for k in ("rollout_log_probs", "old_log_probs") if k in batch}
        experts = batch.get("routed_experts")
        uids = content.non_tensor_batch.get("uid")
        n_prompt_width = prompts.shape[1]
        for i in range(prompts.shape[0]):
            where = f"{f.name}, sample {i}"
            attn = attention[i] != 0
            n_p, n_r = int(attn[:n_prompt_width].sum()), int(attn[n_prompt_width:].sum())
            ids = np.concatenate([prompts[i][n_prompt_width - n_p :], responses[i][:n_r]])
            mask = np.concatenate([np.zeros(n_p, bool), response_mask[i][:n_r] != 0])
            full = np.full(n_p, np.nan)
            yield DumpSample(
                where=where,
                token_ids=ids,
                model_mask=mask,
                logp_engine=np.concatenate([full, floats["rollout_log_probs"][i][:n_r]]),
                logp_trainer=None
                if trainer is None or not self.want_trainer
                else np.concatenate([full, floats["old_log_probs"][i][:n_r]]),
                experts=None if experts is None else experts[i].numpy()[attn],
                prompt_id=None if uids is None else str(uids[i]),
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

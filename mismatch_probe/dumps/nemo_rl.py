"""NeMo-RL's GRPO training-data log, ``<log_dir>/train_data_step{N}.jsonl`` (v0.6 and later), as
``grpo_train`` / ``async_grpo_train`` write it through ``Logger.log_batched_dict_as_jsonl``:

- one line per sample, every value keeping the batch's leading dimension of 1
  (``"token_ids": [[...]]``, ``"input_lengths": [L]``), right-padded to the batch's longest;
- ``token_ids``, ``token_loss_mask`` (1 on generated assistant tokens), ``generation_logprobs``
  (vLLM's, 0.0 elsewhere) and ``prev_logprobs`` (the trainer's ``get_logprobs``) all aligned so
  index t holds log p(token t | tokens < t), index 0 being 0.0;
- ``input_lengths`` the unpadded length (prompt, every turn and the environment's messages); a
  row whose mask marks a token at or past it as generated is refused (its length was not the row's).

Both sides' log-probs are of ``logits / temperature`` with the run's top-k / top-p (the base configs
set vLLM's ``logprobs_mode: processed_logprobs``). With ``loss_fn.force_on_policy_ratio`` NeMo-RL
skips the trainer's pass and logs ``prev_logprobs`` as all zeros: detected, said, and imported as
the engine side alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.dumps import jsonl
from mismatch_probe.dumps.base import UNNUMBERED, DumpReader, Listing, files_by_step, one_file_per_step, select_step
from mismatch_probe.dumps.samples import DumpSample
from mismatch_probe.errors import ConfigError

PATTERN = "train_data_step*.jsonl"
FORCED_ON_POLICY = (
    "prev_logprobs are all 0.0 on the generated tokens: the run set loss_fn.force_on_policy_ratio, so NeMo-RL "
    "skipped the trainer's log-prob pass; imported the engine's log-probs alone (score it with the reference)"
)
WHAT = f"NeMo-RL training-data logs ({PATTERN})"
ONE_RUN = "give the file (or the experiment's log directory) itself"
# what a row is read for; the rest of it (content, advantages, rewards) is skipped unparsed
ROW = jsonl.keeping(
    ("token_ids", "token_loss_mask", "generation_logprobs", "prev_logprobs", "input_lengths", "sample_loss_mask")
)
SHORT_LENGTH = (
    "input_lengths is each row's unpadded length: the prompt, every generated turn and the environment's "
    "messages (NeMo-RL logs the batch's input_lengths); a length of the prompt alone leaves out what was generated"
)


class NemoRLDump(DumpReader):
    format = "nemo-rl"

    def __init__(self, path: Path, *, step: int | None = None, listing: Listing | None = None, **_: Any) -> None:
        super().__init__(path, listing=listing)
        steps = self.listed_steps(path)
        picked, self.files = select_step(steps, step, path, WHAT)
        numbered = not path.is_file() or bool(files_by_step(path.parent, path.name))
        self.step = picked if numbered else step

    @classmethod
    def available_steps(cls, path: Path) -> dict[int, list[Path]]:
        if path.is_file():
            numbers = files_by_step(path.parent, path.name)
            return {next(iter(numbers), UNNUMBERED): [path]}
        grouped = files_by_step(path, PATTERN) or files_by_step(path, f"*/{PATTERN}")
        return {s: [f] for s, f in sorted(one_file_per_step(grouped, path, hint=ONE_RUN).items())}

    def read_samples(self) -> Iterator[DumpSample]:
        f = self.files[0]
        trainer: bool | None = None
        masked = 0
        for k, line in jsonl.lines(f):
            where = f"{f.name}:{k}"
            row = _row(line, where)
            sample, zeros = _sample(row, where)
            if trainer is None and sample.model_mask.any() and self.want_trainer:
                trainer = not zeros
                self.has_trainer = trainer
                if zeros:
                    self.notes.append(FORCED_ON_POLICY)
            if not trainer:
                sample.logp_trainer = None
            masked += _first(row.get("sample_loss_mask"), 1.0) == 0
            yield sample
        if masked:
            self.notes.append(f"{masked} samples have sample_loss_mask 0 (NeMo-RL left them out of the loss)")


def _row(line: bytes, where: str) -> dict:
    row = jsonl.loads(line, where, ROW)  # NaN and -Infinity, as json.dumps writes them, parse
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: not a JSON object")
    if "token_ids" not in row or "token_loss_mask" not in row:
        raise ConfigError(
            f"{where}: no token_ids / token_loss_mask; NeMo-RL logs them since v0.6 (earlier logs hold text only)",
            hint="re-run the step with NeMo-RL >= 0.6, or write the generic format (docs/dump-format.md)",
        )
    return row


def _first(value: Any, default: Any = None) -> Any:
    """A value of the logged batch of one: ``[x]`` -> ``x``."""
    if value is None:
        return default
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _sample(row: dict, where: str) -> tuple[DumpSample, bool]:
    """The sample, and whether its trainer log-probs are all 0.0 on the generated tokens."""
    ids = jsonl.ints(_first(row["token_ids"]))
    length = _first(row.get("input_lengths"), len(ids))
    if not isinstance(length, int) or not 0 < length <= len(ids):
        raise ConfigError(f"{where}: input_lengths {length!r} does not fit its {len(ids)} token ids")

    def per_token(key: str, *, mask: bool = False, upto: int | None = None) -> np.ndarray:
        raw = _first(row[key])
        if upto is not None and isinstance(raw, list) and len(raw) == len(ids):
            values = jsonl.floats(raw[:upto])  # the right padding is never read
            if len(values) == upto:
                return values
        values = jsonl.flags(raw) if mask else jsonl.floats(raw)
        if len(values) != len(ids):
            raise ConfigError(f"{where}: {key} has {len(values)} entries for {len(ids)} token ids")
        return values if upto is None else values[:upto]

    whole_mask = per_token("token_loss_mask", mask=True)
    beyond = np.flatnonzero(whole_mask[length:])
    if beyond.size:
        raise ConfigError(
            f"{where}: token_loss_mask marks position {length + int(beyond[0])} as generated, "
            f"past the row's input_lengths {length}",
            hint=SHORT_LENGTH,
        )
    mask = whole_mask[:length]  # right padding stripped
    engine = per_token("generation_logprobs", upto=length)
    trainer = per_token("prev_logprobs", upto=length) if row.get("prev_logprobs") is not None else None
    zeros = trainer is None or bool(np.all(trainer[mask] == 0.0))
    return (
        DumpSample(
            where=where,
            token_ids=ids[:length],
            model_mask=mask,
            logp_engine=engine,
            logp_trainer=trainer,
            prompt_id=None,
        ),
        zeros,
    )

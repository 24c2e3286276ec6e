"""slime's debug dumps (``--dump-details DIR``, or ``--save-debug-rollout-data`` and
``--save-debug-train-data``), as slime's own source writes them:

- ``rollout_data/{rollout_id}.pt``: ``torch.save({"rollout_id", "samples": [Sample.to_dict()]})``
  (slime/observability/rollout_data_utils.py). Per sample: ``tokens`` (prompt + response),
  ``response_length``, ``loss_mask`` (one per response token, 0 on tool output; None: all ones),
  ``rollout_log_probs`` (one per response token, 0.0 on tool output; SGLang's log-probs of the
  temperature-scaled distribution), ``rollout_routed_experts`` (R3: int32
  ``[len(tokens) - 1, layers, top-k]``, row i the routing of input position i), ``index``,
  ``group_index``, ``status``.
- ``train_data/{rollout_id}.pt``, ``format_version`` 2 (slime/observability/train_data_utils.py):
  ``samples`` with ``rollout_position`` (the sample's index in the rollout dump), ``sample_index``,
  ``tokens`` and ``log_probs`` (Megatron's forward, ``logits / rollout_temperature``, one per
  response token). It may hold a subset: slime drops trailing samples that do not fit its
  data-parallel schedule.

Both load with ``torch.load(weights_only=True)``; dumps from before slime stored routed experts as
tensors hold NumPy arrays, for which the loader allows NumPy's array reconstruction and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mismatch_probe.dumps.base import UNNUMBERED, DumpReader, Listing, files_by_step, one_file_per_step, select_step
from mismatch_probe.dumps.samples import DumpSample
from mismatch_probe.errors import ConfigError

ROLLOUT_DIR, TRAIN_DIR = "rollout_data", "train_data"


WHAT = "slime rollout dumps (rollout_data/<id>.pt)"


class SlimeDump(DumpReader):
    format = "slime"

    def __init__(
        self,
        path: Path,
        *,
        step: int | None = None,
        listing: Listing | None = None,
        trainer_path: Path | None = None,
        **_: Any,
    ) -> None:
        super().__init__(path, listing=listing)
        picked, files = select_step(self.listed_steps(path), step, path, WHAT)
        rollout_file = files[0]
        self.step = _step_of(rollout_file) if path.is_file() else picked
        if trainer_path is not None:  # --train-dump: the trainer's file is elsewhere
            files = [rollout_file, _given_train_file(trainer_path)]
        self.files = files
        self.train_file = files[1] if len(files) > 1 else None
        self.has_trainer = self.train_file is not None
        if rollout_file.parent.name == ROLLOUT_DIR and (rollout_file.parent.parent / "tokenizer").is_dir():
            self.tokenizer_dir = rollout_file.parent.parent / "tokenizer"  # --dump-details saves it

    @classmethod
    def available_steps(cls, path: Path) -> dict[int, list[Path]]:
        """Each rollout ``rollout_data/<id>.pt``, with ``train_data/<id>.pt`` when slime wrote one."""
        if path.is_file():
            step = _step_of(path)
            return {UNNUMBERED if step is None else step: [path, *_train_file(path, step)]}
        directory = path / ROLLOUT_DIR if (path / ROLLOUT_DIR).is_dir() else path
        grouped = files_by_step(directory, "[0-9]*.pt")  # not eval_<id>.pt: evaluation rollouts
        rollouts = one_file_per_step(grouped, path, hint="give the .pt file itself")
        return {s: [f, *_train_file(f, s)] for s, f in sorted(rollouts.items())}

    def read_samples(self) -> Iterator[DumpSample]:
        dump = _load(self.files[0])
        samples = dump.get("samples") if isinstance(dump, dict) else None
        if not isinstance(samples, list):
            raise ConfigError(
                f"{self.files[0]} is not a slime rollout dump (a dict with 'samples')",
                hint="give the file --save-debug-rollout-data / --dump-details wrote (rollout_data/<id>.pt)",
            )
        trainer = None
        if self.train_file is not None and self.want_trainer:
            trainer = _train_log_probs(self.train_file, len(samples))
        if trainer is not None and len(trainer) < len(samples):
            self.notes.append(
                f"the train dump holds {len(trainer)} of the rollout's {len(samples)} samples (slime drops the "
                "samples that do not fit its data-parallel schedule); only those are imported"
            )
        removed = 0
        for position, s in enumerate(samples):
            where = f"{self.files[0].name}, sample {position}"
            if not isinstance(s, dict):
                raise ConfigError(f"{where}: not a Sample.to_dict() entry")
            if trainer is not None and position not in trainer:
                continue
            removed += bool(s.get("remove_sample"))
            yield _sample(s, where, trainer.pop(position) if trainer is not None else None)
        if removed:
            self.notes.append(f"{removed} samples have remove_sample set (slime trains on them with a zero loss mask)")


def _step_of(path: Path) -> int | None:
    try:
        return int(path.stem)
    except ValueError:
        return None


def _train_file(rollout_file: Path, step: int | None) -> list[Path]:
    """The train dump of the same rollout, ``train_data/<id>.pt`` beside ``rollout_data/``, if any."""
    if step is None or rollout_file.parent.name != ROLLOUT_DIR:
        return []
    candidate = rollout_file.parent.parent / TRAIN_DIR / f"{step}.pt"
    return [candidate] if candidate.is_file() else []


def _given_train_file(given: Path) -> Path:
    if not given.is_file():
        raise ConfigError(f"--train-dump {str(given)!r} is not a file")
    return given


def _load(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers; NumPy arrays (older routed
    experts) through NumPy's own reconstruction, allowed by name. Nothing else is ever unpickled."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        if "numpy" not in str(exc):
            raise _refused(path, exc) from None
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise _refused(path, exc) from None


def _numpy_globals() -> list:
    from numpy import dtypes

    # numpy._core is NumPy 2's name, and a stub over numpy.core in NumPy 1.26 (an import, not an
    # attribute, there); a pickle names the module of the NumPy that wrote it, so both names are allowed.
    from numpy._core.multiarray import _reconstruct as reconstruct

    allowed: list = [
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
    ]
    allowed += [getattr(dtypes, name) for name in ("Int32DType", "Int64DType", "Int16DType", "Float32DType")]
    return allowed


def _refused(path: Path, exc: Exception) -> ConfigError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(
        f"{path} cannot be read as tensors and plain data ({first})",
        hint="mismatch-probe loads .pt dumps with torch.load(weights_only=True) and runs no code from them; "
        "objects in a sample's metadata or reward must be plain Python data",
    )


def _train_log_probs(path: Path, n_rollout: int) -> dict[int, tuple[np.ndarray, int]]:
    """{rollout position: (the trainer's log-probs, one per response token; its token count)}."""
    dump = _load(path)
    if not isinstance(dump, dict) or "samples" not in dump:
        raise ConfigError(f"{path} is not a slime train dump (a dict with 'samples')")
    version = dump.get("format_version")
    if version != 2:
        raise ConfigError(
            f"{path} is a slime train dump of format_version {version!r}; mismatch-probe reads version 2 "
            "(slime since 2026-08, one file per rollout)",
            hint="import the rollout dump alone (--no-trainer), or dump again with a current slime",
        )
    out: dict[int, tuple[np.ndarray, int]] = {}
    for k, s in enumerate(dump["samples"]):
        where = f"{path.name}, train sample {k}"
        position = s.get("rollout_position")
        if not isinstance(position, int) or not 0 <= position < n_rollout:
            raise ConfigError(f"{where}: rollout_position {position!r} is not a sample of the rollout dump")
        if s.get("log_probs") is None:
            raise ConfigError(f"{where}: no log_probs (the trainer's)")
        out[position] = (_numpy(s["log_probs"], np.float64), len(s["tokens"]) if s.get("tokens") is not None else -1)
    return out


def _numpy(value: Any, dtype) -> np.ndarray:
    if hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=dtype)


def _sample(s: dict, where: str, trainer: tuple[np.ndarray, int] | None) -> DumpSample:
    tokens = _numpy(s.get("tokens"), np.int64)
    n = len(tokens)
    r = s.get("response_length")
    if not isinstance(r, int) or not 0 < r < n:
        raise ConfigError(f"{where}: response_length {r!r} does not fit its {n} tokens")
    prompt = n - r
    mask = np.zeros(n, dtype=bool)
    loss_mask = s.get("loss_mask")
    if loss_mask is not None and len(loss_mask) != r:
        raise ConfigError(f"{where}: loss_mask has {len(loss_mask)} entries for response_length {r}")
    mask[prompt:] = True if loss_mask is None else _numpy(loss_mask, np.int64).reshape(-1) != 0
    logp = s.get("rollout_log_probs")
    if logp is None:
        raise ConfigError(
            f"{where}: no rollout_log_probs (the engine's log-probs)",
            hint="slime records them for rollouts sampled through SGLang since 2025-08; this dump has none",
        )
    engine = _response_values(logp, r, prompt, where, "rollout_log_probs")
    logp_trainer = None
    if trainer is not None:
        values, n_train_tokens = trainer
        if n_train_tokens not in (-1, n):
            raise ConfigError(f"{where}: the train dump has {n_train_tokens} tokens for it, the rollout dump {n}")
        logp_trainer = _response_values(values, r, prompt, where, "the train dump's log_probs")
    experts = s.get("rollout_routed_experts")
    return DumpSample(
        where=where,
        token_ids=tokens,
        model_mask=mask,
        logp_engine=engine,
        logp_trainer=logp_trainer,
        experts=None if experts is None else _numpy(experts, np.int64),
        prompt_id=str(s["group_index"]) if s.get("group_index") is not None else None,
        finish_reason=str(s.get("status") or "unknown"),
    )


def _response_values(values: Any, r: int, prompt: int, where: str, what: str) -> np.ndarray:
    """One value per response token, placed after the prompt in a full-length array."""
    v = _numpy(values, np.float64).reshape(-1)
    if len(v) != r:
        raise ConfigError(f"{where}: {len(v)} {what} for response_length {r}")
    return np.concatenate([np.full(prompt, np.nan), v])

"""Training frameworks' own rollout dumps, read as the rollouts ``sample`` would have produced.

Formats are registered here by name and imported only when an import asks for one (verl's
needs torch; the generic one only pyarrow). Each entry says what the framework's log-probs are, so
the run's record states which distribution each side describes; ``mismatch-probe import`` flags
override any of it. See ARCHITECTURE.md, "Imported runs", and docs/dump-format.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from mismatch_probe.config.keys import did_you_mean
from mismatch_probe.dumps.base import DumpReader
from mismatch_probe.errors import ConfigError


@dataclass(frozen=True)
class DumpFormat:
    name: str
    target: str  # "module:ReaderClass"
    description: str
    what_path: str  # what PATH is, for errors and --help
    engine: str  # the engine such runs sample with, recorded unless --engine says otherwise
    # the engine's log-probs: "raw" log_softmax(logits), or "processed" log_softmax(logits / T ...)
    engine_logprobs: str
    # the trainer's, as a reference.logprobs choice: "temperature" is log_softmax(logits / T)
    trainer_logprobs: str


FORMATS: dict[str, DumpFormat] = {
    f.name: f
    for f in (
        DumpFormat(
            "slime",
            "mismatch_probe.dumps.slime:SlimeDump",
            "slime --save-debug-rollout-data (+ --save-debug-train-data) .pt files",
            "a rollout-data .pt file or its directory",
            engine="sglang",
            engine_logprobs="processed",
            trainer_logprobs="temperature",
        ),
        DumpFormat(
            "nemo-rl",
            "mismatch_probe.dumps.nemo_rl:NemoRLDump",
            "NeMo-RL GRPO train_data_step{N}.jsonl",
            "a train_data_step{N}.jsonl file or the log directory holding them",
            engine="vllm",
            engine_logprobs="processed",
            trainer_logprobs="processed",  # its policy applies the run's top-k / top-p too
        ),
        DumpFormat(
            "verl",
            "mismatch_probe.dumps.verl:VerlDump",
            "verl rollout cache (a pickled DataProto; needs --trust-pickle)",
            "a rollout-cache file (gen_batch.dp) or the directory holding it",
            engine="vllm",
            engine_logprobs="processed",
            trainer_logprobs="temperature",
        ),
        DumpFormat(
            "generic",
            "mismatch_probe.dumps.generic:GenericDump",
            "one row per sample in Parquet or JSON Lines (docs/dump-format.md)",
            "a .parquet / .jsonl file or a directory of them",
            engine="unknown",
            engine_logprobs="raw",
            trainer_logprobs="raw",
        ),
    )
}


def get_format(name: str) -> DumpFormat:
    key = name.strip().lower().replace("_", "-")
    if key in ("nemo", "nemorl"):
        key = "nemo-rl"
    if key not in FORMATS:
        raise ConfigError(
            f"unknown dump format {name!r}",
            hint=did_you_mean(key, FORMATS, otherwise=f"choose one of {', '.join(FORMATS)}"),
        )
    return FORMATS[key]


def open_dump(
    fmt: DumpFormat,
    path: str | Path,
    *,
    step: int | None = None,
    trust_pickle: bool = False,
    trainer_path: str | Path | None = None,
) -> DumpReader:
    """The reader of ``path`` in format ``fmt``; it checks the files are what the framework writes.
    ``trainer_path``: the trainer's dump, where the framework writes it apart (slime's train data)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"dump {str(p)!r} does not exist", hint=f"give {fmt.what_path}")
    module_name, _, cls = fmt.target.partition(":")
    reader = getattr(importlib.import_module(module_name), cls)
    if trainer_path is not None and fmt.name != "slime":
        raise ConfigError(
            f"--train-dump is for slime's train dumps; a {fmt.name} dump holds its trainer's log-probs itself"
        )
    return reader(
        p, step=step, trust_pickle=trust_pickle, trainer_path=None if trainer_path is None else Path(trainer_path)
    )

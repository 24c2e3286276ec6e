"""Training frameworks' own rollout dumps, read as the rollouts ``sample`` would have produced.

Formats are registered here by name and imported only when an import asks for one (verl's
needs torch; the generic one only pyarrow). Each entry says what the framework's log-probs are, so
the run's record states which distribution each side describes; ``mismatch-probe import`` flags
override any of it. :func:`list_steps` lists the steps a path holds (each with the files its import
reads) without reading them; :func:`open_dump` opens one. See ARCHITECTURE.md, "Imported runs", and
docs/dump-format.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe.config.keys import did_you_mean
from mismatch_probe.errors import ConfigError

if TYPE_CHECKING:  # the readers need NumPy and Arrow; the registry (the CLI's --help) does not
    from mismatch_probe.dumps.base import DumpReader


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


# The settings an imported run records as sampled with (run.json's imported_from.settings_from, in
# this order): `import`'s flag (the spec's own), else the dump's value (DumpReader.settings), else the
# format's engine and engine_logprobs, else the setting's default.
SAMPLED_SETTINGS = ("sampling.temperature", "sampling.top_p", "sampling.top_k", "engine.name", "engine.logprobs_mode")

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
        DumpFormat(
            "prime-rl",
            "mismatch_probe.dumps.prime_rl:PrimeRLDump",
            "prime-rl's token exports (token_exports/step_N/) and filesystem rollouts (rollouts/step_N/)",
            "the run's output_dir, or one of its step_N directories",
            engine="vllm",
            engine_logprobs="processed",  # prime-rl starts vLLM with logprobs_mode processed_logprobs
            trainer_logprobs="temperature",  # its trainer divides the logits by each token's temperature
        ),
    )
}


def get_format(name: str) -> DumpFormat:
    key = name.strip().lower().replace("_", "-")
    if key in ("nemo", "nemorl"):
        key = "nemo-rl"
    if key == "primerl":
        key = "prime-rl"
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
    listing: dict[int, list[Path]] | None = None,
) -> DumpReader:
    """The reader of ``path`` in format ``fmt``; it checks the files are what the framework writes.
    ``trainer_path``: the trainer's dump, where the framework writes it apart (slime's train data);
    ``listing``: :func:`list_steps` of ``path`` when the caller has it (a step among many)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"dump {str(p)!r} does not exist", hint=f"give {fmt.what_path}")
    reader: Any = reader_class(fmt)  # each reader takes the keywords its format has
    if trainer_path is not None and fmt.name != "slime":
        raise ConfigError(
            f"--train-dump is for slime's train dumps; a {fmt.name} dump holds its trainer's log-probs itself"
        )
    return reader(
        p,
        step=step,
        trust_pickle=trust_pickle,
        trainer_path=None if trainer_path is None else Path(trainer_path),
        listing=listing,
    )


def reader_class(fmt: DumpFormat) -> type[DumpReader]:
    module_name, _, cls = fmt.target.partition(":")
    return getattr(importlib.import_module(module_name), cls)


def list_steps(fmt: DumpFormat, path: str | Path) -> dict[int, list[Path]]:
    """Every training step ``path`` holds, in order, each with the files its import reads (what a
    live run's watcher checks has finished writing), found without reading any of them;
    ``open_dump(fmt, path, step=N)`` opens exactly the files listed for N. A dump whose names carry
    no step number is one step, 0."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"dump {str(p)!r} does not exist", hint=f"give {fmt.what_path}")
    steps = reader_class(fmt).available_steps(p)
    if not steps:
        raise ConfigError(f"{p} holds no step of a {fmt.name} dump ({fmt.description})", hint=f"give {fmt.what_path}")
    return dict(sorted(steps.items()))

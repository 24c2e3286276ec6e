"""`mismatch-probe init` as a library function: a framework's config read into a probe spec beside
a prompts file sampled from its dataset, with the configuration's known risks."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch_probe.config.stack_spec import StackRisk
from mismatch_probe.errors import ConfigError, ProbeError
from mismatch_probe.frameworks import framework
from mismatch_probe.frameworks.base import StackReading, read_stack
from mismatch_probe.frameworks.risks import find_risks
from mismatch_probe.frameworks.spec_file import render_spec, stack_table, write_spec

DEFAULT_PROMPTS = 64


@dataclass
class InitResult:
    spec_path: Path
    stack: StackReading
    risks: list[StackRisk]
    prompts_path: Path | None = None
    prompts: Any = None  # the dataset sample's summary (frameworks/datasets.py)
    notes: list[str] = field(default_factory=list)  # what the user must still do, one line each


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))


def _relative(path: Path, spec_dir: Path) -> str:
    """A path as the spec file holds it: relative to the spec's directory."""
    return os.path.relpath(path.resolve(), spec_dir.resolve())


def _dataset_paths(stack: StackReading, dataset: str | None) -> tuple[list[Path], str]:
    if dataset is not None:
        return [_expand(dataset)], "--dataset"
    if stack.dataset is None:
        return [], ""
    value = stack.dataset.value
    items = value if isinstance(value, list) else [value]
    return [_expand(str(v)) for v in items], str(stack.dataset.origin)


# what a reader's facts may change of its framework's dataset layout (frameworks/datasets.py:
# DatasetLayout): the config's own prompt key, the chat template turned on, a system prompt, a template
_LAYOUT_FACTS = ("shape", "system_key", "system_prompt", "input_template")


def dataset_layout(stack: StackReading, base: Any, prompt_key: str | None) -> Any:
    """The framework's dataset layout with what the config (and ``--prompt-key``) changes of it."""
    changes: dict[str, Any] = {name: stack.fact(f"dataset_{name}") for name in _LAYOUT_FACTS}
    changes = {k: v for k, v in changes.items() if v is not None}
    key = prompt_key or (str(stack.prompt_key.value) if stack.prompt_key is not None else None)
    if key:
        changes["prompt_key"] = key
    return base.with_changes(**changes)


def init_spec(
    framework_name: str,
    inputs: list[str],
    *,
    out: Path,
    dataset: str | None = None,
    prompt_key: str | None = None,
    num_prompts: int = DEFAULT_PROMPTS,
    seed: int = 0,
    model: str | None = None,
    settings: dict[str, Any] | None = None,
    command: str = "mismatch-probe init",
) -> InitResult:
    """Read ``inputs`` as framework ``framework_name`` does and write the spec to ``out`` (and its
    prompts beside it). ``model`` and ``settings`` (``{"engine.tensor_parallel_size": 1}``) are this
    machine's: they replace what the config says, which the spec's comments keep."""
    from mismatch_probe.config.spec import ProbeSpec, spec_settings
    from mismatch_probe.config.spec_reading import apply_overrides, load_spec_file

    if not inputs:
        raise ConfigError("no config given", hint=f"mismatch-probe init {framework_name} CONFIG [KEY=VALUE ...]")
    stack = read_stack(framework(framework_name), inputs)
    spec_dir = out.parent
    known = spec_settings()
    for key in settings or {}:
        if key not in known or not known[key].section:
            raise ConfigError(
                f"--set {key}: not a setting of the spec's tables", hint="e.g. --set engine.dtype=bfloat16"
            )
    apply_overrides(ProbeSpec(), dict(settings or {}), named_by="set")  # a bad value: refused here, by its --set
    overridden = {key: (value, "set for this machine (init --set)") for key, value in (settings or {}).items()}

    result = InitResult(out, stack, [])
    result.risks = find_risks(stack, model_dir=_expand(model) if model else None)
    top: dict[str, tuple[Any, str]] = {"name": (f"{stack.framework}-{Path(inputs[0]).stem}", "")}
    if model is not None:
        was = f"; {stack.framework}: {stack.model.value} from {stack.model.origin}" if stack.model else ""
        top["model"] = (_relative(_expand(model), spec_dir), f"set for this machine (init --model){was}")
    elif stack.model is not None:
        top["model"] = (str(stack.model.value), f"{stack.model.origin}; a local checkpoint directory (or pass --model)")
        result.notes.append(
            f"model = {stack.model.value!r} ({stack.model.origin}): the probe loads a local checkpoint; "
            "download it and give its directory (compare --model DIR)"
        )
    else:
        result.notes.append("the config names no model: pass compare --model DIR")

    paths, where = _dataset_paths(stack, dataset)
    present = [p for p in paths if p.exists()]
    if present:
        from mismatch_probe.frameworks.datasets import LAYOUTS, write_dataset_prompts

        prompts_path = spec_dir / f"{out.stem}-prompts.jsonl"
        result.prompts = write_dataset_prompts(
            present,
            prompts_path,
            layout=dataset_layout(stack, LAYOUTS[framework_name], prompt_key),
            n=num_prompts,
            seed=seed,
            tokenizer=_expand(model) if model else None,
        )
        result.prompts_path = prompts_path
        top["prompts"] = (
            _relative(prompts_path, spec_dir),
            (
                f"{result.prompts.written} prompts sampled from {', '.join(str(p) for p in present)} "
                f"({where}), stratified by {result.prompts.length_unit}, seed {seed}"
            ),
        )
        missing = [p for p in paths if not p.exists()]
        if missing:
            result.notes.append(f"not found here, not sampled: {', '.join(map(str, missing))}")
    elif paths:
        result.notes.append(
            f"the dataset {', '.join(map(str, paths))} ({where}) is not on this machine: "
            "pass --dataset FILE (parquet or JSON Lines) to sample prompts from it"
        )
    else:
        result.notes.append("the config names no dataset: pass --dataset FILE, or compare --prompts FILE")

    table = stack_table(stack, inputs, result.risks)
    text = render_spec(stack, table, command=command, top=top, overridden=overridden)
    # what init writes, compare reads: the spec is loaded beside its place (its relative paths hold)
    # before it replaces anything, and one compare would refuse is never left behind
    trial = out.with_name(f".{out.name}.init.toml")
    write_spec(trial, text)
    try:
        load_spec_file(trial)
    except ProbeError as exc:
        raise ProbeError(
            f"init read a config into a spec that does not load ({exc}); this is a bug in the {stack.framework} reader"
        ) from None
    finally:
        trial_text = trial.read_text() if trial.exists() else text
        trial.unlink(missing_ok=True)
    write_spec(out, trial_text)
    return result

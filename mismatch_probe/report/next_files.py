"""The files "What to do next" writes beside a run's report (analysis/next_steps.py decides them):
``next-sweep.toml``, a sweep spec that runs as written (``mismatch-probe sweep RUN/next-sweep.toml``),
and ``suggested-gate.toml``, a thresholds file from the run's own intervals."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mismatch_probe.analysis.next_steps import NEXT_SWEEP, SUGGESTED_GATE, Axis, suggested_checks, sweep_axes
from mismatch_probe.files import write_atomic
from mismatch_probe.frameworks.spec_file import toml_value
from mismatch_probe.record import RunRecord
from mismatch_probe.report import labels

# spec keys the sweep does not take from the run: where it writes (its own), the run's own variants,
# the framework table (a record of where the spec came from) and a weight-sync probe's table
NOT_COPIED = ("model", "prompts", "out", "variants", "stack", "sync")


def run_root(record: RunRecord, run_dir: Path) -> Path:
    """The working directory the run's relative paths (``inputs``) were recorded from: the run
    directory minus the ``out`` the spec gave, when it ends with it; else the working directory."""
    here = Path(os.path.abspath(run_dir))
    out = Path(str(record.spec.out or ""))
    if out.parts and not out.is_absolute() and here.parts[-len(out.parts) :] == out.parts:
        return Path(*here.parts[: -len(out.parts)]) if len(here.parts) > len(out.parts) else Path("/")
    return Path(os.getcwd())


def _from_run_dir(record: RunRecord, run_dir: Path, recorded: str | None) -> str | None:
    """A path the record names (relative to where the run was made, or absolute) as the sweep spec
    beside the run must give it: relative to that file."""
    if not recorded:
        return None
    absolute = Path(recorded) if Path(recorded).is_absolute() else run_root(record, run_dir) / recorded
    return Path(os.path.relpath(absolute, os.path.abspath(run_dir))).as_posix()


def _section(name: str, values: dict[str, Any]) -> list[str]:
    lines = [f"[{name}]"]
    for key, value in values.items():
        if value is None or (isinstance(value, dict) and not value):
            continue  # TOML has no null: an unset setting stays at its default
        lines.append(f"{key} = {toml_value(value)}")
    return lines + [""]


def next_sweep_text(record: RunRecord, run_dir: Path, axes: list[Axis]) -> str:
    """``next-sweep.toml``: the run's spec as recorded (every setting it ran with), its paths made
    relative to the file, and a one-at-a-time ``[sweep]`` over ``axes`` with the baseline run with
    three seeds (the noise floor the sweep attributes against)."""
    spec = record.spec.to_dict()
    name = labels.run_label(record, run_dir)
    inputs = record.inputs
    lines = [
        f"# What to sweep next for {name}: written by mismatch-probe from this run's findings (report.md,",
        '# "What to do next"). Each axis changes one setting from what this run ran with.',
        f"#   mismatch-probe sweep {labels.given_run_dir(record, run_dir) / NEXT_SWEEP}",
        "# Paths are relative to this file.",
        "",
        f"name = {toml_value(f'{name}-next')}",
        f"model = {toml_value(_from_run_dir(record, run_dir, inputs.model if inputs else None) or spec.get('model'))}",
        f"prompts = {toml_value(_from_run_dir(record, run_dir, inputs.prompts if inputs else None) or spec.get('prompts'))}",
        f"out = {toml_value(f'../{Path(os.path.abspath(run_dir)).name}-next-sweep')}",
    ]
    sections = {k: v for k, v in spec.items() if isinstance(v, dict) and k not in NOT_COPIED}
    lines += [
        f"{k} = {toml_value(v)}"
        for k, v in spec.items()
        if k not in NOT_COPIED and k not in sections and k != "name" and v is not None
    ]
    lines.append("")
    for section, values in sections.items():
        values = dict(values)
        if section == "engine":
            values["python"] = None  # where the run's engine ran: this machine's engine is the one found
            if inputs is not None and inputs.engine_checkpoint:
                values["checkpoint"] = _from_run_dir(record, run_dir, inputs.engine_checkpoint)
        lines += _section(section, values)
    lines += [
        "[sweep]",
        'mode = "one-at-a-time"',
        "repeats = 3                    # the baseline with seeds 0, 1, 2: the noise floor",
        "",
    ]
    for axis in axes:
        lines += [
            "[[sweep.axes]]",
            f"# {axis.why}",
            f"key = {toml_value(axis.key)}",
            f"values = {toml_value(axis.values)}",
            "",
        ]
    return "\n".join(lines).rstrip("\n") + "\n"


def suggested_gate_text(record: RunRecord, run_dir: Path) -> str | None:
    """``suggested-gate.toml``: :func:`~mismatch_probe.analysis.next_steps.suggested_checks` as a
    thresholds file; None for a run without intervals."""
    name = labels.run_label(record, run_dir)
    checks = suggested_checks(record, name)
    if not checks:
        return None
    lines = [
        f"# A gate for later runs of {name}'s configuration (a new engine version, GPU type or kernel flag),",
        '# from this run\'s own sampling noise: written by mismatch-probe (report.md, "What to do next").',
        f"#   mismatch-probe gate NEW_RUN --thresholds {labels.given_run_dir(record, run_dir) / SUGGESTED_GATE}",
        "",
    ]
    for check in checks:
        lines += ["[[checks]]"] + [f"{k} = {toml_value(v)}" for k, v in check.items()] + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_next_files(run_dir: Path, record: RunRecord) -> list[str]:
    """Write next-sweep.toml and suggested-gate.toml beside the run's report; returns their names."""
    written = []
    axes = sweep_axes(record, labels.rollout_precision(record))
    if axes and record.inputs is not None:
        write_atomic(run_dir / NEXT_SWEEP, next_sweep_text(record, run_dir, axes))
        written.append(NEXT_SWEEP)
    gate = suggested_gate_text(record, run_dir)
    if gate is not None:
        write_atomic(run_dir / SUGGESTED_GATE, gate)
        written.append(SUGGESTED_GATE)
    return written

"""A :class:`~mismatch_probe.frameworks.base.StackReading` written as a probe spec (TOML): every
value with a comment naming where it came from, the settings the probe cannot mirror, and the
``[stack]`` table (framework, files, risks) that the run's record and report carry."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mismatch_probe.config.stack_spec import StackRisk, StackSpec, StackUnmirrored
from mismatch_probe.frameworks.base import StackReading, Value

# the spec's tables in the order a reader looks for them ([engine.extra_args] is written inside [engine])
_TABLES = ("engine", "sampling", "reference", "corrections", "sync")


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal: strings as basic strings (JSON's escapes are TOML's), lists as
    arrays, mappings as inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return ("-" if value < 0 else "") + ("nan" if math.isnan(value) else "inf")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _comment(text: str) -> str:
    return " ".join(text.split())


def stack_table(stack: StackReading, inputs: list[str], risks: list[StackRisk]) -> StackSpec:
    return StackSpec(
        framework=stack.framework,
        config=list(inputs),
        commit=stack.commit,
        engine_pin=stack.engine_pin,
        risks=risks,
        unmirrored=[StackUnmirrored(key=u.key, value=_as_text(u.value), why=u.why) for u in stack.unmirrored],
    )


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def render_spec(
    stack: StackReading,
    table: StackSpec,
    *,
    command: str,
    top: dict[str, tuple[Any, str]],
    overridden: dict[str, tuple[Any, str]],
) -> str:
    """The spec file's text. ``top``: the top-level keys (model, prompts, name) with their comments;
    ``overridden``: settings the user replaced on `init`'s own command line (for this machine), each
    written with the framework's value in its comment."""
    lines = [  # inputs may hold newlines ($'...' in a script): a comment is one line
        f"# Written by `{_comment(command)}`.",
        f"# It mirrors the {stack.framework} configuration read from: {_comment(', '.join(table.config)) or '(defaults only)'}.",
        f"# Each value names where it came from: your file and key, or {stack.framework}'s default at",
        f"# commit {stack.commit[:7]} (file:line in {stack.framework}'s repository). Flags given to",
        "# `mismatch-probe compare` override any value here.",
    ]
    if stack.engine_pin:
        lines.append(f"# The engine version {stack.framework} pins: {_comment(stack.engine_pin)}.")
    if table.risks:
        lines.append("# Known mismatch risks of this configuration (also in [stack] below, and in the report):")
        lines += [f"#   - {r.title}: {_comment(r.detail)}" for r in table.risks]
    lines.append("")
    for key, (value, comment) in top.items():
        lines.append(_line(key, value, comment))

    by_table: dict[str, list[Value]] = {t: [] for t in _TABLES}
    for v in stack.values.values():
        section, _, name = v.key.partition(".")
        by_table.setdefault(section, []).append(v)
    for key, (value, comment) in overridden.items():
        section = key.partition(".")[0]
        if not any(v.key == key for v in by_table.get(section, [])):
            by_table.setdefault(section, []).append(Value(key, value, ()))
    for section in [*_TABLES, *(t for t in by_table if t not in _TABLES)]:
        values = by_table.get(section) or []
        if not values:
            continue
        lines += ["", f"[{section}]"]
        for v in values:
            name = v.key.partition(".")[2]
            if v.key in overridden:
                value, why = overridden[v.key]
                was = f"{stack.framework}: {toml_value(v.value)} from {v.source}" if v.origins else ""
                lines.append(_line(name, value, f"{why}" + (f"; {was}" if was else "")))
            else:
                lines.append(_line(name, v.value, v.source))
    if table.unmirrored:
        lines += ["", "# Not mirrored (the probe has no setting for these; the report lists them too):"]
        lines += [f"#   {u.key} = {_comment(u.value)}: {_comment(u.why)}" for u in table.unmirrored]
    lines += ["", "[stack]", *_stack_lines(table)]
    return "\n".join(lines) + "\n"


def _line(key: str, value: Any, comment: str) -> str:
    text = f"{_key(key)} = {toml_value(value)}"
    return f"{text}  # {_comment(comment)}" if comment else text


def _stack_lines(table: StackSpec) -> list[str]:
    lines = [
        f"framework = {toml_value(table.framework)}",
        f"config = {toml_value(table.config)}",
        f"commit = {toml_value(table.commit)}",
    ]
    if table.engine_pin:
        lines.append(f"engine_pin = {toml_value(table.engine_pin)}")
    for r in table.risks:
        lines += ["", "[[stack.risks]]", *(f"{k} = {toml_value(v)}" for k, v in r.model_dump().items())]
    for u in table.unmirrored:
        lines += ["", "[[stack.unmirrored]]", *(f"{k} = {toml_value(v)}" for k, v in u.model_dump().items())]
    return lines


def write_spec(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)

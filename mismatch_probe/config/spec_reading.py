"""Reading a spec: from a TOML file (:func:`load_spec_file`, paths relative to the file), from a dict
(:func:`spec_from_dict`), and ``--set KEY=VALUE`` overrides (:func:`apply_overrides`); pydantic's
first error as one line naming the key, its TOML line or its flag."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ValidationError,
)

from mismatch_probe.config.engine_spec import bare_name
from mismatch_probe.config.keys import KeyLines, unknown_key
from mismatch_probe.config.sections import SECTIONS
from mismatch_probe.config.spec import ProbeSpec, flag_of, spec_settings
from mismatch_probe.config.validation import (
    choices_of,
    dotted,
    first_error,
    is_rule,
    model_at,
    phrase,
    rule_parts,
)
from mismatch_probe.errors import ConfigError
from mismatch_probe.files import read_text

# ---- reading a spec ------------------------------------------------------------------------------


def _spec_error(exc: ValidationError, source: str, lines: KeyLines | None) -> ConfigError:
    """The first problem pydantic found in a spec, as one line naming the key (and its line in the file)."""
    err = first_error(exc)
    loc = tuple(err["loc"])
    kind = err["type"]

    def at(path: tuple[str | int, ...]) -> str:
        line = lines.line(path) if lines is not None else None
        return f"{source}:{line}" if line else source

    if is_rule(err):
        message, key, hint = rule_parts(err)
        at_key = loc if key is None else (*loc, *key) if isinstance(key, tuple) else (*loc, key)
        return ConfigError(f"{at(at_key)}: {message}", hint=hint)
    what = phrase(err, _choices(loc))
    if loc[0] == "variants":
        if len(loc) < 3:
            return ConfigError(f"{at(loc)}: variants must be an array of tables ([[variants]])")
        where = f"variants[{loc[1]}]"
        if loc[2] == "name":
            return ConfigError(
                f"{at(loc)}: {where} needs a name of letters, digits, '.', '_' or '-' (it names its run directory)"
            )
        if len(loc) == 3:
            if kind == "extra_forbidden":
                return ConfigError(
                    f"{at(loc)}: {where}: {loc[2]!r} cannot vary between variants, which score the same rollouts",
                    hint="a variant sets [reference] and [corrections] settings; give other settings a spec of their own",
                )
            return ConfigError(f"{at(loc)}: {where}: {loc[2]} must be a table")
        if kind == "extra_forbidden":
            return unknown_key(str(loc[-1]), _known(loc), f"{at(loc)}: {where}.{loc[2]}")
        return ConfigError(f"{at(loc)}: {where}.{dotted(loc[2:])} {what}")
    if len(loc) == 1:
        if kind == "extra_forbidden":
            return unknown_key(str(loc[0]), ProbeSpec.model_fields, at(loc))
        if loc[0] in SECTIONS:
            return ConfigError(f"{at(loc)}: [{loc[0]}] {what if kind == 'value_error' else 'must be a table'}")
        return ConfigError(f"{at(loc)}: {loc[0]} {what}")
    if kind == "extra_forbidden":
        return unknown_key(str(loc[-1]), _known(loc), f"{at(loc)} [{dotted(loc[:-1])}]")
    return ConfigError(f"{at(loc)}: {dotted(loc)} {what}")


def _choices(loc: tuple[str | int, ...]) -> tuple[Any, ...]:
    """What a message about the value at ``loc`` lists as accepted (a setting's declared choices)."""
    key = dotted(loc)
    if loc and loc[0] == "variants" and len(loc) >= 4:
        key = dotted(loc[2:])
    s = spec_settings().get(key)
    return s.choices if s is not None else choices_of(ProbeSpec, loc)


def _known(loc: tuple[str | int, ...]) -> list[str]:
    """The keys of the table that holds ``loc``'s last key."""
    model = model_at(ProbeSpec, loc[:-1])
    return list(model.model_fields) if model is not None else []


def spec_from_dict(
    data: dict[str, Any], *, base_dir: Path | None = None, source: str = "spec", text: str | None = None
) -> ProbeSpec:
    """Build a spec from nested dicts (a parsed TOML file, ``text`` its source for line numbers);
    unknown keys are errors."""
    data = dict(data)
    given: dict[str, str] = {}
    if base_dir is not None:
        for s in spec_settings().values():
            if not s.info.path:
                continue
            table = data if not s.section else data.get(s.section)
            value = table.get(s.name) if isinstance(table, dict) else None
            if not isinstance(value, str) or value in s.info.choices:  # a word it takes in a path's place
                continue
            if s.key == "engine.python" and bare_name(value):
                continue  # a bare name (python3) is looked up on PATH
            given[s.key] = value
            # not resolve() for the python: a venv's bin/python is a symlink whose target is not the venv
            resolved = (
                os.path.abspath(base_dir / value) if s.key == "engine.python" else str((base_dir / value).resolve())
            )
            if s.section:
                data[s.section] = {**table, s.name: resolved if not Path(value).is_absolute() else value}  # type: ignore[dict-item]
            else:
                data[s.name] = resolved if not Path(value).is_absolute() else value
    try:
        spec = ProbeSpec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(exc, source, KeyLines(text) if text is not None else None) from None
    spec.given_paths.update(given)
    return spec


def load_spec_file(path: str | Path) -> ProbeSpec:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"spec file {str(p)!r} is a directory", hint="give a probe spec (TOML), e.g. probes/demo.toml"
        )
    text = read_text(p, "spec file")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML ({exc})") from None
    spec = spec_from_dict(data, base_dir=p.resolve().parent, source=str(p), text=text)
    spec.given_paths["spec_file"] = str(p)  # as typed; run.json names the file it came from
    return spec


# How an override names its setting in a message: by its flag (compare --top-p 2), by ``--set``
# (score --set reference.dtype=x), or by its key (a sweep axis).
NAMED_BY: dict[str, Callable[[str], str]] = {
    "flag": flag_of,
    "set": lambda key: f"--set {key}",
    "key": lambda key: key,
}


def apply_overrides(
    spec: ProbeSpec,
    overrides: dict[str, Any],
    *,
    named_by: Literal["flag", "set", "key"] | Callable[[str], str] = "flag",
    base_dir: Path | None = None,
) -> ProbeSpec:
    """A new spec: ``spec`` with ``{"field": v}`` / ``{"section.field": v}`` overrides (flags, ``--set``,
    a sweep axis) applied; ``None`` means unset. The result is validated as a whole, so two settings
    that only hold together can be given together; an error names the setting ``named_by`` says.
    A relative path is relative to ``base_dir`` (a sweep axis: its spec file's directory), else to
    the working directory."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return spec
    settings = spec_settings()
    for key in given:
        if key not in settings:
            section, _, leaf = key.rpartition(".")
            known = [s.name for s in settings.values() if s.section == section]
            raise unknown_key(leaf, known, "override")
    data = spec.model_dump()
    paths = dict(spec.given_paths)
    for key, value in given.items():
        s = settings[key]
        if (
            s.info.path
            and isinstance(value, str)
            and value not in s.info.choices
            and not (key == "engine.python" and bare_name(value))
        ):
            paths[key] = value  # as typed, relative to base_dir or the working directory
            at = Path(base_dir or ".") / value
            # not resolve() for the python: a venv's bin/python is a symlink whose target is not the venv
            value = os.path.abspath(at) if key == "engine.python" else str(at.resolve())
        target = data[s.section] if s.section else data
        if isinstance(value, dict) and isinstance(target.get(s.name), dict):
            value = {**target[s.name], **value}  # a table's keys given as flags add to the file's
        target[s.name] = value
    try:
        fresh = ProbeSpec.model_validate(data)
    except ValidationError as exc:
        err = first_error(exc)
        if is_rule(err):
            message, _, hint = rule_parts(err)
            raise ConfigError(message, hint=hint) from None
        key = dotted(err["loc"])
        name_of = named_by if callable(named_by) else NAMED_BY[named_by]
        name = name_of(key) if key in given else flag_of(key) if key in settings else key
        raise ConfigError(f"{name} {phrase(err, _choices(tuple(err['loc'])))}") from None
    fresh._given_paths = paths
    return fresh

"""The spec's settings as the CLI's options, derived from their declarations (:mod:`.settings`):
each setting's flag, help, help panel, choices and default, one Typer option each, for the commands
that take spec settings (``cli.py``: ``compare``, ``sample``, ``sweep`` every setting; ``score``,
``import`` and ``timeline`` the tables they may change). See ARCHITECTURE.md, Configuration.
"""

from __future__ import annotations

import functools
import inspect
from typing import Annotated

import typer


def _toml_value(raw: str) -> object:
    """A value as TOML reads it (2, 1e-3, true, "text"), or the text itself when it is not TOML (bfloat16)."""
    import tomllib

    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def key_values(pairs: list[str], flag: str, example: str) -> dict[str, object]:
    """``KEY=VALUE`` flags as a dict, the values read as TOML."""
    from mismatch_probe.errors import ConfigError

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} {pair!r} is not KEY=VALUE", hint=f"e.g. {flag} {example}")
        out[key.strip()] = _toml_value(raw)
    return out


def option_param(
    setting, *, from_dump: bool = False, unset: str | None = None, aliases: tuple[str, ...] = ()
) -> inspect.Parameter:
    """One Typer option for a spec setting (config/spec.py declares its flag, help and panel).
    Every option defaults to unset (None), so a spec file's value stands unless a flag is given;
    ``from_dump``: its default is what a dump says (``import``); ``unset``: what stands instead of
    the declared default (``score``: the run's)."""
    info = setting.info
    choices = [str(c) for c in setting.choices]
    if setting.key == "engine.extra_args":
        kind: object = list[str] | None
    elif info.flags[1:]:
        kind = bool | None
    else:
        plain = setting.value_types
        kind = int | None if plain == (int,) else float | None if plain == (float,) else str | None
    default = setting.default
    shown = (
        None
        if default is None or default == {}
        else str(default).lower()
        if isinstance(default, bool)
        else str(default)
    )
    help = setting.help
    if unset is not None:
        shown = unset
    if from_dump:
        otherwise = "the framework's usual one" if setting.section == "engine" else shown
        help, shown = f"{help} Default: the dump's, else {otherwise}.", None
    option = typer.Option(
        info.flag,
        *aliases,
        help=help,
        rich_help_panel=info.group or None,
        metavar=info.metavar or ("[" + "|".join(choices) + "]" if choices else None),
        show_default=shown if shown is not None else False,
    )
    return inspect.Parameter(
        setting.key.replace(".", "__"), inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind, option]
    )


def with_spec_options(
    command=None,
    *,
    sections: tuple[str, ...] = (),
    keys: tuple[str, ...] = (),
    from_dump: tuple[str, ...] = (),
    unset: str | None = None,
    aliases: dict[str, tuple[str, ...]] | None = None,
):
    """Give ``command`` one option per spec setting: every setting (``compare``, ``sample``,
    ``sweep``), or those of the tables ``sections`` and the settings ``keys`` (``score``, ``import``,
    ``timeline``). They arrive as its ``overrides`` argument, ``{"sampling.top_p": 0.9, ...}``, the
    settings given on the command line. ``from_dump``: settings whose default is a dump's; ``unset``: what
    stands when a flag is not given, where it is not the declared default; ``aliases``: another spelling a command has kept for a setting's flag."""
    if command is None:
        return functools.partial(
            with_spec_options, sections=sections, keys=keys, from_dump=from_dump, unset=unset, aliases=aliases
        )
    from mismatch_probe.config.spec import spec_settings

    every = not sections and not keys
    spellings = aliases or {}
    settings = [s for s in spec_settings().values() if every or s.section in sections or s.key in keys]
    own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items() if name != "overrides"]
    spec_params = [
        option_param(s, from_dump=s.key in from_dump, unset=unset, aliases=spellings.get(s.key, ())) for s in settings
    ]

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        overrides: dict[str, object] = {}
        for s in settings:
            value = kwargs.pop(s.key.replace(".", "__"), None)
            if s.key == "engine.extra_args" and value:
                value = key_values(value, s.info.flag, "max_logprobs=20")
            overrides[s.key] = value or None if s.key == "engine.extra_args" else value
        return command(*args, overrides=overrides, **kwargs)

    params = own + spec_params
    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__  # Typer reads the signature above, not the function's own
    return wrapper

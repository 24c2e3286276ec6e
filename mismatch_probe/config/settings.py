"""What a spec setting is beyond its type: the one declaration everything else is derived from.

Each field of the spec's setting tables (``config/spec.py``) is declared with :func:`setting`: its
default, its help text, its constraints (pydantic ``Field`` ranges and ``Literal`` choices, so a bad
value is refused with the key's line in a TOML file and the shipped JSON Schema carries the same
ranges and enums), and a :class:`SettingInfo`: the CLI flag that sets it, the engines that honour it,
what it changes (and so which fingerprints it enters), since when records hold it, and its help
panel. The CLI options of ``compare`` / ``sample`` / ``sweep``, the engines' settings lists, the
remote client's settings, the variant patch models, the schema and ``docs/settings.md`` are all
read from these declarations (:func:`mismatch_probe.config.spec.spec_settings`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

# What a setting changes, and so which fingerprints it enters:
# - "rollouts": what the engine samples (the rollout fingerprint, and the run's);
# - "run": how this run scores or where its engine ran from (the run's fingerprint only);
# - "nothing": where the results go, or how a running server is reached (no fingerprint: a run
#   resumes when the server comes back at another address, with other timeouts).
Affects = Literal["rollouts", "run", "nothing"]

# Every engine honours a setting whose ``engines`` is this.
EVERY_ENGINE = None
# ``engines`` left out: the engines that ``engine_args`` names (none: every engine)
_ENGINES_OF_ARGS: Any = object()


@dataclass(frozen=True)
class SettingInfo:
    flag: str  # the CLI flag: "--top-p"; a boolean's "--packing/--no-packing" (on/off)
    affects: Affects
    engines: frozenset[str] | None = EVERY_ENGINE  # [engine] settings: the engines that honour it
    # [engine] settings: each engine's own argument(s) that take the value, (engine, (argument, ...)) pairs
    engine_args: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the record schema from which run.json records the setting at its default; an older record
    # holds it only when it was set (so its fingerprints were computed without it)
    since: int = 3
    group: str = ""  # the help panel of the flag
    choices: tuple[str, ...] = ()  # what a message lists when the accepted values include aliases
    not_an_axis: str | None = None  # why a [sweep] axis cannot vary it (None: it can)
    path: bool = False  # a path: relative to the spec file that gives it, recorded as given
    metavar: str | None = None

    @property
    def flags(self) -> tuple[str, ...]:
        """The flag's spellings: ``("--top-p",)``, or a boolean's ``("--packing", "--no-packing")``."""
        return tuple(self.flag.split("/"))

    def args_of(self, engine: str) -> tuple[str, ...]:
        """``engine``'s own argument(s) for this setting; () where it has none (or takes it otherwise)."""
        return dict(self.engine_args).get(engine, ())


def engine_args_phrase(engine_args: Mapping[str, str | tuple[str, ...]]) -> str:
    """How a help text names each engine's own argument: ``vllm: max_num_seqs; sglang: max_running_requests``,
    engines that share the name together (``vllm, sglang: quantization``)."""
    by_args: dict[tuple[str, ...], list[str]] = {}
    for engine, args in engine_args.items():
        by_args.setdefault((args,) if isinstance(args, str) else tuple(args), []).append(engine)
    return "; ".join(f"{', '.join(engines)}: {', '.join(args)}" for args, engines in by_args.items())


def setting(
    default: Any = None,
    help: str = "",
    *,
    flag: str,
    affects: Affects,
    engines: tuple[str, ...] | None = _ENGINES_OF_ARGS,
    engine_args: Mapping[str, str | tuple[str, ...]] | None = None,
    since: int = 3,
    group: str = "",
    choices: tuple[str, ...] = (),
    not_an_axis: str | None = None,
    path: bool = False,
    metavar: str | None = None,
    default_factory: Any = None,
    **constraints: Any,
) -> Any:
    """A spec field: ``Field(default, description=help, **constraints)`` carrying its :class:`SettingInfo`.

    ``engine_args``: each engine's own argument name(s) for the setting (``{"vllm": "max_num_seqs",
    "sglang": "max_running_requests"}``), the one place they are written: the adapters build their
    arguments from them, and ``{args}`` in ``help`` names them (:func:`engine_args_phrase`).
    ``engines``: the engines that honour it, by default those ``engine_args`` names (every engine
    when neither is given); name them where an engine honours it without an argument of its own."""
    args = {engine: (a,) if isinstance(a, str) else tuple(a) for engine, a in (engine_args or {}).items()}
    if engines is _ENGINES_OF_ARGS:
        engines = tuple(args) or EVERY_ENGINE
    if engines is not None and not set(args) <= set(engines):
        raise ValueError(f"engine_args names engines the setting does not list: {sorted(set(args) - set(engines))}")
    if "{args}" in help:
        help = help.replace("{args}", engine_args_phrase(args))
    info = SettingInfo(
        flag=flag,
        affects=affects,
        engines=None if engines is None else frozenset(engines),
        engine_args=tuple(args.items()),
        since=since,
        group=group,
        choices=choices,
        not_an_axis=not_an_axis,
        path=path,
        metavar=metavar,
    )
    if default_factory is not None:
        field = Field(default_factory=default_factory, description=help, **constraints)
    else:
        field = Field(default, description=help, **constraints)
    field.metadata.append(info)
    return field


def info_of(field: Any) -> SettingInfo | None:
    """The :class:`SettingInfo` of a pydantic ``FieldInfo``, or None for a field that is not a setting."""
    return next((m for m in field.metadata if isinstance(m, SettingInfo)), None)

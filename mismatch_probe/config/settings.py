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


@dataclass(frozen=True)
class SettingInfo:
    flag: str  # the CLI flag: "--top-p"; a boolean's "--packing/--no-packing" (on/off)
    affects: Affects
    engines: frozenset[str] | None = EVERY_ENGINE  # [engine] settings: the engines that honour it
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


def setting(
    default: Any = None,
    help: str = "",
    *,
    flag: str,
    affects: Affects,
    engines: tuple[str, ...] | None = EVERY_ENGINE,
    since: int = 3,
    group: str = "",
    choices: tuple[str, ...] = (),
    not_an_axis: str | None = None,
    path: bool = False,
    metavar: str | None = None,
    default_factory: Any = None,
    **constraints: Any,
) -> Any:
    """A spec field: ``Field(default, description=help, **constraints)`` carrying its :class:`SettingInfo`."""
    info = SettingInfo(
        flag=flag,
        affects=affects,
        engines=None if engines is None else frozenset(engines),
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

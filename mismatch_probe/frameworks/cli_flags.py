"""The frameworks that take their settings as command-line flags (slime, OpenRLHF, ms-swift): their
flags read from a launch script, from a text file of the arguments, or as typed, into a
:class:`~mismatch_probe.frameworks.base.FrameworkConfig` keyed by each flag as the framework spells it."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mismatch_probe.errors import ConfigError
from mismatch_probe.frameworks.base import FrameworkConfig
from mismatch_probe.frameworks.sources import flag_values, shell_words

# ${NAME[@]} of an array the script does not define (a sourced file's, e.g. slime's MODEL_ARGS)
_UNRESOLVED_ARRAY = re.compile(r"^\$\{\w+\[@\]\}$")


def command_words(words: list[str], entries: tuple[str, ...]) -> list[str] | None:
    """The words after the last word that starts the framework's command (``train.py``,
    ``openrlhf.cli.train_ppo_ray``, ``swift rlhf``: an entry of several words matches them in a
    row), or None when none does."""
    found = None
    for entry in entries:
        parts = entry.split()
        for i in range(len(words) - len(parts) + 1):
            window = words[i : i + len(parts)]
            # a path to the entry script counts (python3 /root/slime/train.py)
            if window[:-1] == parts[:-1] and (window[-1] == parts[-1] or window[-1].endswith("/" + parts[-1])):
                found = max(found or 0, i + len(parts))
    return None if found is None else words[found:]


def read_flags(
    config: FrameworkConfig,
    inputs: list[str],
    *,
    entries: tuple[str, ...],
    booleans: frozenset[str],
    key: Callable[[str], str] = lambda flag: flag,
    what: str,
) -> None:
    """Put the flags of ``inputs`` into ``config``, later ones winning as with argparse.

    An input that is a file is a launch script (the words after one of ``entries``) or, holding no
    entry, the arguments pasted into a file; any other input is a word typed on the command line
    (``--rollout-top-p 0.9`` as two inputs, or ``--rollout-top-p=0.9``). ``booleans`` are the
    framework's ``store_true`` flags, which take no value; ``key`` spells a flag as the config keys it."""
    typed: list[str] = []
    for item in inputs:
        path = Path(item)
        value_of_typed_flag = bool(typed) and typed[-1].startswith("--") and "=" not in typed[-1]
        if value_of_typed_flag and typed[-1] not in booleans or not path.is_file():
            if not item.startswith("-") and not typed:
                raise ConfigError(
                    f"{item}: no such file, and not a flag",
                    hint=f"give {what}'s launch script, a file of its arguments, or its flags (--name value)",
                )
            typed.append(item)
            continue
        words = shell_words(path)
        after = command_words(words, entries)
        if after is None and path.suffix in (".sh", ".bash"):
            raise ConfigError(
                f"{item}: no `{entries[0]}` command in it",
                hint=f"give {what}'s launch script, or a file of just its arguments",
            )
        _put(config, _flags(words if after is None else after, booleans), item, key)
        config.files.append(item)
    if typed:
        _put(config, _flags(typed, booleans), "command line", key)


def _flags(words: list[str], booleans: frozenset[str]) -> dict[str, Any]:
    return flag_values([w for w in words if not _UNRESOLVED_ARRAY.match(w)], booleans)


def _put(config: FrameworkConfig, flags: dict[str, Any], where: str, key: Callable[[str], str]) -> None:
    for flag, value in flags.items():
        config.set(key(flag), value, where)


def flag(value: Any) -> bool:
    """A ``store_true`` flag's value (True when given) or a typed boolean (``--use_vllm true``)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)

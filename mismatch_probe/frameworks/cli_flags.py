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


def commands(words: list[str], entries: tuple[str, ...]) -> list[tuple[str, list[str]]]:
    """Each command of ``entries`` in ``words``, in order: the entry it starts with (``train.py``,
    ``openrlhf.cli.train_ppo_ray``, ``swift rlhf``: an entry of several words matches them in a row;
    a path to the entry script counts) and its words, up to the next such command."""
    starts: list[tuple[int, int, str]] = []  # (where the entry starts, where its flags start, entry)
    for entry in entries:
        parts = entry.split()
        for i in range(len(words) - len(parts) + 1):
            window = words[i : i + len(parts)]
            if window[:-1] == parts[:-1] and (window[-1] == parts[-1] or window[-1].endswith("/" + parts[-1])):
                starts.append((i, i + len(parts), entry))
    starts.sort()
    ends = [s[0] for s in starts[1:]] + [len(words)] if starts else []
    return [(entry, words[begin:end]) for (_, begin, entry), end in zip(starts, ends, strict=True)]


def read_flags(
    config: FrameworkConfig,
    inputs: list[str],
    *,
    entries: tuple[str, ...],
    booleans: frozenset[str],
    key: Callable[[str, str], str] = lambda flag, entry: flag,
    what: str,
) -> None:
    """Put the flags of ``inputs`` into ``config``, later ones winning as with argparse.

    An input that is a file is a launch script (the words after one of ``entries``) or, holding no
    entry, the arguments pasted into a file; any other input is a word typed on the command line
    (``--rollout-top-p 0.9`` as two inputs, or ``--rollout-top-p=0.9``); the arguments of a file or
    of the command line are those of the first entry's command. ``booleans`` are the framework's
    ``store_true`` flags, which take no value; ``key(flag, entry)`` spells a flag of an entry's
    command as the config keys it."""
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
        found = commands(words, entries)
        if not found and path.suffix in (".sh", ".bash"):
            raise ConfigError(
                f"{item}: no `{entries[0]}` command in it",
                hint=f"give {what}'s launch script, or a file of just its arguments",
            )
        for entry, args in found or [(entries[0], words)]:
            _put(config, _flags(args, booleans), item, entry, key)
        config.files.append(item)
    if typed:
        _put(config, _flags(typed, booleans), "command line", entries[0], key)


def _flags(words: list[str], booleans: frozenset[str]) -> dict[str, Any]:
    return flag_values([w for w in words if not _UNRESOLVED_ARRAY.match(w)], booleans)


def _put(
    config: FrameworkConfig, flags: dict[str, Any], where: str, entry: str, key: Callable[[str, str], str]
) -> None:
    for flag, value in flags.items():
        config.set(key(flag, entry), value, where)


def flag(value: Any) -> bool:
    """A ``store_true`` flag's value (True when given) or a typed boolean (``--use_vllm true``)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)

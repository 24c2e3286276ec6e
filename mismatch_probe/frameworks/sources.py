"""The ways RL frameworks take their settings, read as they read them: Hydra-style YAML with
``key=value`` overrides (verl, SkyRL, NeMo-RL), TOML (prime-rl), YAML/JSON of a dataclass's fields
(TRL's GRPOConfig) and command-line flags, typed or inside a launch script (slime, OpenRLHF,
ms-swift). Each returns ``(key, value)`` pairs a framework module puts into its
:class:`~mismatch_probe.frameworks.base.FrameworkConfig`."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from mismatch_probe.errors import ConfigError


def flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``{"a": {"b": 1}}`` -> ``("a.b", 1)``; lists and scalars are leaves. An empty mapping is a
    leaf too (``engine_kwargs: {}`` sets the key)."""
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif prefix:
        yield prefix, tree


_INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([\w.]+)(?:,(.*))?\}$")


def resolve_interpolations(config: Any) -> None:
    """Resolve a whole-value OmegaConf interpolation (``${data.max_response_length}``,
    ``${oc.select:key,default}``) against the config, as OmegaConf does when the framework reads
    the key; the value keeps the origin of the key it names. Others stay as written."""
    for key in list(config.keys()):
        found = config.get(key)
        seen = {key}
        while found is not None and isinstance(found.value, str) and (m := _INTERPOLATION.match(found.value)):
            target = config.get(m[1])
            if m[1] in seen:
                break
            seen.add(m[1])
            if target is None and m[2] is not None:
                config.replace(key, parse_scalar(m[2]), found.origin)
                break
            if target is None:
                break
            config.replace(key, target.value, target.origin)
            found = config.get(key)


def read_structured(path: Path) -> dict[str, Any]:
    """A YAML, JSON or TOML file as a mapping."""
    text = _text(path)
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top, got {type(data).__name__}")
    return data


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", hint="give the framework's config file or launch script") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None


def parse_scalar(text: str) -> Any:
    """An override's or flag's value as Hydra and argparse users write it: YAML's scalars
    (``1e-6``, ``true``, ``null``, ``[a,b]``), quotes removed; anything unparseable stays text."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+", value):
        return float(value)  # YAML 1.1 reads 1e-6 as a string
    return value


OVERRIDE = re.compile(r"^(?P<op>\+\+|\+|~)?(?P<key>[A-Za-z_][\w.\-@/]*)(=(?P<value>.*))?$", re.DOTALL)


def hydra_override(token: str) -> tuple[str, str, Any] | None:
    """``("set" | "delete", key, value)`` of a Hydra command-line override (``a.b=1``, ``+a.b=1``,
    ``++a.b=1``, ``~a.b``), or None when ``token`` is not one."""
    m = OVERRIDE.match(token)
    if m is None or (m["value"] is None and m["op"] != "~"):
        return None
    if m["op"] == "~":
        return "delete", m["key"], None
    return "set", m["key"], parse_scalar(m["value"])


def shell_words(path: Path) -> list[str]:
    """A launch script's words, split as bash splits them once line continuations are joined:
    comments dropped, ``NAME=(...)`` arrays expanded where ``${NAME[@]}`` uses them, ``$NAME`` of a
    plain assignment substituted; what cannot be resolved (``$(...)``, an unset variable) stays as
    written. Statements are not told apart: the framework's flags are found among all the words."""
    lexer = shlex.shlex(_strip_comments(_text(path)).replace("\\\n", " "), posix=True)
    lexer.whitespace_split = True
    lexer.commenters = ""  # comments are gone: shlex would also end a word at a '#' inside it (NAME#1000)
    try:
        tokens = list(lexer)
    except ValueError as exc:
        raise ConfigError(f"{path}: cannot split it as a shell script: {exc}") from None
    arrays: dict[str, list[str]] = {}
    scalars: dict[str, str] = {}
    words: list[str] = []
    array: tuple[str, list[str]] | None = None
    for token in tokens:
        if array is not None:
            closing = token.endswith(")") and not token.startswith("$(")
            item = token[:-1] if closing else token
            if item:
                array[1].extend(_substitute(item, scalars, arrays))
            if closing:
                arrays[array[0]] = array[1]
                array = None
            continue
        m = re.fullmatch(r"([A-Za-z_]\w*)(\+?)=\((.*)", token, re.DOTALL)
        if m:
            array = (m[1], list(arrays.get(m[1], [])) if m[2] else [])
            rest = m[3]
            if rest.endswith(")"):
                array[1].extend(_substitute(rest[:-1], scalars, arrays) if rest[:-1] else [])
                arrays[array[0]] = array[1]
                array = None
            elif rest:
                array[1].extend(_substitute(rest, scalars, arrays))
            continue
        m = re.fullmatch(r"([A-Za-z_]\w*)=(.*)", token, re.DOTALL)
        if m:
            scalars[m[1]] = " ".join(_substitute(m[2], scalars, arrays))
        words.extend(_substitute(token, scalars, arrays))
    return words


def _strip_comments(text: str) -> str:
    """``text`` without its comments, as bash reads them: a ``#`` that starts a word, outside quotes,
    to the end of its line (a ``#`` inside a word, ``AI-MO/NuminaMath-TIR#1000``, is the word's)."""
    out: list[str] = []
    quote = ""
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and quote != "'":
            out.append(text[i : i + 2])
            i += 2
            continue
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _substitute(token: str, scalars: dict[str, str], arrays: dict[str, list[str]]) -> list[str]:
    m = re.fullmatch(r"\$\{([A-Za-z_]\w*)\[@\]\}", token)
    if m and m[1] in arrays:
        return list(arrays[m[1]])

    def scalar(match: re.Match[str]) -> str:
        name = match[1] or match[4]
        if name in scalars:
            return scalars[name]
        return match[3] if match[2] else match[0]  # ${NAME:-default} of an unset NAME: the default

    return [re.sub(r"\$\{([A-Za-z_]\w*)(:?-([^}]*))?\}|\$([A-Za-z_]\w*)", scalar, token)]


def flag_values(words: list[str], booleans: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``--flag value`` / ``--flag=value`` / a bare ``--flag`` (True) from a command's words, flags
    spelled as given (``--rollout-top-p``, ``--vllm_gpu_memory_utilization``). ``booleans``: flags
    that take no value (argparse ``store_true``); a flag followed by another flag is one too. The
    last occurrence wins, as with argparse. Several values after a flag (``nargs="+"``) are a list."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--") or len(w) == 2:
            i += 1
            continue
        name, eq, inline = w.partition("=")
        if eq:
            out[name] = parse_scalar(inline)
            i += 1
            continue
        if name in booleans:
            out[name] = True
            i += 1
            continue
        values = []
        j = i + 1
        while j < len(words) and not (words[j].startswith("--") and len(words[j]) > 2) and not _ends_command(words[j]):
            values.append(words[j])
            j += 1
        if not values:
            out[name] = True
        elif len(values) == 1:
            out[name] = parse_scalar(values[0])
        else:
            out[name] = [parse_scalar(v) for v in values]
        i = j
    return out


def _ends_command(word: str) -> bool:
    return word in {"&&", "||", ";", "|", "&", ">", ">>", "2>&1"} or word.startswith(("2>", ">"))

"""Prompt files and tokenization: the one place where text becomes token ids.

A prompts file is JSON Lines; each line is an object with one of

* ``"messages"``: a chat (``[{"role": ..., "content": ...}, ...]``), rendered with the model's
  chat template and a generation prompt;
* ``"prompt"``: raw text, tokenized as the tokenizer does by default (special tokens added);
* ``"prompt_token_ids"``: token ids used as they are;

and optionally ``"id"`` (default ``<file stem>-<line number>``). Blank lines are skipped.
Every engine and the reference see the ids produced here, never re-tokenized text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mismatch_probe.errors import ConfigError
from mismatch_probe.files import not_utf8


@dataclass
class Prompt:
    id: str
    token_ids: np.ndarray  # int32
    line: int
    # a recorded conversation: the messages between its assistant turns (tool outputs, user
    # follow-ups), replayed while the engine generates every assistant turn anew
    recorded: list[list[dict]] | None = None
    messages: list[dict] | None = None  # the chat the prompt ids were rendered from, if any


def split_recorded(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """``(prompt messages, blocks)``: the messages before the first assistant message, and the
    non-assistant messages following each assistant message (a trailing empty block dropped)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        return messages, []
    blocks: list[list[dict]] = []
    for m in messages[first:]:
        if m["role"] == "assistant":
            blocks.append([])
        else:
            blocks[-1].append(m)
    if not blocks[-1]:
        blocks.pop()
    if any(not b for b in blocks):
        raise ConfigError(
            "two assistant messages in a row: a recorded conversation needs the tool or user "
            "messages between its assistant turns"
        )
    return messages[:first], blocks


def _parse_line(obj: object, where: str) -> tuple[str, object]:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kinds = [k for k in ("messages", "prompt", "prompt_token_ids") if k in obj]
    if len(kinds) != 1:
        raise ConfigError(f"{where}: needs exactly one of 'messages', 'prompt' or 'prompt_token_ids'")
    kind = kinds[0]
    value = obj[kind]
    if kind == "messages":
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ConfigError(f"{where}: message {i} needs string 'role' and 'content'")
    elif kind == "prompt":
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: 'prompt' must be a non-empty string")
    else:
        if not (isinstance(value, list) and value and all(isinstance(t, int) and t >= 0 for t in value)):
            raise ConfigError(f"{where}: 'prompt_token_ids' must be a non-empty list of non-negative integers")
    return kind, value


def read_prompt_records(path: str | Path, max_prompts: int | None = None) -> list[tuple[int, str | None, str, object]]:
    """Parse and validate the file: ``(line, id, kind, value)`` per prompt, errors name the line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompts file {str(p)!r} does not exist")
    records = []
    with open(p, "rb") as f:
        for lineno, raw_bytes in enumerate(f, start=1):
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise not_utf8(p, exc, raw_bytes, line=lineno) from None
            if not raw.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            kind, value = _parse_line(obj, where)
            pid = obj.get("id")
            if pid is not None and not isinstance(pid, (str, int)):
                raise ConfigError(f"{where}: 'id' must be a string or integer")
            records.append((lineno, None if pid is None else str(pid), kind, value))
            if max_prompts is not None and len(records) >= max_prompts:
                break
    if not records:
        raise ConfigError(f"prompts file {str(p)!r} has no prompts")
    ids = [r[1] for r in records if r[1] is not None]
    if len(ids) != len(set(ids)):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"prompts file {str(p)!r}: id {dup!r} appears more than once")
    return records


def tokenize_prompts(
    path: str | Path,
    tokenizer,
    *,
    max_prompts: int | None = None,
    max_model_len: int,
    max_new_tokens: int,
) -> list[Prompt]:
    """Load a prompts file and tokenize it once; checks every prompt fits the model's context."""
    p = Path(path)
    vocab = len(tokenizer)
    out = []
    for lineno, pid, kind, value in read_prompt_records(p, max_prompts):
        where = f"{p}:{lineno}"
        recorded: list[list[dict]] = []
        if kind == "messages":
            if not getattr(tokenizer, "chat_template", None):
                raise ConfigError(
                    f"{where}: chat messages given but the tokenizer has no chat template",
                    hint="use 'prompt' (raw text) lines for a base model",
                )
            try:
                value, recorded = split_recorded(value)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            if not value:
                raise ConfigError(f"{where}: a recorded conversation must start with the prompt messages")
            try:
                text = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # a template error is the user's data meeting the model's template
                raise ConfigError(f"{where}: the chat template failed on these messages ({exc})") from None
            ids = tokenizer.encode(text, add_special_tokens=False)
        elif kind == "prompt":
            ids = tokenizer.encode(value)
        else:
            ids = value
            if max(ids) >= vocab:
                raise ConfigError(f"{where}: token id {max(ids)} is outside the tokenizer's vocabulary ({vocab})")
        need = len(ids) + max_new_tokens
        if need > max_model_len:
            raise ConfigError(
                f"{where}: prompt has {len(ids)} tokens; with max_tokens {max_new_tokens} it needs {need} positions "
                f"but the model's context is {max_model_len}",
                hint="shorten the prompt or lower --max-tokens",
            )
        out.append(
            Prompt(
                id=pid or f"{p.stem}-{lineno}",
                token_ids=np.asarray(ids, dtype=np.int32),
                line=lineno,
                recorded=recorded if kind == "messages" and recorded else None,
                messages=value if kind == "messages" else None,
            )
        )
    return out

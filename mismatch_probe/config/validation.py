"""pydantic's validation errors as the one-line :class:`ConfigError` messages people read.

The config models validate types strictly (no ``"2"`` for an integer, no ``"yes"`` for a boolean);
this module turns the first error pydantic reports into ``<key> must be an integer, got 1.5``, an
unknown key into a did-you-mean, and a rule of a model (raised with :func:`rule_error`) into its
own message, with the key it names so that the caller can point at the key's line.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

RULE = "config_rule"

PHRASES = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "dict_type": "must be a table",
    "model_type": "must be a table",
    "model_attributes_type": "must be a table",
    "list_type": "must be an array",
}


def rule_error(
    message: str, *, key: str | int | tuple[str | int, ...] | None = None, hint: str | None = None
) -> PydanticCustomError:
    """An error for a model validator to raise: ``message`` as people read it, ``key`` the key whose
    line it points at, relative to the model that raises it (a tuple for a nested key; None: the
    table's own line)."""
    return PydanticCustomError(RULE, "{message}", {"message": message, "key": key, "hint": hint})


def first_error(exc: ValidationError) -> ErrorDetails:
    return exc.errors(include_url=False)[0]


def is_rule(err: ErrorDetails) -> bool:
    return err["type"] == RULE


def rule_parts(err: ErrorDetails) -> tuple[str, Any, str | None]:
    """(message, key, hint) of a :func:`rule_error`."""
    ctx = err.get("ctx") or {}
    return ctx["message"], ctx.get("key"), ctx.get("hint")


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def model_at(root: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model class that validates the table at ``loc`` (list indices skipped), or None."""
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        found = _models_in(model.model_fields[part].annotation)
        model = found[0] if found else None
    return model


def choices_of(root: type[BaseModel], loc: Sequence[str | int]) -> tuple[Any, ...]:
    """The allowed values of a ``Literal`` field at ``loc``; () for any other field."""
    owner = model_at(root, loc[:-1])
    if owner is None or not isinstance(loc[-1], str) or loc[-1] not in owner.model_fields:
        return ()
    return literal_values(owner.model_fields[loc[-1]].annotation)


def literal_values(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(v for arg in typing.get_args(annotation) for v in literal_values(arg))
    return ()


def phrase(err: ErrorDetails, choices: tuple[Any, ...] = (), phrases: dict[str, str] | None = None) -> str:
    """What is wrong with the value, to follow its key: ``must be an integer, got 1.5``."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    table = {**PHRASES, **(phrases or {})}
    if kind == "missing":
        return "is required" + (f": one of {', '.join(map(str, choices))}" if choices else "")
    if kind in ("literal_error", "enum") or (choices and kind in ("string_type", "int_type")):
        return f"must be one of {', '.join(map(str, choices))}, got {value!r}"
    if kind in table:
        return f"{table[kind]}, got {value!r}"
    for bound, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if bound in ctx:
            limit = ctx[bound]
            return (
                f"must be {sign} {limit:g}, got {value!r}"
                if isinstance(limit, float)
                else f"must be {sign} {limit}, got {value!r}"
            )
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "string_pattern_mismatch":
        return f"must match {ctx.get('pattern')}, got {value!r}"
    msg = err["msg"]
    return msg[:1].lower() + msg[1:]


def dotted(loc: tuple[str | int, ...] | Any) -> str:
    """A pydantic error location as a dotted key: ``("engine", "tp")`` -> ``engine.tp``."""
    return ".".join(str(p) for p in loc)

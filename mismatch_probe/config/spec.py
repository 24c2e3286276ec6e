"""Probe specification: what to load, how to sample, how to score.

A spec comes from a TOML file (``probes/*.toml``) and/or CLI flags; flags win. Paths inside a spec
file are relative to that file, so a spec works from any working directory.

Every setting is declared once, in its table (``config/engine_spec.py``, ``config/sections.py``; top-level
settings on :class:`ProbeSpec` here), with :func:`~mismatch_probe.config.settings.setting`: its
type, default, range or choices, help text and :class:`~mismatch_probe.config.settings.SettingInfo`
(flag, engines, fingerprints, since when recorded). The CLI's options, the flag names in messages,
the engines' settings lists, the remote client's settings, the variant patch models, the JSON Schema
and ``docs/settings.md`` are derived from these declarations (:func:`spec_settings`).

Three steps, kept apart:

1. **validation** (pydantic, when a spec is built or a setting assigned): types, ranges, choices and
   the rules between settings; a bad value is a :class:`ConfigError` naming its TOML line or flag;
2. **normalization** (:meth:`ProbeSpec.normalized`, a new spec): aliases to canonical names
   (``bf16`` is ``bfloat16``), each engine's own defaults resolved (``logprobs_mode``), an
   engine URL selecting the remote engine;
3. **readiness** (:meth:`ProbeSpec.check_runnable`): what a run needs that a spec file may leave to
   flags (a model, prompts) and what lives outside it (the engine's interpreter exists).

Reading a spec file, a dict or ``--set`` overrides: ``config/spec_reading.py``. This module
re-exports the tables and vocabularies, so ``from mismatch_probe.config.spec import EngineSpec``
stays the one import callers need.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from mismatch_probe.config.choices import (
    ATTN_IMPLEMENTATIONS,
    DTYPE_ALIASES,
    ENGINE_DEFAULT_LOGPROBS_MODE,
    INPUTS,
    LAYOUT,
    LOGPROBS_MODES,
    PERTURBED,
    SP_ATTN_IMPLEMENTATIONS,
    LogprobsMode,
    SpecTable,
    default_logprobs_mode,
)
from mismatch_probe.config.engine_spec import EngineSpec, bare_name
from mismatch_probe.config.keys import unknown_key
from mismatch_probe.config.sections import (
    SECTIONS,
    VARIANT_SECTIONS,
    CorrectionThresholds,
    ReferenceSpec,
    SamplingSpec,
    SyncSpec,
)
from mismatch_probe.config.settings import SettingInfo, info_of, setting
from mismatch_probe.config.stack_spec import StackSpec
from mismatch_probe.config.sweep_spec import SweepSpec
from mismatch_probe.config.validation import (
    dotted,
    first_error,
    is_rule,
    literal_values,
    phrase,
    rule_error,
    rule_parts,
)
from mismatch_probe.errors import ConfigError

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "CLIENT_SETTINGS",
    "COMMON_ENGINE_SETTINGS",
    "ENGINE_DEFAULT_LOGPROBS_MODE",
    "FINGERPRINT_SCHEMA",
    "INPUTS",
    "LAYOUT_SETTINGS",
    "LOGPROBS_MODES",
    "PERTURBED",
    "SECTIONS",
    "SP_ATTN_IMPLEMENTATIONS",
    "CorrectionThresholds",
    "CorrectionsPatch",
    "EngineSpec",
    "LogprobsMode",
    "ProbeSpec",
    "ReferencePatch",
    "ReferenceSpec",
    "SamplingSpec",
    "Setting",
    "SyncSpec",
    "VariantSpec",
    "default_logprobs_mode",
    "engine_arguments",
    "engine_settings",
    "flag_of",
    "rollout_fingerprint",
    "spec_settings",
    "unknown_key",
]

# The record schema whose fingerprint rules this version computes by (record.py: SCHEMA_VERSION;
# a setting declared ``since`` a later schema is left out of an older record's fingerprints while
# it is at its default, so runs recorded before it existed still resume).
FINGERPRINT_SCHEMA = 4

# ---- [[variants]] -------------------------------------------------------------------------------


class _Patch(BaseModel):
    """Some settings of a section, for a variant: only the keys given are set, and only those are
    recorded (run.json's ``variants`` lists what each variant changes)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_serializer(mode="wrap")
    def _only_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


def _patch_of(section: type[BaseModel], name: str) -> type[_Patch]:
    """A patch model of ``section``: each of its settings, optional (checked again once merged)."""
    fields: dict[str, Any] = {}
    for key, field in section.model_fields.items():
        constraints = [m for m in field.metadata if not isinstance(m, SettingInfo)]  # ranges, as the section's
        kind: Any = Annotated[field.annotation, *constraints] if constraints else field.annotation
        fields[key] = (kind | None, Field(None, description=field.description))
    return create_model(name, __base__=_Patch, __doc__=f"Any {section.__name__} setting, for a variant.", **fields)


if TYPE_CHECKING:  # to the type checker, a patch is a patch; pydantic validates the real fields
    ReferencePatch = _Patch
    CorrectionsPatch = _Patch
else:
    ReferencePatch = _patch_of(ReferenceSpec, "ReferencePatch")  # [variants.reference]
    CorrectionsPatch = _patch_of(CorrectionThresholds, "CorrectionsPatch")  # [variants.corrections]

VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class VariantSpec(_Patch):
    """One ``[[variants]]`` entry: a name (its run directory) and the reference and correction
    settings it scores the shared rollouts with."""

    name: str = Field(pattern=VARIANT_NAME.pattern)
    reference: ReferencePatch | None = None
    corrections: CorrectionsPatch | None = None


# ---- the spec -----------------------------------------------------------------------------------


class ProbeSpec(SpecTable):
    model: str | None = setting(
        None, "Local Hugging Face checkpoint directory.", flag="--model", affects="rollouts", group=INPUTS, path=True
    )
    prompts: str | None = setting(
        None, "Prompts file (JSON Lines).", flag="--prompts", affects="rollouts", group=INPUTS, path=True
    )
    out: str | None = setting(
        None,
        "Run directory (default reports/<name>-<time>).",
        flag="--out",
        affects="nothing",
        group=INPUTS,
        path=True,
        not_an_axis="it is where the run is written",
    )
    name: str | None = setting(
        None,
        "The run's name in reports (default: the model and engine).",
        flag="--name",
        affects="nothing",
        group=INPUTS,
        not_an_axis="it names the run",
    )
    max_prompts: int | None = setting(
        None, "Use only the first N prompts.", flag="--max-prompts", affects="rollouts", group=INPUTS, ge=1
    )
    shard_size: int = setting(
        256,
        "Samples per rollout and token shard (the unit of resume).",
        flag="--shard-size",
        affects="rollouts",
        group=INPUTS,
        ge=1,
    )
    max_turns: int = setting(
        1,
        "Assistant turns per sample; > 1 runs tool calls between turns.",
        flag="--max-turns",
        affects="rollouts",
        group=INPUTS,
        ge=1,
    )
    trust_remote_code: bool = setting(
        False,
        "Run the checkpoint's own modelling code (Hugging Face trust_remote_code).",
        flag="--trust-remote-code/--no-trust-remote-code",
        affects="rollouts",
        group=INPUTS,
    )
    engine: EngineSpec = Field(default_factory=EngineSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    reference: ReferenceSpec = Field(default_factory=ReferenceSpec)
    corrections: CorrectionThresholds = Field(default_factory=CorrectionThresholds)
    # [sync]: the engine's weights arrive through its update path (dropped from dumps while off)
    sync: SyncSpec = Field(default_factory=SyncSpec)
    # [[variants]]: reference (and correction) settings to score the same rollouts with, one run
    # each; recorded as {"name": ..., "reference": {...}, "corrections": {...}} (the keys given)
    variants: list[VariantSpec] = Field(default_factory=list)
    # [sweep]: the settings `mismatch-probe sweep` varies around this spec (a run of its own each)
    sweep: SweepSpec | None = None
    # [stack]: the framework config the spec mirrors and its known risks (mismatch-probe init);
    # in no fingerprint
    stack: StackSpec | None = None
    # The run uses absolute paths; run.json records them as the user gave them (in a spec file:
    # relative to it; as flags: as typed), so a record carries no machine's directory layout.
    # {"model": "../fixtures/models/tiny-qwen2", "engine.python": ...}; not part of any fingerprint.
    _given_paths: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def given_paths(self) -> dict[str, str]:
        return self._given_paths

    @field_validator("variants")
    @classmethod
    def _distinct_variants(cls, variants: list[VariantSpec]) -> list[VariantSpec]:
        names: set[str] = set()
        for i, v in enumerate(variants):
            if v.name in names:
                raise rule_error(f"variants[{i}]: the name {v.name!r} is used twice", key=i)
            names.add(v.name)
        if len(variants) == 1:
            raise rule_error("one variant compares nothing", hint="give two or more [[variants]], or none")
        return variants

    @model_validator(mode="after")
    def _sweep_or_variants(self) -> ProbeSpec:
        if self.sweep is not None and self.variants:
            raise rule_error(
                "a spec has [sweep] or [[variants]], not both",
                hint="a sweep varies reference settings too: give them as [[sweep.axes]]",
            )
        for i, axis in enumerate(self.sweep.axes if self.sweep is not None else ()):
            where = ("sweep", "axes", i, "key" if axis.key is not None else "levels")
            for key in axis.keys:
                section = key.partition(".")[0]
                if section not in SECTIONS:
                    raise rule_error(
                        f"sweep axis key {key!r} must name a setting as section.setting",
                        key=where,
                        hint=f"section one of {', '.join(SECTIONS)}, e.g. engine.dtype",
                    )
                setting = spec_settings().get(key)
                if setting is not None and setting.info.not_an_axis:
                    raise rule_error(f"{key} cannot be a sweep axis: {setting.info.not_an_axis}", key=where)
        for i, v in enumerate(self.variants):  # every variant is a valid spec, or the file is refused
            for section in VARIANT_SECTIONS:
                patch = getattr(v, section)
                if patch is not None and patch.model_fields_set:
                    try:
                        _merged(getattr(self, section), patch)
                    except ValidationError as exc:
                        err = first_error(exc)
                        at = ("variants", i, section, *err["loc"])
                        what = rule_parts(err)[0] if is_rule(err) else f"{section}.{dotted(err['loc'])} {phrase(err)}"
                        raise rule_error(f"variant {v.name!r}: {what}", key=at) from None
        return self

    @model_serializer(mode="wrap")
    def _without_empty_sweep(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a spec without [sweep] dumps, records and fingerprints exactly as before [sweep] existed
        d = handler(self)
        for table in ("sweep", "stack"):  # and without an empty [stack], as before it existed
            if d.get(table) is None:
                d.pop(table, None)
        return d

    # ---- normalization and readiness ---------------------------------------------------------

    def normalized(self) -> ProbeSpec:
        """A copy with aliases and defaults resolved (idempotent): dtype aliases to their canonical
        names, ``top_k = -1`` to 0, each engine's own ``logprobs_mode`` default, greedy sampling
        comparing raw log-probs, an engine URL selecting the remote engine, a bare interpreter name
        looked up on PATH. Every run, and every fingerprint, is of the normalized spec."""
        spec = self.model_copy(deep=True)
        spec._given_paths = dict(self._given_paths)
        e, s, r = spec.engine, spec.sampling, spec.reference
        if e.dtype != "auto":
            e.dtype = DTYPE_ALIASES[e.dtype]  # type: ignore[assignment]
        r.dtype = DTYPE_ALIASES[r.dtype]  # type: ignore[assignment]
        for name in ("fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_output_dtype"):
            if getattr(r, name) is not None:
                setattr(r, name, DTYPE_ALIASES[getattr(r, name)])
        if e.url is not None and e.name == "hf":  # a server's address means the remote engine
            e.name = "remote"
        if e.logprobs_mode is None:
            # a server's default: vLLM's raw_logprobs; SGLang's log_softmax(logits / T)
            e.logprobs_mode = default_logprobs_mode(e.name, e.api if e.name == "remote" else None)
        if s.top_k == -1:
            s.top_k = 0
        if e.logprobs_mode == "processed" and s.temperature == 0:
            # Greedy decoding has no processed distribution; both sides then use raw logits.
            e.logprobs_mode = "raw"
        if e.python is not None and bare_name(e.python):
            e.python = shutil.which(e.python) or e.python
        return spec

    def check_runnable(self) -> None:
        """What a run needs beyond a valid spec: a model and prompts (a spec file may leave them to
        flags), and an engine interpreter that exists."""
        if not self.model:
            raise ConfigError("no model given", hint="pass --model PATH or set model = ... in the spec file")
        if not self.prompts:
            raise ConfigError(
                "no prompts file given", hint="pass --prompts FILE.jsonl or set prompts = ... in the spec file"
            )
        python = self.engine.python
        found = shutil.which(python) if python is not None and bare_name(python) else python
        if python is not None and not (found and Path(found).is_file()):
            raise ConfigError(
                f"engine.python {python!r} does not exist",
                hint="give the python of a venv that has the engine and mismatch-probe installed, e.g. /opt/vllm/bin/python",
            )

    # ---- what is recorded and fingerprinted --------------------------------------------------

    def dump(self, schema: int = FINGERPRINT_SCHEMA) -> dict[str, Any]:
        """The spec as a record of ``schema`` holds it: every setting, except, for an older schema,
        those it did not record at their default (:attr:`SettingInfo.since`)."""
        return _as_of(self.model_dump(), schema)

    def to_dict(self) -> dict[str, Any]:
        """The spec as run.json records it: paths as given (others relative to the working
        directory when under it), every other value as the run uses it."""
        from mismatch_probe.files import portable_path

        d = self.dump()
        for s in spec_settings().values():
            if not s.info.path:
                continue
            target = d.get(s.section) if s.section else d
            if not target or target.get(s.name) is None or target[s.name] in s.info.choices:
                continue
            given = self.given_paths.get(s.key)
            # a bare interpreter name (python3) is looked up on PATH: keep it as typed
            value = target[s.name]
            target[s.name] = given if given is not None else (value if bare_name(value) else portable_path(value))
        return d

    def fingerprint(self, schema: int = FINGERPRINT_SCHEMA) -> str:
        """Hash of everything that changes the results (not where they are written, nor how a server
        is reached), by the rules of ``schema`` (a record's ``fingerprint_schema``)."""
        return _fingerprint(self.normalized().dump(schema))

    def rollout_fingerprint(self, schema: int = FINGERPRINT_SCHEMA) -> str:
        """Hash of what decides the rollouts (model, prompts, engine, sampling), not how they are scored."""
        return rollout_fingerprint(self.normalized().dump(schema))

    def expand_variants(self, base_out: Path) -> list[tuple[str, ProbeSpec]]:
        """One spec per ``[[variants]]`` entry, writing to ``base_out/<variant name>``."""
        out = []
        for v in self.variants:
            spec = self.model_copy(
                deep=True,
                update={
                    "variants": [],
                    "out": str(Path(base_out) / v.name),
                    "name": f"{self.name}-{v.name}" if self.name else v.name,
                },
            )
            spec._given_paths = {k: p for k, p in self.given_paths.items() if k != "out"}
            for section in VARIANT_SECTIONS:
                patch = getattr(v, section)
                if patch is not None and patch.model_fields_set:
                    setattr(spec, section, _merged(getattr(spec, section), patch))  # checked at load
            out.append((v.name, spec))
        return out


def _merged(current: BaseModel, patch: _Patch) -> BaseModel:
    return type(current).model_validate({**current.model_dump(), **patch.model_dump()})


def _as_of(d: dict[str, Any], schema: int) -> dict[str, Any]:
    """A dumped spec as a record of ``schema`` holds it (see :meth:`ProbeSpec.dump`). A [sync]
    table that syncs nothing is left out, so such a spec records and fingerprints as before [sync]."""
    d = json.loads(json.dumps(d))  # a copy
    if isinstance(d.get("sync"), dict) and d["sync"].get("start_from") is None:
        del d["sync"]
    for s in spec_settings().values():
        target = d.get(s.section) if s.section else d
        if isinstance(target, dict) and schema < s.info.since and s.name in target and target[s.name] == s.default:
            del target[s.name]
    return d


def _kept(d: dict[str, Any], affects: tuple[str, ...]) -> dict[str, Any]:
    """The settings of a dumped spec that affect one of ``affects`` (keys the dict lacks stay absent)."""
    kept: dict[str, Any] = {}
    for s in spec_settings().values():
        source = (d.get(s.section) or {}) if s.section else d
        if s.info.affects in affects and s.name in source:
            (kept.setdefault(s.section, {}) if s.section else kept)[s.name] = source[s.name]
    return kept


def _hash(d: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _fingerprint(d: dict[str, Any]) -> str:
    """:meth:`ProbeSpec.fingerprint` of a dumped spec: its settings that affect the rollouts or the
    run, and its ``[[variants]]`` and ``[sweep]`` tables."""
    kept = _kept(d, ("rollouts", "run"))
    for section in SECTIONS:
        if isinstance(d.get(section), dict):
            kept.setdefault(section, {})
    kept.update({k: d[k] for k in ("variants", "sweep") if k in d})
    return _hash(kept)


def rollout_fingerprint(spec_dict: dict[str, Any]) -> str:
    """:meth:`ProbeSpec.rollout_fingerprint` of a dumped spec (e.g. a run.json's ``spec``, which
    older records without a ``rollout_fingerprint`` need). Every top-level key that decides the
    rollouts is in the hash, null when absent, as the first records computed it."""
    kept = _kept(spec_dict, ("rollouts",))
    for s in spec_settings().values():
        if not s.section and s.info.affects == "rollouts":
            kept.setdefault(s.name, None)
    kept.setdefault("engine", {})
    kept.setdefault("sampling", spec_dict.get("sampling"))
    return _hash(kept)


# ---- the settings, as the rest of the package reads them -----------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting of the spec: where it is (``sampling.top_p``), its field and its :class:`SettingInfo`."""

    key: str  # "sampling.top_p"; a top-level setting by its name alone ("model")
    section: str  # "sampling"; "" for a top-level setting
    name: str
    field: FieldInfo
    info: SettingInfo

    @property
    def default(self) -> Any:
        return self.field.get_default(call_default_factory=True)

    @property
    def annotation(self) -> Any:
        return self.field.annotation

    @property
    def value_types(self) -> tuple[Any, ...]:
        """The types a value may have, ``None`` left out: ``(float,)`` for ``float | None``."""
        return tuple(t for t in typing.get_args(self.annotation) or (self.annotation,) if t is not type(None))

    @property
    def choices(self) -> tuple[Any, ...]:
        """The values a message lists: the declared ones, else the type's ``Literal`` values."""
        return self.info.choices or literal_values(self.annotation)

    @property
    def help(self) -> str:
        return self.field.description or ""


def _settings_of(model: type[BaseModel], section: str) -> Iterator[Setting]:
    for name, field in model.model_fields.items():
        info = info_of(field)
        if info is not None:
            yield Setting(f"{section}.{name}" if section else name, section, name, field, info)


@functools.cache
def spec_settings() -> dict[str, Setting]:
    """Every setting of the spec, by dotted key, in declaration order (top level first)."""
    found = list(_settings_of(ProbeSpec, ""))
    for section, model in SECTIONS.items():
        found += _settings_of(model, section)
    return {s.key: s for s in found}


def flag_of(key: str) -> str:
    """The CLI flag of a setting as people type it: ``--top-p``, ``--packing/--no-packing``."""
    return spec_settings()[key].info.flag


def engine_settings(engine: str) -> frozenset[str]:
    """The ``[engine]`` settings ``engine`` honours beyond those every engine honours."""
    return frozenset(
        s.name
        for s in spec_settings().values()
        if s.section == "engine" and s.info.engines is not None and engine in s.info.engines
    )


def engine_arguments(engine: str) -> dict[str, tuple[str, ...]]:
    """The ``[engine]`` settings that ``engine`` takes as arguments of its own, each with its
    argument name(s), in declaration order: ``{"max_num_seqs": ("max_running_requests",), ...}``
    (the declarations' ``engine_args``). The adapters build their arguments, and read back what the
    engine resolved, by these names; how a value converts is the adapter's."""
    return {
        s.name: s.info.args_of(engine)
        for s in spec_settings().values()
        if s.section == "engine" and s.info.args_of(engine)
    }


COMMON_ENGINE_SETTINGS = frozenset(
    s.name for s in spec_settings().values() if s.section == "engine" and s.info.engines is None
)
# where the engine's ranks go across GPUs and nodes (docs/engines-multinode.md)
LAYOUT_SETTINGS = tuple(s.name for s in spec_settings().values() if s.section == "engine" and s.info.group == LAYOUT)
# How a remote engine reaches its server, not what the server samples: a run resumes, and shares its
# rollouts, when the server comes back at another address or under another name, or with other timeouts.
CLIENT_SETTINGS = tuple(
    s.name for s in spec_settings().values() if s.section == "engine" and s.info.affects == "nothing"
)

"""The spec's ``[stack]`` table: the RL stack a spec mirrors, as `mismatch-probe init` read it.

It changes no result (no fingerprint holds it): it carries, from the framework's config to the run's
record and report, which framework and files the spec came from, the engine version the framework
pins, the settings the probe could not mirror, and the known mismatch risks of that configuration
with their evidence (``frameworks/risks.py`` finds them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StackRisk(BaseModel):
    """A known mismatch risk of the configuration: what it is, what in the config shows it, and the
    evidence that it is real (a published source, a framework file:line, a docs/engine-findings page)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    id: str
    title: str
    detail: str
    evidence: str


class StackUnmirrored(BaseModel):
    """A framework setting the probe has no setting for, as the config has it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    key: str
    value: str
    why: str


class StackSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    framework: str = Field(description="The RL framework whose config the spec mirrors (mismatch-probe init).")
    config: list[str] = Field(default_factory=list, description="The framework's files and overrides read.")
    commit: str | None = Field(None, description="The framework commit whose defaults filled unset keys.")
    engine_pin: str | None = Field(None, description="The engine version the framework pins.")
    risks: list[StackRisk] = Field(default_factory=list)
    unmirrored: list[StackUnmirrored] = Field(default_factory=list)

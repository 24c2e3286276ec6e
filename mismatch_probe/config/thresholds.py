"""The gate's thresholds file: ``[[checks]]`` tables, read and validated (evaluation: :mod:`mismatch_probe.gate`).

A check names a value, a comparison and a bound::

    [[checks]]
    name = "mismatch-kl"
    metric = "k3_kl"                 # a key of run.json's metrics, or a dotted path into run.json
    op = "<="
    threshold = 1e-3                 # or: baseline_factor = 1.5 (at most 1.5x the baseline's value)
    severity = "fail"                # or "warn"

or a statistic over the run's sequences (``sequence_metric``, ``statistic``, ``turns``). A ``metric``
may also name a value the gate derives from a section of run.json (:data:`SYNC_VALUES`: the
weight-sync probe's, e.g. ``metric = "sync_findings"``, ``op = "=="``, ``threshold = 0``). Every
problem is a :class:`ConfigError` naming the file's line. Whether a ``metric`` names a value a run
records is the gate's to check: it knows the metrics, this layer does not.
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mismatch_probe.config.keys import KeyLines, unknown_key
from mismatch_probe.config.validation import choices_of, first_error, is_rule, phrase, rule_error, rule_parts
from mismatch_probe.errors import ConfigError
from mismatch_probe.files import read_text

Op = Literal["<", "<=", ">", ">=", "=="]
Severity = Literal["fail", "warn"]
Statistic = Literal["mean", "p50", "p90", "p99", "max", "share_above"]
Turns = Literal["all", "first", "later"]
SequenceMetric = Literal[
    "max_mismatch",
    "mean_mismatch",
    "log_ratio",
    "abs_log_ratio",
    "geo_ratio",
    "min_token_ratio",
    "log_ppl_infer",
    "log_ppl_train",
    "log_ppl_abs_diff",
    "n_tokens",
]
OPS: tuple[str, ...] = typing.get_args(Op)
STATISTICS: tuple[str, ...] = typing.get_args(Statistic)
SEQUENCE_METRICS = {
    "max_mismatch": "largest |p_train - p_infer| of the sequence",
    "mean_mismatch": "mean |p_train - p_infer| of the sequence",
    "log_ratio": "sequence log importance ratio, sum of delta",
    "abs_log_ratio": "|sum of delta|",
    "geo_ratio": "geometric-mean token ratio, exp(mean delta)",
    "min_token_ratio": "smallest token ratio of the sequence",
    "log_ppl_infer": "log-ppl under the engine",
    "log_ppl_train": "log-ppl under the reference",
    "log_ppl_abs_diff": "|log-ppl reference - log-ppl engine|",
    "n_tokens": "model tokens in the sequence",
}
assert tuple(SEQUENCE_METRICS) == typing.get_args(SequenceMetric)
# values the gate derives from run.json's ``sync`` section (the weight-sync probe, analysis/sync.py),
# named by a check's ``metric`` like a metrics key; a run without the section fails such a check
# closed, like any missing value
SyncValue = Literal["sync_fidelity_max_abs", "sync_fidelity_k3", "sync_stale_cache_k3", "sync_findings"]
SYNC_VALUES = {
    "sync_fidelity_max_abs": "largest |Δ log p| between the synced engine's prefill and a fresh engine's, over the syncs",
    "sync_fidelity_k3": "largest K3 of the synced engine's prefill against a fresh engine's, over the syncs",
    "sync_stale_cache_k3": "decode vs prefill K3 with the prefix cache holding the old weights' entries",
    "sync_findings": "number of the weight sync's findings (not updated, rounded, permuted, stale cache, ...)",
}
assert tuple(SYNC_VALUES) == typing.get_args(SyncValue)

FiniteNumber = Annotated[float, Field(allow_inf_nan=False)]


class CheckSpec(BaseModel):
    """One ``[[checks]]`` table, as written (``metric`` not yet resolved to a run.json path)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(
        default="", description="the check's name in the gate's output (default: derived from the metric)"
    )
    metric: str | None = Field(
        default=None,
        description="a key of run.json's metrics, a dotted path, or a value derived from the sync section: "
        + ", ".join(SYNC_VALUES),
    )
    sequence_metric: SequenceMetric | None = Field(
        default=None, description="a column of sequences.parquet, bounded by a statistic over the sequences"
    )
    statistic: Statistic | None = Field(
        default=None, description="with sequence_metric: the statistic over sequences that is compared"
    )
    above: FiniteNumber | None = Field(default=None, description="the bound of statistic = share_above")
    turns: Turns = Field(default="all", description="with sequence_metric: which turn group's sequences")
    op: Op = Field(description="how the value compares with the bound for the check to pass")
    threshold: FiniteNumber | None = Field(default=None, description="a fixed bound")
    baseline_factor: FiniteNumber | None = Field(default=None, gt=0, description="a bound relative to --baseline")
    severity: Severity = Field(default="fail", description="fail: exit 1 when violated; warn: reported only")
    description: str = Field(default="", description="why the bound is what it is, shown with the result")
    source: str = Field(default="", description="where the bound comes from (a paper, a framework's default)")

    @model_validator(mode="after")
    def _consistent(self) -> CheckSpec:
        given = self.model_fields_set
        if ("metric" in given) == ("sequence_metric" in given):
            raise rule_error(
                "give exactly one of metric (a run.json value) or sequence_metric (a statistic over sequences)"
            )
        if ("threshold" in given) == ("baseline_factor" in given):
            raise rule_error(
                "give exactly one of threshold (a fixed bound) or baseline_factor (a bound relative to --baseline)"
            )
        if "metric" in given:
            for key in ("statistic", "above", "turns"):
                if key in given:
                    raise rule_error(f"{key} goes with sequence_metric, not metric", key=key)
            return self
        if self.statistic is None:
            raise rule_error(f"statistic must be one of {', '.join(STATISTICS)}, got None")
        if (self.statistic == "share_above") != ("above" in given):
            raise rule_error(
                "share_above needs above = <value>, and above only goes with share_above",
                key="above" if "above" in given else "statistic",
            )
        return self


class ThresholdsFile(BaseModel):
    """A thresholds file: ``[[checks]]`` tables and nothing else."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    checks: list[CheckSpec] = Field(min_length=1)


class Thresholds:
    """A validated thresholds file, with the lines of its checks for later messages."""

    def __init__(self, path: Path, text: str, parsed: ThresholdsFile) -> None:
        self.path = path
        self.checks = parsed.checks
        self._lines = KeyLines(text)
        headers = self._lines.headers("checks")
        self.lines = [headers[k] if k < len(headers) else 0 for k in range(len(self.checks))]

    def error(self, k: int, message: str, key: str | None = None, hint: str | None = None) -> ConfigError:
        """``<file>:<line>: check <k+1>: <message>``, the line of ``key`` in check ``k`` (else its header)."""
        line = self._lines.line(("checks", k, key) if key else ("checks", k)) or 0
        return ConfigError(f"{self.path}:{line}: check {k + 1}: {message}", hint=hint)


def load_thresholds(path: str | Path) -> Thresholds:
    """Parse and validate a thresholds file; every problem is a :class:`ConfigError` naming its line."""
    path = Path(path)
    text = read_text(path, "thresholds file")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        parsed = ThresholdsFile.model_validate(data)
    except ValidationError as exc:
        raise _error(exc, path, KeyLines(text)) from None
    return Thresholds(path, text, parsed)


def _error(exc: ValidationError, path: Path, lines: KeyLines) -> ConfigError:
    top = [e for e in exc.errors(include_url=False) if e["loc"][0] != "checks"]
    err = top[0] if top else first_error(exc)  # an unknown top-level key first: a [check] typo
    loc = tuple(err["loc"])
    if loc[0] != "checks":  # extra_forbidden: the only other key a file can have
        return ConfigError(
            f"{path}:{lines.line(loc) or 0}: unknown top-level key {loc[0]!r}",
            hint="a thresholds file holds [[checks]] tables only",
        )
    if len(loc) == 1:
        return ConfigError(f"{path}: no checks", hint="add [[checks]] tables with metric, op and threshold")
    k = int(loc[1])
    key = str(loc[2]) if len(loc) > 2 else None

    def at(key: str | None) -> str:
        return f"{path}:{lines.line(('checks', k, key) if key else ('checks', k)) or 0}: check {k + 1}"

    if is_rule(err):
        message, rule_key, hint = rule_parts(err)
        return ConfigError(f"{at(rule_key)}: {message}", hint=hint)
    if key is None:
        return ConfigError(f"{at(None)}: must be a table ([[checks]]), got {err['input']!r}")
    if err["type"] == "extra_forbidden":
        return unknown_key(key, CheckSpec.model_fields, at(key))
    if key == "sequence_metric" and err["type"] == "literal_error":
        return ConfigError(
            f"{at(key)}: unknown sequence_metric {err['input']!r}", hint=f"one of: {', '.join(SEQUENCE_METRICS)}"
        )
    what = phrase(err, choices_of(ThresholdsFile, loc), {"float_type": "must be a finite number"})
    return ConfigError(f"{at(key if err['type'] != 'missing' else None)}: {key} {what}")

"""The run record: what ``run.json`` holds, as typed pydantic models, and the one place that reads
and writes it.

Every stage after sampling takes a :class:`RunRecord`, never the JSON dict: a missing section is
``None`` (and typed so), a metric section is a mapping of metric keys to numbers with infinities
restored, and old records are brought to the current schema by :func:`migrate` when they load.
Sections that engines or the reference fill with their own settings keep any key they add
(``extra="allow"``), so a newer engine's setting survives a round trip through an older reader.

See ARCHITECTURE.md, "Run directory" and "Run record".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from mismatch_probe.errors import ConfigError
from mismatch_probe.files import write_atomic

RUN_JSON = "run.json"
SEQUENCES_PARQUET = "sequences.parquet"
# 1: the first release; 2: token shards gained logp_prefill (no record change);
# 3: sequences.parquet (the per-sequence terms of the metrics pass) named by ``sequences``;
# 4: ``spec`` records every setting (earlier, settings added after the first release only when
#    set), and ``fingerprint_schema`` says by which schema's rules the fingerprints were computed.
# The compatibility policy: ARCHITECTURE.md, "Run record".
SCHEMA_VERSION = 4

Status = Literal["running", "complete", "failed", "interrupted"]

# Values are numbers, None (NaN or no data) or, in old or hand-edited records, "inf"/"-inf" strings.
Metrics = dict[str, Any]


def restore_numbers(value: Any) -> Any:
    """run.json stores infinities as "inf" / "-inf" (strict JSON has none); they come back as floats."""
    if isinstance(value, Mapping):
        return {k: restore_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_numbers(v) for v in value]
    if value in ("inf", "-inf"):
        return float(value)
    return value


def json_safe(value: Any) -> Any:
    """NaN becomes null and infinities become strings, so run.json stays strict JSON."""
    import numpy as np

    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (np.floating, float)):
        v = float(value)
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    if isinstance(value, np.integer):
        return int(value)
    return value


class Section(BaseModel):
    """A part of the record; keys this version does not declare are kept, not dropped, and keys
    keep the order they were given in (a stored record's settings list as the engine reported them)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    _given_order: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _remember_order(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        section = handler(data)
        if isinstance(data, Mapping) and isinstance(section, Section):
            section._given_order = [str(k) for k in data]
        return section

    @model_serializer(mode="wrap")
    def _in_given_order(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Dumped keys in the order given; keys set later follow, in field order."""
        data = handler(self)
        if not self._given_order or not isinstance(data, dict):
            return data
        first = {k: data[k] for k in self._given_order if k in data}
        return first | {k: v for k, v in data.items() if k not in first}

    def to_dict(self) -> dict[str, Any]:
        """As stored: only keys that were given or set (an absent key stays absent)."""
        return self.model_dump(exclude_unset=True)


# ---- the spec as recorded (the validated spec lives in config/; this is its serialized form) ----


class RecordedEngineSpec(Section):
    name: str
    python: str | None = None
    dtype: str | None = None
    logprobs_mode: str | None = None
    tensor_parallel_size: int = 1
    extra_args: dict[str, Any] = Field(default_factory=dict)


class RecordedSampling(Section):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    n: int = 1
    seed: int = 0


class RecordedReferenceSpec(Section):
    dtype: str | None = None
    logits_fp32: bool | None = None
    attn_implementation: str | None = None
    sequence_parallel_size: int = 1
    tensor_parallel_size: int = 1
    logprobs: str = "engine"


class RecordedSpec(Section):
    model: str | None = None
    prompts: str | None = None
    out: str | None = None
    name: str | None = None
    max_turns: int = 1
    trust_remote_code: bool | None = None
    engine: RecordedEngineSpec | None = None
    sampling: RecordedSampling = Field(default_factory=RecordedSampling)
    reference: RecordedReferenceSpec = Field(default_factory=RecordedReferenceSpec)
    corrections: dict[str, float] = Field(default_factory=dict)
    variants: list[dict[str, Any]] = Field(default_factory=list)
    # [stack]: the framework config the spec mirrors, its risks and what it could not mirror
    # (config/stack_spec.py: StackSpec, as dumped)
    stack: dict[str, Any] | None = None


# ---- what the run found and built ------------------------------------------------------------


class Environment(Section):
    hardware: str | None = None
    device_name: str | None = None
    gpus: list[Any] = Field(default_factory=list)
    packages: dict[str, str | None] = Field(default_factory=dict)
    mismatch_probe: dict[str, Any] = Field(default_factory=dict)
    cpu_model: str | None = None
    # the kernel-selecting instruction sets and the CPU's kind (environment.py: cpu_features);
    # absent from runs recorded before they were
    cpu_isa: list[str] = Field(default_factory=list)
    cpu_kind: str | None = None
    aten_cpu_capability: str | None = None
    cpu_count: int | None = None
    memory_gib: float | None = None
    nvidia_driver: str | None = None
    cuda: str | None = None
    platform: str | None = None
    python: str | None = None


class Inputs(Section):
    model: str | None = None
    prompts: str | None = None
    n_prompts: int | None = None
    n_samples: int | None = None
    n_shards: int | None = None
    # an adaptive run (sampling.precision): the samples of each round, the first the prompts x n
    # (pipeline/runs.py: shard_samples); None: one round of n_prompts x n
    round_samples: list[int] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    # engine.checkpoint: what the engine loaded instead of the model, and the quantization its
    # config.json declares (modeling/loading.py: checkpoint_quantization)
    engine_checkpoint: str | None = None
    engine_checkpoint_quantization: dict[str, Any] | None = None


class RoutingLayout(Section):
    """The MoE layers as the engine recorded them (expert ids are [tokens, layers * top_k])."""

    moe_layers: list[Any]
    top_k: int
    num_experts: int | None = None


class EngineInfo(Section):
    """The engine's settings as built and read back from it (``engine.info()``)."""

    engine: str | None = None
    platform: str | None = None
    requested: dict[str, Any] = Field(default_factory=dict)
    routing: RoutingLayout | None = None
    kv_cache_sizing: dict[str, Any] | None = None
    versions: dict[str, str | None] = Field(default_factory=dict)  # None: not installed
    # settings of most engines, shown in the report's engine label
    device: str | None = None
    dtype: str | None = None
    tensor_parallel_size: int | None = None
    enforce_eager: bool | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    batch_invariant: bool | None = None
    cascade_attn: bool | None = None

    def settings(self) -> dict[str, Any]:
        """Every setting the engine reported, as stored."""
        return self.to_dict()


class ReferenceInfo(Section):
    dtype: str | None = None
    logits_fp32: bool | None = None
    attn_implementation: str | None = None
    packing: str | None = None
    device: str | None = None
    data_parallel_size: int = 1
    sequence_parallel_size: int = 1
    tensor_parallel_size: int = 1
    versions: dict[str, str | None] = Field(default_factory=dict)  # None: not installed

    def settings(self) -> dict[str, Any]:
        return self.to_dict()


class SemanticsSide(Section):
    mode: str
    distribution: str


class LogprobSemanticsRecord(Section):
    engine: SemanticsSide | None = None
    reference: SemanticsSide | None = None
    matched: bool | None = None
    prefill: SemanticsSide | None = None


class FigureRef(Section):
    id: str
    title: str
    path: str


# ---- typed readings of sections stored as plain mappings ---------------------------------------


class SectionView(BaseModel):
    """A typed reading of a section ``run.json`` keeps as a plain mapping, so that the record writes
    back exactly what it read: declared keys are typed, absent ones read as their defaults, others
    are kept, and an absent section reads as the empty view. Read-only: a change goes to the record's
    own section. Got from the record's accessors (:meth:`RunRecord.import_info`, ...)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_as_empty(cls, data: Any) -> Any:
        """A mapping or list stored as null (not measured) reads as empty, as an absent one does."""
        if not isinstance(data, Mapping):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default_factory is None}


class ImportInfo(SectionView):
    """``imported_from``: the dump a run was imported from (importing.py)."""

    format: str | None = None
    path: str | None = None
    step: int | None = None
    fingerprint: str | None = None
    samples: int | None = None  # None until the import finished
    model_tokens: int | None = None
    trainer_logprobs: bool = False
    notes: list[str] = Field(default_factory=list)
    settings_from: dict[str, str] = Field(default_factory=dict)  # setting -> flag | dump | default


class RolloutsSource(SectionView):
    """``rollouts_from``: the run whose rollouts this one scored (``--rollouts-from``, ``score --out``)."""

    run: str | None = None  # relative to this run's directory


class SyncRepeat(SectionView):
    """One sync of ``sync.repeats`` (analysis/sync.py): its fidelity against a fresh engine and what
    its weight digest found."""

    repeat: int | None = None
    fidelity: dict[str, Any] = Field(default_factory=dict)
    weights: dict[str, Any] = Field(default_factory=dict)


class StaleCache(SectionView):
    """``sync.stale_cache``: greedy answers from a prefix cache holding the old weights' entries
    against after a reset, and ``floor``, what a cache hit alone moves them (absent in runs made
    before it was measured)."""

    max_abs_dlogp: float | None = None
    k3: float | None = None
    floor: dict[str, Any] = Field(default_factory=dict)


class SyncInfo(SectionView):
    """``sync``: the weight-sync probe ([sync]; ARCHITECTURE.md, Weight sync)."""

    repeats: list[SyncRepeat] = Field(default_factory=list)
    stale_cache: StaleCache | None = None
    findings: list[Any] | None = None


METRIC_SECTIONS = ("metrics", "decode_vs_prefill", "corrections", "routing")
GROUPED_METRIC_SECTIONS = ("metrics_by_turn", "metrics_by_turn_index", "corrections_by_turn", "trainer")


class RunRecord(Section):
    """``run.json``: one probe run, from its spec to its metrics (see ARCHITECTURE.md)."""

    schema_version: int = SCHEMA_VERSION
    probe_version: str | None = None
    status: Status = "running"
    created_at: str | None = None
    completed_at: str | None = None
    error: str | None = None
    spec: RecordedSpec = Field(default_factory=RecordedSpec)
    spec_file: str | None = None
    spec_fingerprint: str | None = None
    rollout_fingerprint: str | None = None
    # the schema whose rules computed the two fingerprints (config/spec.py: ProbeSpec.fingerprint):
    # a run recorded by an earlier version is recognised by those rules when it resumes
    fingerprint_schema: int = SCHEMA_VERSION
    environment: Environment | None = None
    inputs: Inputs | None = None
    # the checkpoint's architecture and quirks (modeling/architecture.py: describe_architecture)
    architecture: dict[str, Any] | None = None
    engine: EngineInfo | None = None
    engine_process: dict[str, Any] | None = None
    reference: ReferenceInfo | None = None
    logprob_semantics: LogprobSemanticsRecord | None = None
    rollouts_from: dict[str, Any] | None = None
    # a run made by `mismatch-probe import` from a training framework's dump (importing.py)
    imported_from: dict[str, Any] | None = None
    resumed: dict[str, int] | None = None
    tokenization_check: dict[str, Any] | None = None
    # a server that renders chat messages itself (swift rollout): its prompt ids against ours
    # (rollout/multiturn.py: ServerTemplateCheck)
    server_template_check: dict[str, Any] | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    # metric sections: keys are the metric registry's (analysis/metric_docs.py)
    decode_vs_prefill: Metrics | None = None  # or {"skipped": why}
    metrics: Metrics | None = None
    metrics_by_turn: dict[str, Metrics] | None = None
    metrics_by_turn_index: dict[str, Metrics] | None = None
    corrections: dict[str, Any] | None = None
    corrections_by_turn: dict[str, dict[str, Any]] | None = None
    breakdowns: dict[str, list[dict[str, Any]]] | None = None
    breakdowns_by_turn: dict[str, dict[str, list[dict[str, Any]]]] | None = None
    # MoE routing agreement (analysis/routing_agreement.py: RoutingAccumulator), and where the reference also
    # scored with the engine's routing forced, ``replay``: the routing replay (R3) what-if, for all
    # tokens and each ``by_turn`` group (ReplayAccumulator)
    routing: dict[str, Any] | None = None
    # an imported dump's trainer log-probs against the engine's and this run's reference's
    trainer: dict[str, Metrics] | None = None
    # the weight-sync probe ([sync]): each sync of the model's weights through the engine's update
    # path against a fresh load, the stale prefix cache, the findings (analysis/sync.py); None when
    # the run did not sync
    sync: dict[str, Any] | None = None
    # each RL framework's own mismatch metrics, as it computes them: {framework: {key as it logs it: value}}
    # (analysis/peer_metrics.py)
    dashboard: dict[str, dict[str, Any]] | None = None
    # sequence-bootstrap intervals of the run's metrics (analysis/intervals.py: run_intervals)
    intervals: dict[str, Any] | None = None
    # an adaptive run (sampling.precision): K3's interval after each round of sampling, the target and
    # whether it was met (pipeline/adaptive.py: sample_in_rounds)
    precision: dict[str, Any] | None = None
    samples: dict[str, Any] | None = None
    distributions: str | None = None
    sequences: str | None = None
    figures: list[FigureRef] | None = None

    @field_validator(*METRIC_SECTIONS, *GROUPED_METRIC_SECTIONS, mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        return restore_numbers(value)

    @field_validator("breakdowns", "breakdowns_by_turn", mode="before")
    @classmethod
    def _bucket_numbers(cls, value: Any) -> Any:  # a bucket's |delta| max or K3 mean can be inf
        return restore_numbers(value)

    @field_validator("sync", "intervals", "dashboard", "precision", mode="before")
    @classmethod
    def _sync_numbers(cls, value: Any) -> Any:  # the stale cache's K3 ratio is inf when the reset one is 0
        return restore_numbers(value)

    # ---- reading -------------------------------------------------------------------------

    @property
    def is_complete(self) -> bool:
        return self.status == "complete" and bool(self.metrics)

    def metric(self, key: str, group: str | None = None) -> float | int | None:
        """A metric of all tokens, or of a turn group ("first" / "later"); None when absent."""
        section = self.metrics if group is None else (self.metrics_by_turn or {}).get(group)
        return None if section is None else section.get(key)

    def import_info(self) -> ImportInfo:
        """``imported_from``, typed (empty for a run that was not imported)."""
        return ImportInfo.model_validate(self.imported_from or {})

    def rollouts_source(self) -> RolloutsSource:
        """``rollouts_from``, typed (empty for a run that sampled its own rollouts)."""
        return RolloutsSource.model_validate(self.rollouts_from or {})

    def sync_info(self) -> SyncInfo | None:
        """``sync``, typed; None when the run did not probe the weight sync."""
        return None if self.sync is None else SyncInfo.model_validate(self.sync)

    def moe(self) -> dict[str, Any]:
        """The checkpoint's MoE layout from ``architecture`` (modeling/architecture.py); empty for a
        dense model or a run recorded without it."""
        return (self.architecture or {}).get("moe") or {}

    def correction(self, key: str) -> Any:
        """A value of ``corrections`` (a correction's share or the K3 it keeps); None when absent."""
        return (self.corrections or {}).get(key)

    def correction_thresholds(self) -> dict[str, dict[str, float]]:
        """``corrections.thresholds``: each correction's bounds as applied (``{"token_tis_clipped_share":
        {"ratio_above": 2.0}, ...}``); empty for a run analysed before they were recorded."""
        return self.correction("thresholds") or {}

    def breakdown(self, name: str) -> list[dict[str, Any]]:
        """The rows of one of ``breakdowns`` (by p_infer bucket, position, length); empty when absent."""
        return (self.breakdowns or {}).get(name) or []

    def replay(self, group: str | None = None) -> dict[str, Any]:
        """The routing replay (R3) what-if of ``routing.replay``, of all tokens or of a turn group of
        ``routing.by_turn``; empty when the run did not replay its routing."""
        routing = self.routing or {}
        if group is not None:
            routing = (routing.get("by_turn") or {}).get(group) or {}
        return routing.get("replay") or {}

    def reused_shards(self, kind: str) -> int:
        """Shards of ``kind`` (``resumed``'s keys, e.g. ``rollout_shards_reused``) that an earlier,
        interrupted invocation had written; 0 for a run that did not resume."""
        return (self.resumed or {}).get(kind, 0)

    def lookup(self, path: str) -> Any:
        """The value at a dotted path of the record as stored (None when any part is absent);
        the gate's ``metric = "metrics_by_turn.later.k3_kl"`` names values this way."""
        node: Any = self.to_dict()
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    def page_timings(self) -> dict[str, float]:
        """The timings a rendered page shows: all but ``report_s``, the time to render that very
        page, which it cannot know (so a page rendered by compare equals one re-rendered later)."""
        return {k: v for k, v in self.timings.items() if k != "report_s"}

    @property
    def prefill_skipped(self) -> str | None:
        """Why decode-vs-prefill was not measured, when the run says so."""
        d = self.decode_vs_prefill
        return d.get("skipped") if d else None

    # ---- writing -------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(json_safe(self.to_dict()), indent=2) + "\n"

    def write(self, run_dir: str | Path) -> Path:
        """Write ``run.json`` atomically (a kill leaves the previous record, never half of one)."""
        return write_atomic(Path(run_dir) / RUN_JSON, self.to_json())

    def stopped_by(self, exc: BaseException) -> None:
        """Say why the run stopped before it was complete (a Ctrl-C is ``interrupted``)."""
        self.status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        self.error = str(exc) or type(exc).__name__

    def update_sections(self, sections: Mapping[str, Any]) -> None:
        """Set several top-level sections at once (the analysis's output), validated: every field has
        a default, so a record of just these sections validates them alone."""
        fresh = type(self).model_validate(dict(sections))
        for key in sections:
            setattr(self, key, getattr(fresh, key))


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _to_3(data: dict[str, Any]) -> None:
    # 1 -> 2 changed the token shards only; 3 adds sequences.parquet, absent here (readers recompute
    # its rows from the tokens)
    data["sequences"] = None


def _to_4(data: dict[str, Any]) -> None:
    # the fingerprints were computed without the settings a schema-3 spec records only when set
    data["fingerprint_schema"] = 3


# the step that brings a record of version N to N + 1 (none for 1 -> 2, which changed no field)
MIGRATIONS = {2: _to_3, 3: _to_4}


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Bring a stored record to :data:`SCHEMA_VERSION` one version at a time (a record from a newer
    release is refused)."""
    version = data.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ConfigError(
            f"run.json has schema_version {version!r}, newer than this mismatch-probe reads ({SCHEMA_VERSION})",
            hint="upgrade mismatch-probe (pip install -U mismatch-probe)",
        )
    data = dict(data)
    for step in range(max(version, 2), SCHEMA_VERSION):
        MIGRATIONS[step](data)
    data["schema_version"] = SCHEMA_VERSION
    return data


def parse_record(data: dict[str, Any], source: str = RUN_JSON) -> RunRecord:
    """A record from its JSON form (migrated); a :class:`ConfigError` naming the bad key."""
    try:
        return RunRecord.model_validate(migrate(data))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(
            f"{source}: {where}: {err['msg']}", hint="the record was edited or written by another tool"
        ) from None


def find_record(run_dir: str | Path) -> RunRecord | None:
    """The record of a directory that may hold a run (None when it has no run.json)."""
    if not (Path(run_dir) / RUN_JSON).is_file():
        return None
    return read_record(run_dir, require_complete=False)


def read_record(run_dir: str | Path, what: str = "run", *, require_complete: bool = True) -> RunRecord:
    """A run directory's record; a :class:`ConfigError` that says what to do when the directory is
    not a run, its record is not JSON, or (``require_complete``) the run did not complete."""
    path = Path(run_dir) / RUN_JSON
    if not path.is_file():
        raise ConfigError(
            f"{what} {run_dir} is not a run directory: it has no {RUN_JSON}",
            hint="pass the directory that `mismatch-probe compare` wrote (its --out)",
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a run record (a JSON object)")
    record = parse_record(data, str(path))
    if require_complete and not record.is_complete:
        why = f": {record.error}" if record.error else ""
        raise ConfigError(
            f"{what} {run_dir} is {data.get('status', 'incomplete')}{why}; it has no metrics",
            hint="finish it by running the same compare command again (it resumes)",
        )
    return record

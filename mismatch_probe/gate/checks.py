"""The CI gate: the checks of a thresholds file (format and validation: :mod:`mismatch_probe.config.thresholds`)
evaluated against a run's record and, for sequence statistics, its sequences.parquet.

Statuses: PASS; WARN (a warn-severity check out of bounds); FAIL (a fail-severity check out of
bounds, or any value that is missing, NaN or infinite: the gate fails closed); ERROR (the check
could not be evaluated as configured, e.g. a baseline check without a baseline). Evaluation only:
:mod:`mismatch_probe.gate.junit` renders the results.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mismatch_probe.config.keys import closest
from mismatch_probe.config.thresholds import OPS as CHECK_OPS
from mismatch_probe.config.thresholds import SYNC_VALUES, load_thresholds
from mismatch_probe.numbers import significant
from mismatch_probe.record import RunRecord, SyncInfo, read_record

OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq}
assert tuple(OPS) == CHECK_OPS
STATUS_ORDER = ("PASS", "WARN", "FAIL", "ERROR")


def metric_paths() -> set[str]:
    """Every dotted path into run.json that a check may name (a typo is an error, not a FAIL)."""
    from mismatch_probe.analysis.metrics import CORRECTION_KEYS, KEPT_K3, MetricsAccumulator
    from mismatch_probe.analysis.peer_metrics import PEER_METRICS

    keys = set(MetricsAccumulator().metrics())
    paths = {f"metrics.{k}" for k in keys}
    paths |= {f"metrics_by_turn.{g}.{k}" for g in ("first", "later") for k in keys}
    paths |= {f"decode_vs_prefill.{k}" for k in keys | {"n_unscored_tokens"}}
    corrections = {*CORRECTION_KEYS, *KEPT_K3.values()}
    paths |= {f"corrections.{k}" for k in corrections}
    paths |= {f"corrections_by_turn.{g}.{k}" for g in ("first", "later") for k in corrections}
    paths |= {"routing.tokens_with_flip_share", "tokenization_check.n_differing"}
    paths |= {"server_template_check.share_differing", "server_template_check.n_differing"}
    # the routing replay (R3) what-if (analysis/routing_replay.py: ReplayAccumulator)
    paths |= {f"routing.replay.{k}" for k in ("k3_free", "k3_replayed", "gap_closed_share")}
    # each framework's own metrics, under the names its dashboard gives them (analysis/peer_metrics.py)
    paths |= {f"dashboard.{m.framework}.{m.key}" for m in PEER_METRICS}
    return paths


_TURN_INDEX = re.compile(r"^metrics_by_turn_index\.\d+\.(?P<key>\w+)$")


def resolve_metric(name: str) -> str:
    """A check's ``metric`` as a full path: a bare key means ``metrics.<key>``; a value the gate
    derives from a section (:data:`SYNC_VALUES`) keeps its name."""
    return name if "." in name or name in SYNC_VALUES else f"metrics.{name}"


# sync_fidelity_*: the key of each sync's fidelity (analysis/sync.py: logprob_fidelity) maximized over the syncs
SYNC_FIDELITY = {"sync_fidelity_max_abs": "max_abs_dlogp", "sync_fidelity_k3": "k3"}


def sync_value(name: str, sync: SyncInfo | None) -> tuple[float | None, str]:
    """A value of :data:`SYNC_VALUES` from run.json's ``sync`` section (:meth:`RunRecord.sync_info`),
    or None and why it is missing (the check then fails closed). A NaN in any sync is the value (it
    fails closed too)."""
    if sync is None:
        return None, "the run has no sync section (it did not probe the weight sync)"
    if name == "sync_findings":
        if sync.findings is None:
            return None, "its sync section lists no findings"
        return float(len(sync.findings)), ""
    if name == "sync_stale_cache_k3":
        if sync.stale_cache is None:
            return None, "the run did not measure a stale prefix cache (sync.stale_cache is null)"
        value = _number(sync.stale_cache.k3)
        return value, "" if value is not None else "sync.stale_cache has no k3"
    key = SYNC_FIDELITY[name]
    if not sync.repeats:
        return None, "its sync section has no syncs (repeats)"
    values = []
    for k, r in enumerate(sync.repeats):
        value = _number(r.fidelity.get(key))
        if value is None:
            repeat = r.repeat if r.repeat is not None else k + 1
            return None, f"sync {repeat} has no fidelity.{key} (its log-probs were not compared)"
        values.append(value)
    return next((v for v in values if math.isnan(v)), max(values)), ""


@dataclass
class Check:
    name: str
    op: str
    severity: str = "fail"
    metric: str | None = None  # full dotted path into run.json
    sequence_metric: str | None = None
    statistic: str | None = None
    above: float | None = None
    turns: str = "all"
    threshold: float | None = None
    baseline_factor: float | None = None
    description: str = ""
    source: str = ""
    line: int = 0  # of its [[checks]] header, for messages

    def describe_value(self) -> str:
        if self.metric:
            return self.metric.removeprefix("metrics.")
        stat = f"share above {self.above:g}" if self.statistic == "share_above" else self.statistic
        return f"{stat} of {self.sequence_metric} over {'samples' if self.turns == 'all' else self.turns + '-turn sequences'}"

    def describe_bound(self, baseline_value=None) -> str:
        if self.baseline_factor is not None:
            base = "baseline" if baseline_value is None else f"baseline {significant(baseline_value)}"
            return f"{self.op} {self.baseline_factor:g} x {base}"
        return f"{self.op} {self.threshold:g}"

    def result(
        self,
        status: str,
        message: str,
        value: float | None = None,
        bound: str | None = None,
        *,
        threshold: float | None = None,
        baseline_value: float | None = None,
        name: str | None = None,
    ) -> CheckResult:
        """This check's result (``name``: a timeline's ``check @ step N``; ``bound``: the check's own
        wording unless given)."""
        return CheckResult(
            name=self.name if name is None else name,
            status=status,
            value=value,
            bound=self.describe_bound() if bound is None else bound,
            message=message,
            severity=self.severity,
            metric=self.describe_value(),
            description=self.description,
            source=self.source,
            threshold=threshold,
            baseline_value=baseline_value,
        )

    def no_baseline(self, message: str, value: float | None, baseline_value: float | None = None) -> CheckResult:
        """A growth or baseline check with no finite baseline value: it fails closed."""
        return self.result("FAIL", message, value, self.describe_bound(baseline_value), baseline_value=baseline_value)


@dataclass
class GateSpec:
    path: Path
    checks: list[Check] = field(default_factory=list)

    @property
    def needs_baseline(self) -> bool:
        return any(c.baseline_factor is not None for c in self.checks)


def load_gate(path: str | Path) -> GateSpec:
    """Read a thresholds file (validated by :mod:`mismatch_probe.config.thresholds`) and check that
    each ``metric`` names a value a run records; every problem is a :class:`ConfigError` naming its line."""
    thresholds = load_thresholds(path)
    known = metric_paths()
    gate = GateSpec(thresholds.path)
    names: set[str] = set()
    for k, item in enumerate(thresholds.checks):
        check = Check(
            name=item.name,
            op=item.op,
            severity=item.severity,
            threshold=item.threshold,
            baseline_factor=item.baseline_factor,
            description=item.description,
            source=item.source,
            line=thresholds.lines[k],
        )
        if item.metric is not None:
            path_ = resolve_metric(item.metric)
            m = _TURN_INDEX.match(path_)
            if path_ not in known | set(SYNC_VALUES) and not (m and f"metrics.{m.group('key')}" in known):
                close = (
                    closest(item.metric, SYNC_VALUES, cutoff=0.75)
                    if item.metric.startswith("sync")
                    else closest(path_, known, cutoff=0.75)
                )
                raise thresholds.error(
                    k,
                    f"unknown metric {item.metric!r}",
                    "metric",
                    hint=f"did you mean {close.removeprefix('metrics.')!r}?"
                    if close
                    else "use a key of run.json's metrics, or a dotted path such as metrics_by_turn.later.k3_kl",
                )
            check.metric = path_
        else:
            check.sequence_metric, check.statistic, check.above, check.turns = (
                item.sequence_metric,
                item.statistic,
                item.above,
                item.turns,
            )
        if not check.name:
            check.name = check.describe_value()
        if check.name in names:
            raise thresholds.error(
                k, f"duplicate check name {check.name!r}", "name", hint="give each check its own name"
            )
        names.add(check.name)
        gate.checks.append(check)
    return gate


# ---- evaluation -----------------------------------------------------------------------------


@dataclass
class CheckResult:
    name: str
    status: str
    value: float | None
    bound: str
    message: str
    severity: str
    metric: str
    description: str = ""
    source: str = ""
    threshold: float | None = None  # the effective bound (baseline_factor x baseline value for those)
    baseline_value: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GateResult:
    run: str
    thresholds: str
    baseline: str | None
    results: list[CheckResult]

    @property
    def status(self) -> str:
        return max((r.status for r in self.results), key=STATUS_ORDER.index, default="PASS")

    @property
    def exit_code(self) -> int:
        """0: all pass (warnings allowed); 1: a check failed; 2: a check could not be evaluated as
        configured (an error in the setup, like a usage error)."""
        statuses = {r.status for r in self.results}
        return 2 if "ERROR" in statuses else 1 if "FAIL" in statuses else 0

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUS_ORDER}

    def to_dict(self) -> dict:
        from mismatch_probe.record import json_safe

        return json_safe(
            {
                "status": self.status,
                "exit_code": self.exit_code,
                "counts": self.counts(),
                "run": self.run,
                "thresholds": self.thresholds,
                "baseline": self.baseline,
                "checks": [r.to_dict() for r in self.results],
            }
        )


def _number(value) -> float | None:
    """A record value (infinities already restored by the record) as a float, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def sequence_statistic(values, statistic: str, above: float | None) -> float | None:
    import numpy as np

    from mismatch_probe.analysis.terms import quantiles

    values = np.asarray(values, dtype=np.float64)
    if not len(values):
        return None
    if statistic == "mean":
        return float(values.mean())
    if statistic == "max":
        return float(values.max())
    if statistic == "share_above":
        return float((values > above).mean())
    return quantiles(values, {statistic: float(statistic[1:]) / 100})[statistic]


def sequence_values(run_dir: str | Path) -> dict[str, dict]:
    """Per-sequence values of a run, per turn group: its sequences.parquet, or for runs older than
    that file, the same rows computed from its per-token table."""
    from mismatch_probe.analysis.analyze import sequences_from_tokens
    from mismatch_probe.analysis.sequences import sequence_values as values_of
    from mismatch_probe.table.tokens import read_sequences

    table = read_sequences(run_dir)
    return values_of(table if table is not None else sequences_from_tokens(run_dir))


def _value(check: Check, record: RunRecord, run_dir: Path | None, cache: dict):
    """(value, None) or (None, error message) for a check on one run."""
    if check.metric in SYNC_VALUES:
        return sync_value(check.metric, record.sync_info())[0], None
    if check.metric:
        return _number(record.lookup(check.metric)), None
    if check.sequence_metric is None or check.statistic is None:  # CheckSpec validation gives both
        return None, "a check needs a metric, or a sequence_metric and its statistic"
    if run_dir is None:
        return None, "a sequence statistic needs the run directory"
    key = str(run_dir)
    if key not in cache:
        try:
            cache[key] = sequence_values(run_dir)
        except (FileNotFoundError, OSError) as exc:
            cache[key] = exc
    seqs = cache[key]
    if isinstance(seqs, Exception):
        return None, f"cannot compute sequence statistics: {seqs}"
    return sequence_statistic(seqs[check.turns][check.sequence_metric], check.statistic, check.above), None


def judge(
    check: Check,
    value: float | None,
    bound: float | None,
    *,
    baseline_value: float | None = None,
    shown_bound: str | None = None,
    name: str | None = None,
    why: str = "",
) -> CheckResult:
    """The gate's one judgement of a check's value against its bound, for a run and for each step of
    a timeline: PASS when the bound holds, else WARN or FAIL by severity; FAIL for a missing, NaN or
    infinite value (the gate fails closed; ``why`` says why it is missing, where the gate can say).
    ``shown_bound`` is how the result states the bound (default: the check's own wording)."""
    shown = check.describe_bound(baseline_value) if shown_bound is None else shown_bound
    if value is None or not math.isfinite(value):
        message = f"value is {significant(value)}" + (f" ({why})" if why else "") + ": the gate fails closed"
        return check.result("FAIL", message, value, shown, threshold=bound, baseline_value=baseline_value, name=name)
    if bound is None:  # CheckSpec validation gives a threshold or a baseline_factor
        return check.result("ERROR", "the check has no bound", value, "", name=name)
    ok = OPS[check.op](value, bound)
    status = "PASS" if ok else ("WARN" if check.severity == "warn" else "FAIL")
    relation = check.op if ok else f"is not {check.op}"
    message = f"{significant(value)} {relation} {significant(bound)}"
    return check.result(status, message, value, shown, threshold=bound, baseline_value=baseline_value, name=name)


def _missing(check: Check, record: RunRecord) -> str:
    """Why a check's value is missing from the run, where the gate can say (else "")."""
    if check.metric in SYNC_VALUES:
        return sync_value(check.metric, record.sync_info())[1]
    return ""


def evaluate(
    gate: GateSpec,
    record: RunRecord,
    run_dir: str | Path | None = None,
    baseline: RunRecord | None = None,
    baseline_dir: str | Path | None = None,
) -> GateResult:
    """Every check of ``gate`` on one run (``record`` is its run record; ``run_dir`` is needed for
    sequence statistics), relative checks against ``baseline``."""
    cache: dict = {}
    results = []
    run_dir = Path(run_dir) if run_dir is not None else None
    baseline_dir = Path(baseline_dir) if baseline_dir is not None else None
    for c in gate.checks:
        value, problem = _value(c, record, run_dir, cache)
        if problem:
            results.append(c.result("ERROR", problem))
            continue
        bound, baseline_value = c.threshold, None
        if c.baseline_factor is not None:
            if baseline is None:
                results.append(c.result("ERROR", "a baseline-relative check, but no --baseline run was given", value))
                continue
            baseline_value, problem = _value(c, baseline, baseline_dir, cache)
            if problem:
                results.append(c.result("ERROR", f"baseline: {problem}", value))
                continue
            if baseline_value is None or not math.isfinite(baseline_value):
                results.append(
                    c.no_baseline(
                        f"the baseline's value is {significant(baseline_value)}; nothing to compare against, so the "
                        "check fails closed",
                        value,
                        baseline_value,
                    )
                )
                continue
            bound = c.baseline_factor * baseline_value
        why = _missing(c, record) if value is None else ""
        results.append(judge(c, value, bound, baseline_value=baseline_value, why=why))
    return GateResult(
        str(run_dir) if run_dir else "", str(gate.path), str(baseline_dir) if baseline_dir else None, results
    )


def run_gate(
    run_dir: str | Path, thresholds: str | Path, baseline_dir: str | Path | None = None, gate: GateSpec | None = None
) -> GateResult:
    gate = gate or load_gate(thresholds)
    record = read_record(run_dir)
    baseline = read_record(baseline_dir, "baseline") if baseline_dir is not None else None
    return evaluate(gate, record, run_dir, baseline, baseline_dir)

"""sweep.json from the points' run directories: read each run, hand its numbers to
:mod:`analysis.sweep` (effects, noise floor, cost, recommendation), collect the answers.

Everything here is recomputed from what is on disk (run.json, sequences.parquet, determinism.json)
with fixed bootstrap seeds, so a sweep resumed after a kill writes the same sweep.json as one that
ran straight through.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch_probe.analysis.intervals import BOOTSTRAP_METRICS, available, bootstrap_intervals
from mismatch_probe.analysis.sequences import group_columns
from mismatch_probe.analysis.sweep import (
    HEADLINE_METRICS,
    attribution,
    cost,
    effects,
    noise_floor,
    recommend,
    throughput,
)
from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.config.sweep import SweepPlan, SweepPoint, engine_key
from mismatch_probe.files import portable_path, relative_to_dir
from mismatch_probe.gate.checks import GateSpec
from mismatch_probe.pipeline import same_spec
from mismatch_probe.record import SEQUENCES_PARQUET, RunRecord, find_record
from mismatch_probe.sweep_record import SweepPointRecord, SweepRecord
from mismatch_probe.table.tokens import read_parquet
from mismatch_probe.version import __version__

BOOTSTRAP_SEED = 0  # fixed: the same runs give the same intervals


def complete_record(point: SweepPoint) -> RunRecord | None:
    if point.spec is None:
        return None
    rec = find_record(point.run_dir)
    if rec is None or not rec.is_complete or not same_spec(rec, point.spec):
        return None
    return rec


def _columns(run_dir: Path) -> dict:
    return group_columns(read_parquet(run_dir / SEQUENCES_PARQUET), "all")


def _share_done(record: RunRecord, key: str) -> float:
    """The share of a run's shards its last invocation produced (its timings cover only those)."""
    total = (record.inputs.n_shards if record.inputs is not None else None) or 1
    reused = record.reused_shards(key)
    return max(total - reused, 0) / total


def run_throughput(record: RunRecord, sampled_by: RunRecord) -> dict[str, float | None]:
    """Engine generation and reference scoring speed of a run, in response tokens a second.

    A run that re-scored another's tokens has that run's engine speed. A resumed run's timings
    cover its last invocation only, so the tokens are scaled by the share of shards it produced."""
    n = record.metric("n_model_tokens")
    n_sampled = sampled_by.metric("n_model_tokens")
    engine_share = _share_done(sampled_by, "rollout_shards_reused")
    reference_share = _share_done(record, "token_shards_reused")
    return {
        "engine_tokens_per_s": throughput(
            int(n_sampled * engine_share) if n_sampled else None, sampled_by.timings.get("generation_s")
        ),
        "reference_tokens_per_s": throughput(int(n * reference_share) if n else None, record.timings.get("scoring_s")),
    }


def gate_bounds(gate) -> dict[str, float]:
    """The fixed upper bounds a gate puts on plain metrics (the cost plot draws K3's)."""
    return {
        check.metric.removeprefix("metrics."): float(check.threshold)
        for check in gate.checks
        if check.metric and check.op in ("<=", "<") and check.threshold is not None and check.baseline_factor is None
    }


def changed_sides(point: SweepPoint, baseline: SweepPoint) -> set[str]:
    """Which sides a point runs differently from the baseline: "engine" (engine or sampling
    settings: another engine, or other requests to it), "reference" ([reference] settings)."""
    assert point.spec is not None and baseline.spec is not None
    sides = set()
    if engine_key(point.spec) != engine_key(baseline.spec) or point.spec.sampling != baseline.spec.sampling:
        sides.add("engine")
    if point.spec.reference != baseline.spec.reference:
        sides.add("reference")
    return sides


@dataclass
class SweepRun:
    """What the summary reads of a sweep that ran (``sweeps.runner``): its spec, plan and directory,
    what it keeps in sweep-state.json (refusals, throughputs measured), which point each re-scoring
    point took its tokens from, which points failed and why, its gate, and its engine starts."""

    spec: ProbeSpec
    plan: SweepPlan
    out: Path
    state: dict[str, Any]
    source: dict[str, SweepPoint]
    failures: dict[str, str]
    gate: GateSpec | None
    gate_file: Path | None
    engine_starts: int


def summarize(sweep: SweepRun) -> SweepRecord:
    plan, out = sweep.plan, sweep.out
    settings = plan.sweep
    keys = list(BOOTSTRAP_METRICS)
    records = {p.name: complete_record(p) for p in plan.runs}
    columns = {p.name: _columns(p.run_dir) for p in plan.runs if records[p.name] is not None}

    baseline = plan.baseline
    repeats_ok = [p for p in plan.repeats if records[p.name] is not None]
    base_cols = columns.get(baseline.name)
    repeat_cols = [columns[p.name] for p in repeats_ok]
    base_record = records[baseline.name]

    def sampled_by(p: SweepPoint) -> RunRecord | None:
        source = sweep.source.get(p.name)
        return records[source.name] if source is not None else records[p.name]

    measured: dict[str, dict] = sweep.state.setdefault("throughput", {})

    def speed(p: SweepPoint) -> dict[str, float | None]:
        """Measured when the run sampled and scored in one invocation; a run resumed later has lost
        its earlier timings, so the figure measured then (kept in sweep-state.json) stands."""
        rec, sampler = records[p.name], sampled_by(p)
        assert rec is not None and sampler is not None
        now = run_throughput(rec, sampler)
        kept = measured.get(p.name, {})
        found = {k: v if v is not None else kept.get(k) for k, v in now.items()}
        measured[p.name] = found
        return found

    baseline_speeds = [speed(p) for p in [baseline, *repeats_ok] if records[p.name] is not None]

    point_records: list[SweepPointRecord] = []
    for p in [baseline, *plan.points]:
        rec = records.get(p.name)
        entry: dict[str, Any] = {
            "name": p.name,
            "settings": p.settings,
            "levels": p.levels,
            "run": relative_to_dir(p.run_dir, out),
            "engine_config": engine_key(p.spec) if p.spec is not None else None,
            "rollouts_from": sweep.source[p.name].name if p.name in sweep.source else None,
        }
        if p.name in sweep.state["refused"]:
            entry["run"] = None  # nothing ran: no directory
            point_records.append(SweepPointRecord(**entry, status="refused", reason=sweep.state["refused"][p.name]))
            continue
        if rec is None or p.spec is None:
            reason = sweep.failures.get(p.name, "the run did not complete")
            point_records.append(SweepPointRecord(**entry, status="failed", reason=reason))
            continue
        cols = columns[p.name]
        found = bootstrap_intervals(
            cols, available(cols, keys), n_boot=settings.n_boot, level=settings.level, seed=BOOTSTRAP_SEED
        )
        entry["intervals"] = {k: [i.estimate, i.low, i.high] for k, i in found.items() if i is not None}
        entry["metrics"] = {
            k: v for k, v in (rec.metrics or {}).items() if isinstance(v, int | float | str) or v is None
        }
        entry["corrections"] = rec.corrections or {}
        source = sweep.source.get(p.name)
        if not p.is_baseline and base_cols is not None:
            entry["delta_vs_baseline"] = effects(
                base_cols,
                cols,
                paired=source is not None and source.is_baseline,
                repeats=repeat_cols,
                n_boot=settings.n_boot,
                level=settings.level,
                seed=BOOTSTRAP_SEED,
            )
        if sampled_by(p) is not None:
            entry["cost"] = cost(speed(p), baseline_speeds, changed_sides(p, baseline))
        if sweep.gate is not None:
            from mismatch_probe.gate.checks import evaluate

            # baseline_factor checks compare each point with the sweep's own baseline
            against = (base_record, baseline.run_dir) if sweep.gate.needs_baseline else (None, None)
            entry["gate"] = evaluate(sweep.gate, rec, p.run_dir, *against).status
        point_records.append(SweepPointRecord(**entry, status="ok"))

    repeat_metrics = [rec.metrics or {} for p in [baseline, *repeats_ok] if (rec := records[p.name]) is not None]
    floor = noise_floor(repeat_metrics, keys) if repeat_metrics else {}
    floor_speeds = noise_floor(baseline_speeds, ["engine_tokens_per_s", "reference_tokens_per_s"])
    determinism_path = out / "determinism.json"
    gate_file = portable_path(sweep.gate_file) if sweep.gate_file is not None else None
    dumped = [p.model_dump() for p in point_records]
    recommendation: dict[str, Any]
    if sweep.gate is not None and base_record is not None:
        candidates = [{**p, "cost": p["cost"].get("cost")} for p in dumped]  # SweepPointRecord.cost: a mapping
        recommendation = recommend(candidates) | {"gate": gate_file}
        if recommendation.get("point"):
            chosen = next(p for p in dumped if p["name"] == recommendation["point"])
            recommendation["evidence"] = {
                "metrics": {k: chosen["metrics"].get(k) for k in HEADLINE_METRICS},
                "delta_vs_baseline": {k: chosen["delta_vs_baseline"].get(k) for k in HEADLINE_METRICS},
                "cost": chosen.get("cost"),
            }
    else:
        recommendation = {"gate": None, "why": "no --gate given: pass a thresholds file to name a change"}
    return SweepRecord(
        probe_version=__version__,
        status="complete",
        spec_fingerprint=plan.fingerprint(),
        spec=sweep.spec.to_dict(),
        mode=settings.mode,
        repeats=settings.repeats,
        level=settings.level,
        points=point_records,
        noise_floor={
            "runs": [baseline.name, *(p.name for p in repeats_ok)],
            "metrics": floor,
            "throughput": floor_speeds,
        },
        determinism=json.loads(determinism_path.read_text()) if determinism_path.is_file() else None,
        recommendation=recommendation,
        attribution={m: attribution(dumped[1:], m) for m in HEADLINE_METRICS},
        # of every point with valid settings, whether its engine started or refused (on any run)
        engine_configs=len({engine_key(p.spec) for p in plan.runs if p.spec is not None}),
        engine_starts=sweep.engine_starts,
        gate={"thresholds": gate_file, "bounds": gate_bounds(sweep.gate)} if sweep.gate is not None else None,
    )

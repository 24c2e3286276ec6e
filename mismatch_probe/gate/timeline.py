"""The gate over a timeline: every check on every step, and growth against the run's own early steps.

A thresholds file's ``metric`` checks apply per step, to the step's row in ``steps.parquet``
(``metrics.k3_kl`` -> the ``all`` row's ``k3_kl``; ``metrics_by_turn.later.k3_kl`` -> the ``later``
row's; ``corrections.*``; ``routing.tokens_with_flip_share``). A ``baseline_factor`` check is a growth
threshold: its bound is the factor times the metric's median over the timeline's baseline window
(the first ``baseline_steps`` steps), so ``baseline_factor = 3`` reads "K3 at most 3x its
first-20-steps median". One result per check and step (one JUnit testcase each). Sequence
statistics need a step's sequences: gate a kept step's run directory for those.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_probe.analysis.timeline import DASHBOARD_COLUMNS, VALUE_COLUMNS
from mismatch_probe.config.thresholds import SYNC_VALUES
from mismatch_probe.gate.checks import CheckResult, GateResult, GateSpec, judge, load_gate
from mismatch_probe.numbers import significant
from mismatch_probe.timeline_record import STEPS_PARQUET, read_timeline

# run.json paths whose value a step row holds under another name
RENAMED = {"routing.tokens_with_flip_share": "routing_flip_share"}


def step_column(metric: str) -> tuple[str, str] | None:
    """(group, column) of steps.parquet holding a check's run.json path, or None."""
    if metric in RENAMED:
        return "all", RENAMED[metric]
    if metric in DASHBOARD_COLUMNS:  # a framework's own metric, as run.json's dashboard names it
        return "all", metric
    section, _, rest = metric.partition(".")
    if section in ("metrics", "corrections") and rest in VALUE_COLUMNS:
        return "all", rest
    if section in ("metrics_by_turn", "corrections_by_turn"):
        group, _, key = rest.partition(".")
        if group in ("first", "later") and key in VALUE_COLUMNS:
            return group, key
    return None


def run_timeline_gate(timeline_dir: str | Path, thresholds: str | Path, gate: GateSpec | None = None) -> GateResult:
    """Every check of the thresholds file on every step of the timeline in ``timeline_dir``."""
    import pyarrow.parquet as pq

    directory = Path(timeline_dir)
    record = read_timeline(directory)
    gate = gate or load_gate(thresholds)
    table = pq.read_table(directory / STEPS_PARQUET)
    window = int(record.options.get("baseline_steps") or 20)
    results: list[CheckResult] = []
    for c in gate.checks:
        where = step_column(c.metric) if c.metric and c.metric not in SYNC_VALUES else None
        if where is None:
            why = (
                "a timeline holds per-step values; sequence statistics need a step's sequences "
                "(gate a kept step's run directory, runs/step-N)"
                if c.sequence_metric
                else f"{c.describe_value()} is not a per-step value of a timeline"
            )
            results.append(c.result("ERROR", why))
            continue
        group, column = where
        rows = table.filter(pc.equal(table.column("group"), group))
        steps = rows.column("step").to_numpy()
        values = _floats(rows.column(column))
        bound, baseline_value = c.threshold, None
        if c.baseline_factor is not None:
            every = np.unique(table.column("step").to_numpy())
            early = values[steps <= every[min(window, len(every)) - 1]] if len(every) else values[:0]
            early = early[np.isfinite(early)]
            baseline_value = float(np.median(early)) if len(early) else None
            if baseline_value is None:
                results.append(
                    c.no_baseline(
                        f"no finite value of {column} in the first {window} steps: nothing to grow from, "
                        "so the check fails closed",
                        None,
                    )
                )
                continue
            bound = c.baseline_factor * baseline_value
        shown = (
            f"{c.op} {c.baseline_factor:g} x median of the first {window} steps ({significant(baseline_value)})"
            if c.baseline_factor is not None
            else c.describe_bound()
        )
        results += [
            judge(c, value, bound, baseline_value=baseline_value, shown_bound=shown, name=f"{c.name} @ step {step}")
            for step, value in zip(steps.tolist(), values.tolist())
        ]
    return GateResult(str(directory), str(gate.path), None, results)


def _floats(column: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)

"""From the per-token table on disk to the metric sections of run.json.

Streams the table shard by shard (each shard holds whole sequences) into three accumulators:
all model tokens (sequences = samples), first assistant turn (turn 0) and later turns (turn >= 1,
sequences = sample-turns). Needs neither a GPU nor an engine, so ``report`` and ``gate`` can run
it on a copied run directory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .metrics import CorrectionThresholds, MetricsAccumulator, segment_starts
from .table import iter_model_tokens

TURN_GROUPS = {"first": lambda turn: turn == 0, "later": lambda turn: turn >= 1}


def analyze(run_dir: str | Path, thresholds: CorrectionThresholds | None = None) -> dict:
    """``metrics``, ``metrics_by_turn``, ``corrections`` and ``breakdowns`` for a run directory."""
    thresholds = thresholds or CorrectionThresholds()
    overall = MetricsAccumulator(thresholds)
    by_turn = {name: MetricsAccumulator(thresholds) for name in TURN_GROUPS}
    for shard in iter_model_tokens(Path(run_dir)):
        sample, turn = shard["sample_id"], shard["turn"]
        lt, li, pos = shard["logp_train"], shard["logp_infer"], shard["position"]
        overall.add(lt, li, segment_starts(sample), pos)
        for name, select in TURN_GROUPS.items():
            keep = select(turn)
            if keep.any():
                by_turn[name].add(lt[keep], li[keep], segment_starts(sample[keep], turn[keep]), pos[keep])
    return {
        "metrics": overall.metrics(),
        "metrics_by_turn": {name: acc.metrics() for name, acc in by_turn.items()},
        "corrections": overall.corrections(),
        "corrections_by_turn": {name: acc.corrections() for name, acc in by_turn.items()},
        "breakdowns": overall.breakdowns(),
        "breakdowns_by_turn": {name: acc.breakdowns() for name, acc in by_turn.items()},
    }


def json_safe(value):
    """NaN becomes null and infinities become strings, so run.json stays strict JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (np.floating, float)):
        v = float(value)
        if np.isnan(v):
            return None
        if np.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    if isinstance(value, np.integer):
        return int(value)
    return value

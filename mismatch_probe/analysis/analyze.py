"""From the per-token table on disk to the metric sections of run.json.

Streams the table shard by shard (each shard holds whole sequences) into three accumulators:
all model tokens (sequences = samples), first assistant turn (turn 0) and later turns (turn >= 1,
sequences = sample-turns). Needs neither a GPU nor an engine, so ``report`` and ``gate`` can run
it on a copied run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe.analysis.distributions import DistributionAccumulator
from mismatch_probe.analysis.metrics import (
    CorrectionThresholds,
    MetricsAccumulator,
    RoutingAccumulator,
    RoutingComparison,
    compare_routing,
    segment_starts,
)
from mismatch_probe.analysis.sequences import TURN_GROUPS, SequenceCollector
from mismatch_probe.table.tokens import iter_model_tokens


def analyze(
    run_dir: str | Path,
    thresholds: CorrectionThresholds | None = None,
    routing: dict | None = None,
    distributions: DistributionAccumulator | None = None,
    sequences: SequenceCollector | None = None,
) -> dict:
    """``metrics``, ``metrics_by_turn`` (first / later), ``metrics_by_turn_index``, ``corrections``, ``breakdowns``, ``routing`` for MoE runs whose
    table has expert ids (``routing`` describes the layers, as the engine recorded them), and
    ``decode_vs_prefill``: the same metrics with the engine's prefill log-probs in the reference's
    place (``delta = logp_prefill - logp_infer``), where the table has them; and ``trainer`` for a
    re-scored imported dump that carried its trainer's log-probs: ``engine_vs_trainer`` (what the
    run itself saw, ``delta = logp_trainer - logp_infer``) and ``trainer_vs_reference`` (how far its
    trainer is from this reference, ``delta = logp_train - logp_trainer``). ``distributions``, when
    given, is fed in the same pass and finished at the end (its ``result`` is what the report draws);
    so is ``sequences`` (its ``table`` holds every sequence's terms, sequences.parquet)."""
    thresholds = thresholds or CorrectionThresholds()
    overall = MetricsAccumulator(thresholds)
    by_turn = {name: MetricsAccumulator(thresholds) for name in TURN_GROUPS}
    router_acc: dict[str, RoutingAccumulator] = {}
    # decode vs prefill: the engine's sampled log-prob against its own full-sequence prefill
    prefill = MetricsAccumulator(thresholds)
    n_unscored = 0
    trainer = {
        "engine_vs_trainer": MetricsAccumulator(thresholds),
        "trainer_vs_reference": MetricsAccumulator(thresholds),
    }
    by_index: dict[int, MetricsAccumulator] = {}
    for shard in iter_model_tokens(Path(run_dir)):
        sample, turn = shard["sample_id"], shard["turn"]
        lt, li, pos = shard["logp_train"], shard["logp_infer"], shard["position"]
        ei, et = shard["experts_infer"], shard["experts_train"]
        starts = segment_starts(sample)
        overall.add(lt, li, starts, pos)
        if sequences is not None:
            sequences.ids["all"].add(sample, None, starts)
        if distributions is not None:
            distributions.add(lt, li, sample, turn)
        lp = shard["logp_prefill"]
        if lp is not None:
            scored = ~np.isnan(lp)
            n_unscored += int((~scored).sum())
            if scored.any():
                prefill.add(lp[scored], li[scored], segment_starts(sample[scored]), pos[scored])
        if (ltr := shard["logp_trainer"]) is not None and (known := ~np.isnan(ltr)).any():
            starts_known = segment_starts(sample[known])
            trainer["engine_vs_trainer"].add(ltr[known], li[known], starts_known, pos[known])
            trainer["trainer_vs_reference"].add(lt[known], ltr[known], starts_known, pos[known])
        for t in np.unique(turn):  # per assistant-turn index (0 = first); sequences are sample-turns
            keep = turn == t
            acc = by_index.setdefault(int(t), MetricsAccumulator(thresholds))
            acc.add(lt[keep], li[keep], segment_starts(sample[keep]), pos[keep])
        groups = {"all": np.ones(len(lt), dtype=bool)}
        for name, select in TURN_GROUPS.items():
            keep = select(turn)
            groups[name] = keep
            if keep.any():
                starts = segment_starts(sample[keep], turn[keep])
                by_turn[name].add(lt[keep], li[keep], starts, pos[keep])
                if sequences is not None:
                    sequences.ids[name].add(sample[keep], turn[keep], starts)
        if ei is not None and et is not None and routing:
            n_layers, top_k = len(routing["moe_layers"]), routing["top_k"]
            cmp = compare_routing(ei, et, n_layers, top_k)  # once per shard, shared by the groups
            for name, keep in groups.items():
                router = router_acc.setdefault(name, RoutingAccumulator(n_layers, top_k))
                router.add(RoutingComparison(cmp.same[keep], cmp.shared[keep]), lt[keep], li[keep])
    out: dict[str, Any] = {
        "metrics": overall.metrics(),
        "metrics_by_turn": {name: acc.metrics() for name, acc in by_turn.items()},
        "metrics_by_turn_index": {str(t): by_index[t].metrics() for t in sorted(by_index)},
        "corrections": overall.corrections(),
        "corrections_by_turn": {name: acc.corrections() for name, acc in by_turn.items()},
        "breakdowns": overall.breakdowns(),
        "breakdowns_by_turn": {name: acc.breakdowns() for name, acc in by_turn.items()},
        "routing": None,
        "decode_vs_prefill": None,
        "trainer": None,
    }
    if distributions is not None:
        distributions.finish()
    if sequences is not None:
        sequences.finish({"all": overall, **by_turn})
    if prefill.n_tokens:
        out["decode_vs_prefill"] = prefill.metrics() | {"n_unscored_tokens": n_unscored}
    if trainer["engine_vs_trainer"].n_tokens:
        out["trainer"] = {name: acc.metrics() for name, acc in trainer.items()}
    if router_acc and routing:
        layers = routing["moe_layers"]
        out["routing"] = router_acc["all"].result(layers) | {
            "by_turn": {name: router_acc[name].result(layers) for name in TURN_GROUPS if name in router_acc},
            "num_experts": routing.get("num_experts"),
        }
    return out


def sequences_from_tokens(run_dir: str | Path) -> pa.Table:
    """sequences.parquet's rows for a run older than that file: the metrics pass run again over its
    token shards, keeping its per-sequence rows (so they are the rows a new run writes)."""
    from mismatch_probe.table.tokens import TOKENS_DIR, shard_paths

    if not shard_paths(Path(run_dir), TOKENS_DIR):
        raise FileNotFoundError(f"{run_dir} has no per-token table ({TOKENS_DIR}/)")
    collector = SequenceCollector()
    analyze(run_dir, sequences=collector)
    return collector.table

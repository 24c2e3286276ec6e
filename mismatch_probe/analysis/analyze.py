"""From the per-token table on disk to the metric sections of run.json.

Streams the table shard by shard (each shard holds whole sequences) in one pass: each shard's
token terms are computed once and feed every accumulator (the metrics of all model tokens, whose
sequences are samples, of the first assistant turn, the later turns and each turn index, whose
sequences are sample-turns; routing, distributions, per-sequence rows). Needs neither a GPU nor an
engine, so ``report`` and ``gate`` can run it on a copied run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from mismatch_probe.analysis.distributions import DistributionAccumulator
from mismatch_probe.analysis.metrics import GROUP_TURNS, CorrectionThresholds, MetricsAccumulator
from mismatch_probe.analysis.peer_metrics import PeerAccumulator
from mismatch_probe.analysis.routing_agreement import RoutingAccumulator, compare_routing
from mismatch_probe.analysis.routing_replay import ReplayAccumulator
from mismatch_probe.analysis.sequences import SequenceCollector
from mismatch_probe.analysis.terms import segment_starts, token_terms
from mismatch_probe.table.tokens import iter_model_tokens


def analyze(
    run_dir: str | Path,
    thresholds: CorrectionThresholds | None = None,
    routing: dict | None = None,
    distributions: DistributionAccumulator | None = None,
    sequences: SequenceCollector | None = None,
) -> dict:
    """``metrics``, ``metrics_by_turn`` (first / later), ``metrics_by_turn_index``, ``corrections``, ``breakdowns``, ``routing`` for MoE runs whose
    table has expert ids (``routing`` describes the layers, as the engine recorded them; with
    ``routing.replay``, the routing replay what-if, where the reference also scored with the
    engine's routing forced: ``logp_train_replay``), and
    ``decode_vs_prefill``: the same metrics with the engine's prefill log-probs in the reference's
    place (``delta = logp_prefill - logp_infer``), where the table has them; and ``trainer`` for a
    re-scored imported dump that carried its trainer's log-probs: ``engine_vs_trainer`` (what the
    run itself saw, ``delta = logp_trainer - logp_infer``) and ``trainer_vs_reference`` (how far its
    trainer is from this reference, ``delta = logp_train - logp_trainer``). ``distributions``, when
    given, is fed in the same pass and finished at the end (its ``result`` is what the report draws);
    so is ``sequences`` (its ``table`` holds every sequence's terms, sequences.parquet)."""
    thresholds = thresholds or CorrectionThresholds()
    acc = MetricsAccumulator(thresholds)  # all, first, later and each turn index, in one pass
    router_acc: dict[str, RoutingAccumulator] = {}
    replay_acc: dict[str, ReplayAccumulator] = {}  # the routing replay (R3) what-if, per turn group
    # decode vs prefill: the engine's sampled log-prob against its own full-sequence prefill
    prefill = MetricsAccumulator(thresholds)
    n_unscored = 0
    trainer = {
        "engine_vs_trainer": MetricsAccumulator(thresholds),
        "trainer_vs_reference": MetricsAccumulator(thresholds),
    }
    # the next shard is read while this one is computed, except for MoE runs: their expert ids
    # (layers x top-k int16 a side) make a shard several times larger, and one is enough in memory
    peers = PeerAccumulator(thresholds)  # each framework's own metrics (analysis/peer_metrics.py)
    for shard in iter_model_tokens(Path(run_dir), prefetch=not routing):
        sample, turn = shard["sample_id"], shard["turn"]
        lt, li, pos = shard["logp_train"], shard["logp_infer"], shard["position"]
        ei, et = shard["experts_infer"], shard["experts_train"]
        starts = segment_starts(sample)
        done = acc.add(lt, li, starts, pos, turn)
        if done is None:
            continue
        peers.add_shard(lt, li, starts, done)
        if sequences is not None:
            sequences.add(sample, turn, starts, done)
        if distributions is not None:
            distributions.add_terms(done.terms, turn, sample[starts], done.sequences.max_mismatch)
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
        if ei is not None and et is not None and routing:
            n_layers, top_k = len(routing["moe_layers"]), routing["top_k"]
            cmp = compare_routing(ei, et, n_layers, top_k)  # once per shard, shared by the groups
            for name, keep in _turn_groups(turn):
                router_acc.setdefault(name, RoutingAccumulator(n_layers, top_k)).add(cmp, terms=done.terms, keep=keep)
            if (lr := shard["logp_train_replay"]) is not None and (replayed := ~np.isnan(lr)).any():
                replay_terms = token_terms(lr, li)  # the same tokens: engine vs the reference replaying its routing
                flipped = np.asarray(~cmp.same.all(axis=-1))
                for name, keep in _turn_groups(turn):
                    keep = replayed if keep is None else keep & replayed
                    replay_acc.setdefault(name, ReplayAccumulator()).add(
                        done.terms, replay_terms, flipped, None if keep.all() else keep
                    )
    out: dict[str, Any] = {
        "metrics": acc.metrics(),
        "metrics_by_turn": {name: acc.metrics(name) for name in GROUP_TURNS},
        "metrics_by_turn_index": {str(t): acc.metrics(t) for t in acc.turns},
        "corrections": acc.corrections(),
        "corrections_by_turn": {name: acc.corrections(name) for name in GROUP_TURNS},
        "breakdowns": acc.breakdowns(),
        "breakdowns_by_turn": {name: acc.breakdowns(name) for name in GROUP_TURNS},
        "dashboard": peers.result(),
        "routing": None,
        "decode_vs_prefill": None,
        "trainer": None,
    }
    if distributions is not None:
        distributions.finish()
    if sequences is not None:
        sequences.finish(acc)
    if prefill.n_tokens:
        out["decode_vs_prefill"] = prefill.metrics() | {"n_unscored_tokens": n_unscored}
    if trainer["engine_vs_trainer"].n_tokens:
        out["trainer"] = {name: acc.metrics() for name, acc in trainer.items()}
    if router_acc and routing:
        layers = routing["moe_layers"]
        out["routing"] = router_acc["all"].result(layers) | {
            "by_turn": {name: router_acc[name].result(layers) for name in GROUP_TURNS if name in router_acc},
            "num_experts": routing.get("num_experts"),
        }
        if "all" in replay_acc:  # the reference also scored with the engine's routing replayed
            out["routing"]["replay"] = replay_acc["all"].result()
            for name, group in out["routing"]["by_turn"].items():
                if name in replay_acc:
                    group["replay"] = replay_acc[name].result()
    return out


def _turn_groups(turn: np.ndarray):
    """("all", None) and each turn group with its tokens (None: all of them)."""
    yield "all", None
    for name, select in GROUP_TURNS.items():
        keep = select(turn)
        yield name, (None if keep.all() else keep)


def sequences_from_tokens(run_dir: str | Path) -> pa.Table:
    """sequences.parquet's rows for a run older than that file: the metrics pass run again over its
    token shards, keeping its per-sequence rows (so they are the rows a new run writes)."""
    from mismatch_probe.table.tokens import TOKENS_DIR, shard_paths

    if not shard_paths(Path(run_dir), TOKENS_DIR):
        raise FileNotFoundError(f"{run_dir} has no per-token table ({TOKENS_DIR}/)")
    collector = SequenceCollector()
    analyze(run_dir, sequences=collector)
    return collector.table

"""Runs built in a test, for the report's tests: a record and distributions from synthetic token
log-probs, reduced by the analysis's own accumulators (nothing in them is typed in by hand)."""

from __future__ import annotations

import numpy as np

from mismatch_probe.record import RunRecord, parse_record


def synthetic_tokens(n_tokens: int, seed: int = 1):
    """(sample_id, position, turn, logp_train, logp_infer): 50-token samples whose last 20 tokens are
    a later turn, the reference a little off the engine."""
    rng = np.random.default_rng(seed)
    sample = np.repeat(np.arange(n_tokens // 50 + 1), 50)[:n_tokens]
    position = np.arange(n_tokens) % 50
    turn = (position >= 30).astype(np.int16)
    li = np.log(rng.beta(5, 0.3, n_tokens))
    lt = (li + rng.normal(0, 0.01, n_tokens)).clip(max=0)
    return sample, position, turn, lt, li


def synthetic_run(n_tokens: int = 5000, *, imported: str = "", rescored: bool = False, name: str = "synthetic"):
    """(record, dist) of a two-turn run. ``imported``: a dump's format, its trainer as the reference
    (``rescored``: re-scored by a reference, the trainer's comparisons beside it, and decode vs
    prefill measured)."""
    from mismatch_probe.analysis.distributions import DistributionAccumulator, with_sequences
    from mismatch_probe.analysis.metrics import MetricsAccumulator
    from mismatch_probe.analysis.sequences import SCHEMA, SequenceIds, sequence_table
    from mismatch_probe.analysis.terms import segment_starts

    sample, position, turn, lt, li = synthetic_tokens(n_tokens)
    acc, dist = MetricsAccumulator(), DistributionAccumulator()
    ids = {g: SequenceIds() for g in ("all", "first", "later")}
    if n_tokens:
        starts = segment_starts(sample)
        shard = acc.add(lt, li, starts, position, turn)
        dist.add_terms(shard.terms, turn, sample[starts], shard.sequences.max_mismatch)
        ids["all"].add(sample, None, starts)
        for g, keep in (("first", shard.segment_turn == 0), ("later", shard.segment_turn >= 1)):
            ids[g].add(sample, turn, shard.segments[keep])
    table = sequence_table({g: (ids[g], acc.sequences(g)) for g in ids}) if n_tokens else SCHEMA.empty_table()
    data = {
        "status": "complete",
        "metrics": acc.metrics(),
        "metrics_by_turn": {g: acc.metrics(g) for g in ("first", "later")},
        "corrections": acc.corrections(),
        "corrections_by_turn": {g: acc.corrections(g) for g in ("first", "later")},
        "breakdowns": acc.breakdowns(),
        "spec": {"name": name},
        "environment": {"gpus": [], "cpu_model": "EPYC"},
    }
    if imported:
        data["imported_from"] = {"format": imported, "path": "dump", "step": 3}
        data["reference"] = {"dtype": "float32"} if rescored else {"source": "trainer"}
    if rescored:
        other = MetricsAccumulator()  # the trainer: the engine's log-probs, off by less
        other.add(li, (li + lt) / 2, segment_starts(sample), position, turn)
        data["trainer"] = {"engine_vs_trainer": other.metrics(), "trainer_vs_reference": acc.metrics()}
        data["decode_vs_prefill"] = other.metrics()
    dist_out = with_sequences(dist.finish(), table)
    dist_out["worst_sequences"] = []
    record: RunRecord = parse_record(data)
    return record, dist_out

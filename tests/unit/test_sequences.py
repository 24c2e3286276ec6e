"""sequences.parquet: every sequence's terms from the metrics pass, checked by hand in float64,
and the same rows whether collected in the pass or recomputed from an old run's tokens."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from mismatch_probe.analysis.analyze import analyze, sequences_from_tokens
from mismatch_probe.analysis.sequences import SequenceCollector, sequence_values
from mismatch_probe.table.tokens import shard_name

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "reports" / "example"


def test_terms_of_a_hand_made_two_turn_sample(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # sample 7: turn 0 has two model tokens, turn 1 one; sample 9: one token in turn 0
    lt = np.log([0.5, 0.25, 0.8, 0.9])
    li = np.log([0.4, 0.25, 0.9, 0.6])
    table = pa.table(
        {
            "sample_id": pa.array([7, 7, 7, 7, 9], pa.int64()),
            "turn": pa.array([0, 0, -1, 1, 0], pa.int32()),
            "position": pa.array([0, 1, 2, 3, 0], pa.int32()),
            "is_model_token": pa.array([True, True, False, True, True]),
            "logp_infer": pa.array([li[0], li[1], np.nan, li[2], li[3]], pa.float32()),
            "logp_train": pa.array([lt[0], lt[1], np.nan, lt[2], lt[3]], pa.float32()),
            "experts_infer": pa.array([None] * 5, pa.list_(pa.int16())),
            "experts_train": pa.array([None] * 5, pa.list_(pa.int16())),
        }
    )
    (tmp_path / "tokens.parquet").mkdir()
    pq.write_table(table, tmp_path / "tokens.parquet" / shard_name(0))
    lt32, li32 = lt.astype(np.float32).astype(np.float64), li.astype(np.float32).astype(np.float64)

    rows = sequences_from_tokens(tmp_path).to_pylist()
    collector = SequenceCollector()
    analyze(tmp_path, sequences=collector)
    assert collector.table.to_pylist() == rows  # collected in the pass == recomputed

    def expect(idx):
        d = lt32[idx] - li32[idx]
        p_diff = np.abs(np.exp(lt32[idx]) - np.exp(li32[idx]))
        k3 = np.exp(d) - 1 - d
        return {
            "n_tokens": len(idx),
            "log_ratio": d.sum(),
            "max_mismatch": p_diff.max(),
            "mean_mismatch": p_diff.mean(),
            "geo_ratio": math.exp(d.mean()),
            "min_token_log_ratio": d.min(),
            "log_ppl_infer": -li32[idx].mean(),
            "log_ppl_train": -lt32[idx].mean(),
            "k3_sum": k3.sum(),
        }

    want = [
        ("all", 7, None, [0, 1, 2]),
        ("all", 9, None, [3]),
        ("first", 7, 0, [0, 1]),
        ("first", 9, 0, [3]),
        ("later", 7, 1, [2]),
    ]
    assert [(r["group"], r["sample_id"], r["turn"]) for r in rows] == [w[:3] for w in want]
    for row, (_, _, _, idx) in zip(rows, want):
        for key, value in expect(np.array(idx)).items():
            assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.skipif(not (EXAMPLE / "tokens.parquet").is_dir(), reason="the committed example run is not here")
def test_the_committed_example_sums_back_to_its_metrics():
    from mismatch_probe.record import read_record

    record = read_record(EXAMPLE)
    table = sequences_from_tokens(EXAMPLE)
    values = sequence_values(table)
    everything = table.filter(pc.equal(table.column("group"), "all"))
    assert everything.num_rows == record.metric("n_sequences")
    n = np.asarray(everything.column("n_tokens"))
    assert n.sum() == record.metric("n_model_tokens")
    # k3_kl is the token mean of K3: the per-sequence sums are its sufficient statistic
    k3 = np.asarray(everything.column("k3_sum")).sum() / n.sum()
    assert k3 == pytest.approx(record.metric("k3_kl"), rel=1e-9)
    assert values["all"]["max_mismatch"].mean() == pytest.approx(record.metric("seq_max_mismatch_mean"), rel=1e-12)
    assert len(values["later"]["n_tokens"]) == 0 and len(values["first"]["n_tokens"]) == everything.num_rows

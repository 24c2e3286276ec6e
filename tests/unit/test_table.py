"""Rollout shards and the per-token table: round trips, layout, nulls, atomic writes."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from mismatch_probe.table.tokens import (
    TOKEN_SCHEMA,
    Rollout,
    read_rollout_shard,
    rollouts_to_table,
    token_table,
    write_table_atomic,
)


def make_rollouts():
    a = Rollout(
        3,
        "p0",
        np.array([1, 2, 3, 4], np.int32),
        np.array([-1, -1, 0, 0], np.int16),
        np.array([False, False, True, True]),
        np.array([np.nan, np.nan, -0.5, -0.1], np.float32),
        "stop",
    )
    b = Rollout(
        4,
        "p1",
        np.array([5, 6, 7], np.int32),
        np.array([-1, 0, -1], np.int16),
        np.array([False, True, False]),
        np.array([np.nan, -2.0, np.nan], np.float32),
        "length",
    )
    return [a, b]


def test_rollout_shard_round_trip(tmp_path):
    path = tmp_path / "r" / "part-00000.parquet"
    write_table_atomic(rollouts_to_table(make_rollouts()), path)
    assert [p.name for p in path.parent.iterdir()] == ["part-00000.parquet"]  # no temp file left
    back = read_rollout_shard(path)
    for x, y in zip(make_rollouts(), back):
        assert (x.sample_id, x.prompt_id, x.finish_reason) == (y.sample_id, y.prompt_id, y.finish_reason)
        assert np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.turn, y.turn)
        assert np.array_equal(x.is_model_token, y.is_model_token)
        assert np.array_equal(x.logp_infer, y.logp_infer, equal_nan=True)


def test_token_table_explodes_one_row_per_token(tmp_path):
    rollouts = make_rollouts()
    lt = [np.array([np.nan, np.nan, -0.4, -0.2], np.float32), np.array([np.nan, -1.5, np.nan], np.float32)]
    ent = [np.array([np.nan, np.nan, 0.3, 0.1], np.float32), np.array([np.nan, 0.9, np.nan], np.float32)]
    t = token_table(rollouts, lt, ent)
    assert t.schema == TOKEN_SCHEMA
    assert t.num_rows == 7
    d = t.to_pydict()
    assert d["sample_id"] == [3, 3, 3, 3, 4, 4, 4]
    assert d["prompt_id"] == ["p0"] * 4 + ["p1"] * 3
    assert d["position"] == [0, 1, 2, 3, 0, 1, 2]
    assert d["token_id"] == [1, 2, 3, 4, 5, 6, 7]
    assert d["turn"] == [-1, -1, 0, 0, -1, 0, -1]
    assert d["logp_infer"] == [None, None, -0.5, -0.10000000149011612, None, -2.0, None]
    assert d["logp_train"][2:4] == [-0.4000000059604645, -0.20000000298023224] and d["logp_train"][0] is None
    write_table_atomic(t, tmp_path / "t.parquet")
    assert pq.read_table(tmp_path / "t.parquet").equals(t)

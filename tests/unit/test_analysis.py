"""analyze() on hand-built tables: the right tokens in the right groups, tool tokens excluded."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_probe.analysis.analyze import analyze
from mismatch_probe.analysis.metrics import CANONICAL_KEYS, compute_metrics
from mismatch_probe.analysis.terms import segment_starts
from mismatch_probe.record import json_safe
from mismatch_probe.table.tokens import TOKENS_DIR, Rollout, shard_name, token_table, write_table_atomic

P, T = -1, -1  # turn of prompt and tool tokens


def conversation(sample_id, turns, rng):
    """turns: list of (kind, n) with kind in 'prompt', 'tool', or an int assistant turn index."""
    ids, turn, model = [], [], []
    for kind, n in turns:
        ids += list(rng.integers(3, 1000, n))
        turn += [kind if isinstance(kind, int) else -1] * n
        model += [isinstance(kind, int)] * n
    model = np.array(model)
    li = np.where(model, np.log(rng.uniform(0.01, 1, len(ids))), np.nan).astype(np.float32)
    lt = np.where(model, li + rng.normal(0, 0.05, len(ids)), np.nan).clip(max=0).astype(np.float32)
    # wild engine values on tool tokens: if they leaked into any metric, it would show
    li_stored = li.copy()
    li_stored[~model] = -50.0
    r = Rollout(sample_id, f"p{sample_id}", np.array(ids, np.int32), np.array(turn, np.int16), model, li_stored, "stop")
    return r, lt


@pytest.fixture
def run_dir(tmp_path):
    rng = np.random.default_rng(0)
    shards = [
        [
            conversation(0, [("prompt", 5), (0, 4), ("tool", 3), (1, 6), ("tool", 2), (2, 3)], rng),
            conversation(1, [("prompt", 7), (0, 1)], rng),
            conversation(2, [("prompt", 4)], rng),
        ],  # empty response
        [conversation(3, [("prompt", 3), (0, 2), ("tool", 4), (1, 5)], rng)],
    ]
    for i, shard in enumerate(shards):
        rollouts = [r for r, _ in shard]
        lts = [lt for _, lt in shard]
        write_table_atomic(
            token_table(rollouts, lts, [np.zeros(len(x), np.float32) for x in lts]),
            tmp_path / TOKENS_DIR / shard_name(i),
        )
    return tmp_path, [c for s in shards for c in s]


def expected(convs, select):
    sid, turn, lt, li = [], [], [], []
    for r, lt_r in convs:
        keep = r.is_model_token & select(r.turn)
        sid += [r.sample_id] * int(keep.sum())
        turn += list(r.turn[keep])
        lt += list(lt_r[keep])
        li += list(r.logp_infer[keep])
    return np.array(sid), np.array(turn), np.array(lt, np.float64), np.array(li, np.float64)


def test_groups_and_masks(run_dir):
    path, convs = run_dir
    rec = analyze(path)
    sid, _, lt, li = expected(convs, lambda t: t >= 0)
    want, _ = compute_metrics(lt.astype(np.float32), li.astype(np.float32), segment_starts(sid))
    for key in CANONICAL_KEYS:
        assert rec["metrics"][key] == pytest.approx(want[key], rel=1e-9), key
    assert rec["metrics"]["n_model_tokens"] == 4 + 6 + 3 + 1 + 2 + 5
    assert rec["metrics"]["n_sequences"] == 3  # sample 2 has no response
    first = rec["metrics_by_turn"]["first"]
    assert first["n_model_tokens"] == 4 + 1 + 2 and first["n_sequences"] == 3
    later = rec["metrics_by_turn"]["later"]
    assert later["n_model_tokens"] == 6 + 3 + 5
    assert later["n_sequences"] == 3  # sample-turns: (0,1), (0,2), (3,1)
    sid, turn, lt, li = expected(convs, lambda t: t >= 1)
    want, _ = compute_metrics(lt.astype(np.float32), li.astype(np.float32), segment_starts(sid, turn))
    assert later["seq_max_mismatch_mean"] == pytest.approx(want["seq_max_mismatch_mean"], rel=1e-9)
    assert later["log_ppl_infer"] == pytest.approx(want["log_ppl_infer"], rel=1e-9)
    # tool tokens carried logp_infer = -50 in the rollout; none reached the table as model tokens
    assert rec["metrics"]["prob_diff_max"] < 0.5


def test_json_safe():
    assert json_safe({"a": float("nan"), "b": [float("inf"), -np.inf], "c": np.int64(3), "d": np.float32(0.5)}) == {
        "a": None,
        "b": ["inf", "-inf"],
        "c": 3,
        "d": 0.5,
    }


def test_decode_vs_prefill_is_scored_on_model_tokens_with_a_prefill(tmp_path):
    """delta = logp_prefill - logp_infer; K3 checked against a float64 hand computation; tokens the
    engine did not re-score (NaN) are counted, not used; a run without prefill has no section."""
    model = np.array([False, False, True, True, True, False, True])
    li = np.array([np.nan, np.nan, -0.5, -1.0, -0.01, -9.0, -2.0], np.float32)
    lp = np.array([np.nan, -3.0, -0.4, -1.2, -0.01, -7.0, np.nan], np.float32)  # prompt/tool values must be ignored
    r = Rollout(
        0,
        "p",
        np.arange(7, dtype=np.int32),
        np.where(model, 0, -1).astype(np.int16),
        model,
        np.where(model, li, np.nan).astype(np.float32),
        "stop",
        logp_prefill=lp,
    )
    lt = [np.where(model, li, np.nan).astype(np.float32)]
    write_table_atomic(token_table([r], lt, [np.zeros(7, np.float32)]), tmp_path / TOKENS_DIR / shard_name(0))
    out = analyze(tmp_path)["decode_vs_prefill"]
    d = np.array([-0.4 - -0.5, -1.2 - -1.0, 0.0], np.float64)  # the three scored model tokens
    assert out["n_model_tokens"] == 3 and out["n_unscored_tokens"] == 1
    np.testing.assert_allclose(out["k3_kl"], np.mean(np.expm1(d) - d), rtol=1e-5)
    np.testing.assert_allclose(out["prob_diff_max"], abs(np.exp(-1.2) - np.exp(-1.0)), rtol=1e-5)

    r.logp_prefill = None
    write_table_atomic(token_table([r], lt, [np.zeros(7, np.float32)]), tmp_path / TOKENS_DIR / shard_name(0))
    assert analyze(tmp_path)["decode_vs_prefill"] is None


def test_a_table_from_before_logp_prefill_still_analyzes(run_dir):
    import pyarrow.parquet as pq

    path, _ = run_dir
    before = analyze(path)
    for shard in (path / TOKENS_DIR).iterdir():
        t = pq.read_table(shard)
        pq.write_table(t.drop_columns(["logp_prefill"]), shard)  # schema version 1 had no such column
    after = analyze(path)
    assert after["metrics"] == before["metrics"] and after["decode_vs_prefill"] is None

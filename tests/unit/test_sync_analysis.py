"""analysis/sync.py against hand-computed values and hand-made digests (no engine)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mismatch_probe.analysis.sync import logprob_fidelity, stale_cache, sync_findings, vs_fresh_k3, weight_findings


def digest(rows):
    rows = np.asarray(rows, np.float64)
    return np.stack([rows.sum(-1), np.square(rows).sum(-1)], -1)


def test_logprob_fidelity_by_hand():
    synced = np.array([-1.0, -2.0, -0.5, np.nan], np.float32)
    fresh = np.array([-1.0, -2.5, -0.5, -3.0], np.float32)
    got = logprob_fidelity(synced, fresh)
    d = -0.5  # fresh - synced on the one differing token
    assert got["tokens"] == 3
    assert got["bitwise_share"] == 2 / 3
    assert got["max_abs_dlogp"] == 0.5
    assert math.isclose(got["k3"], (math.expm1(d) - d) / 3, rel_tol=1e-12)
    assert logprob_fidelity(np.array([np.nan]), np.array([1.0]))["tokens"] == 0


def test_weight_findings_name_each_fault():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 4))
    old = w + 0.05 * rng.normal(size=w.shape)
    experts = rng.normal(size=(4 * 2, 3))  # 4 experts of 2 rows
    fresh = {
        "a": digest(w),
        "fused": digest(w),
        "tiny": digest(w),
        "mlp.experts.w": digest(experts),
        "embed_tokens.weight": digest(w),
    }
    before = {
        "a": digest(old),
        "fused": digest(old),
        "tiny": digest(old),
        "mlp.experts.w": digest(experts[::-1]),
        "embed_tokens.weight": digest(old),
    }
    swapped = w[[3, 4, 5, 0, 1, 2]]
    permuted = experts.reshape(4, 2, 3)[[1, 0, 2, 3]].reshape(8, 3)
    after = {
        "a": digest(old),  # not updated
        "fused": digest(swapped),  # halves swapped
        "tiny": digest(w + 1e-7),  # rounding
        "mlp.experts.w": digest(permuted),
        "embed_tokens.weight": digest(w),
        "lm_head.weight": digest(old),  # a head of its own holding the start embedding
    }
    differing, found = weight_findings(before, after, fresh, n_experts=4)
    kinds = {f["parameters"][0]: f["kind"] for f in found}
    assert kinds == {
        "a": "not_updated",
        "fused": "permuted_rows",
        "tiny": "precision",
        "mlp.experts.w": "permuted_experts",
        "lm_head.weight": "untied_lm_head",
    }
    assert "experts [0, 1]" in next(f["message"] for f in found if f["kind"] == "permuted_experts")
    assert set(differing) == set(kinds)
    # a head the engine filled from the embedding again is no finding
    after["lm_head.weight"] = digest(w)
    assert "lm_head.weight" not in {f["parameters"][0] for f in weight_findings(before, after, fresh, n_experts=4)[1]}


def test_stale_cache_finding_needs_a_difference_beyond_kernel_noise():
    clean = np.array([-1.0, -2.0, -0.5])
    s = stale_cache(clean + np.array([0.0, 0.2, 0.0]), clean)
    assert s["bitwise_share"] == 2 / 3 and s["max_abs_dlogp"] == pytest.approx(0.2)
    assert [f["kind"] for f in sync_findings([], s)] == ["stale_prefix_cache"]
    assert sync_findings([], stale_cache(clean + 1e-6, clean)) == []  # rounding, not a stale cache
    assert sync_findings([], stale_cache(clean, clean)) == []


def test_stale_cache_finding_is_judged_against_the_engines_own_cache_hit_floor():
    """On kernels that are not batch invariant a cache hit alone moves the answers (the floor: the
    same greedy requests answered from entries of the new weights against recomputed); a stale
    cache is a finding only well beyond it: 4x the floor's largest |Δ log p|."""
    clean = np.array([-1.0, -2.0, -0.5, -3.0])
    noisy = stale_cache(clean + np.array([0.0, 0.004, 0.0, 0.0]), clean)
    within = {**stale_cache(clean + np.array([0.0, 0.012, -0.003, 0.0]), clean), "floor": noisy}
    assert sync_findings([], within) == []  # 0.012 < 4 x 0.004
    beyond = {**stale_cache(clean + np.array([0.3, 0.0, 0.0, 0.0]), clean), "floor": noisy}
    (found,) = sync_findings([], beyond)
    assert found["kind"] == "stale_prefix_cache" and "a cache hit alone moves them by at most 0.004" in found["message"]
    # a bitwise floor (AMX kernels) leaves the absolute bound alone in charge, as in runs before the floor
    exact = {**stale_cache(clean + np.array([0.002, 0.0, 0.0, 0.0]), clean), "floor": stale_cache(clean, clean)}
    assert [f["kind"] for f in sync_findings([], exact)] == ["stale_prefix_cache"]
    assert "cache hit alone" not in sync_findings([], exact)[0]["message"]


def test_drift_over_repeats_and_logprobs_differ():
    same = {
        "weights": {"differing": []},
        "fidelity": {"bitwise_share": 1.0, "max_abs_dlogp": 0.0, "tokens": 5, "k3": 0.0},
    }
    later = {
        "weights": {"differing": ["x"]},
        "fidelity": {"bitwise_share": 0.5, "max_abs_dlogp": 0.1, "tokens": 5, "k3": 1e-3},
    }
    assert sync_findings([{"repeat": 1, **same}, {"repeat": 2, **same}], None) == []
    kinds = [f["kind"] for f in sync_findings([{"repeat": 1, **same}, {"repeat": 2, **later}], None)]
    assert kinds == ["logprobs_differ", "drift_over_repeats"]


def test_vs_fresh_k3_by_hand_and_within_noise():
    rng = np.random.default_rng(1)
    ids = np.repeat(np.arange(40), 5)
    ref = rng.normal(-2, 0.5, ids.size)
    fresh = ref + rng.normal(0, 0.01, ids.size)
    got = vs_fresh_k3(fresh.copy(), fresh, ref, ids, n_boot=300)
    d = ref - fresh
    assert math.isclose(got["k3_fresh"], float(np.mean(np.expm1(d) - d)), rel_tol=1e-9)
    assert got["difference"] == 0 and got["within_noise"]
    worse = vs_fresh_k3(fresh + rng.normal(0, 0.2, ids.size), fresh, ref, ids, n_boot=300)
    assert worse["difference"] > 0 and worse["within_noise"] is False

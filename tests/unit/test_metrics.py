"""Every metric against an independent float64 computation (plain Python loops over ``math``),
plus the edge cases: empty input, one token, -inf / NaN / +inf log-probs, boundaries, streaming."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from mismatch_probe.analysis.metrics import (
    CANONICAL_KEYS,
    CORRECTION_KEYS,
    KEPT_K3,
    P_INFER_BUCKET_EDGES,
    CorrectionThresholds,
    MetricsAccumulator,
    compute_metrics,
)
from mismatch_probe.analysis.terms import segment_starts
from mismatch_probe.errors import DataError


def reference_metrics(seqs: list[tuple[list[float], list[float]]], th: CorrectionThresholds) -> tuple[dict, dict]:
    """The metric definitions (ARCHITECTURE.md, Metrics), written out token by token with no NumPy."""
    toks = [(lt, li) for lts, lis in seqs for lt, li in zip(lts, lis)]
    n = len(toks)
    d = [lt - li for lt, li in toks]
    r = [math.exp(x) for x in d]
    pt = [math.exp(lt) for lt, _ in toks]
    pi = [math.exp(li) for _, li in toks]
    diff = [abs(a - b) for a, b in zip(pt, pi)]
    mean = lambda xs: sum(xs) / len(xs)
    sorted_abs = sorted(abs(x) for x in d)

    def quantile(q):  # linear interpolation between closest ranks (NumPy's default definition)
        pos = q * (n - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        return sorted_abs[lo] + (sorted_abs[hi] - sorted_abs[lo]) * (pos - lo)

    mx, my = mean(pt), mean(pi)
    cov = sum((a - mx) * (b - my) for a, b in zip(pt, pi))
    vx = sum((a - mx) ** 2 for a in pt)
    vy = sum((b - my) ** 2 for b in pi)
    seq_max, seq_ppl_i, seq_ppl_t, seq_lr, seq_min, seq_n = [], [], [], [], [], []
    for lts, lis in seqs:
        dd = [a - b for a, b in zip(lts, lis)]
        seq_max.append(max(abs(math.exp(a) - math.exp(b)) for a, b in zip(lts, lis)))
        seq_ppl_i.append(-mean(lis))
        seq_ppl_t.append(-mean(lts))
        seq_lr.append(sum(dd))
        seq_min.append(min(dd))
        seq_n.append(len(dd))
    seq_w = [math.exp(max(-20.0, min(20.0, s))) for s in seq_lr]
    metrics = {
        "k3_kl": mean([ri - di - 1 for ri, di in zip(r, d)]),
        "k1_kl": mean([-x for x in d]),
        "abs_delta_mean": mean([abs(x) for x in d]),
        "abs_delta_p99": quantile(0.99),
        "prob_diff_max": max(diff),
        "prob_diff_mean": mean(diff),
        "seq_max_mismatch_mean": mean(seq_max),
        "seq_max_mismatch_gt_0_5_share": sum(m > 0.5 for m in seq_max) / len(seqs),
        "mult_prob_error": mean([math.exp(abs(x)) for x in d]),
        "chi2_token": mean([x * x for x in r]) - 1,
        "chi2_seq": mean([math.exp(2 * max(-20.0, min(20.0, s))) for s in seq_lr]) - 1,
        # the self-normalized forms, by their published definition E[w^2] / E[w]^2 - 1
        "chi2_token_sn": mean([x * x for x in r]) / mean(r) ** 2 - 1,
        "chi2_seq_sn": mean([w * w for w in seq_w]) / mean(seq_w) ** 2 - 1,
        "ess": 1 / mean([(w / mean(r)) ** 2 for w in r]),
        "pearson_prob": cov / math.sqrt(vx * vy),
        "log_ppl_infer": mean(seq_ppl_i),
        "log_ppl_train": mean(seq_ppl_t),
        "n_model_tokens": n,
        "n_sequences": len(seqs),
    }
    geo = [math.exp(s / k) for s, k in zip(seq_lr, seq_n)]
    corrections = {
        "token_tis_clipped_share": sum(x > th.token_tis for x in r) / n,
        "token_mask_share": sum(x < th.token_mask_low or x > th.token_mask_high for x in r) / n,
        "seq_tis_clipped_share": sum(math.exp(s) > th.seq_tis for s in seq_lr) / len(seqs),
        "seq_mis_masked_share": sum(math.exp(s) > th.seq_mis for s in seq_lr) / len(seqs),
        "geo_rejected_share": sum(g < 1 - th.geo_eps or g > 1 + th.geo_eps for g in geo) / len(seqs),
        "worst_token_rejected_share": sum(math.exp(m) < th.worst_token_tau for m in seq_min) / len(seqs),
    }
    # the K3 of what each correction keeps, by its definition: the tokens it does not clip or mask,
    # the tokens of the sequences it does not drop (math.expm1: ratio - delta - 1 loses tiny deltas)
    k3 = lambda x: math.expm1(x) - x
    kept_tokens = {
        "token_tis_kept_k3": [k3(x) for x in d if not math.exp(x) > th.token_tis],
        "token_mask_kept_k3": [k3(x) for x in d if th.token_mask_low <= math.exp(x) <= th.token_mask_high],
    }
    drop = {
        "seq_tis_kept_k3": lambda i: math.exp(seq_lr[i]) > th.seq_tis,
        "seq_mis_kept_k3": lambda i: math.exp(seq_lr[i]) > th.seq_mis,
        "geo_kept_k3": lambda i: geo[i] < 1 - th.geo_eps or geo[i] > 1 + th.geo_eps,
        "worst_token_kept_k3": lambda i: math.exp(seq_min[i]) < th.worst_token_tau,
    }
    for key, dropped in drop.items():
        kept_tokens[key] = [k3(a - b) for i, (lts, lis) in enumerate(seqs) if not dropped(i) for a, b in zip(lts, lis)]
    corrections.update({k: mean(v) if v else None for k, v in kept_tokens.items()})
    return metrics, corrections


def random_sequences(rng: random.Random, n_seq: int, scale: float) -> list[tuple[list[float], list[float]]]:
    seqs = []
    for _ in range(n_seq):
        k = rng.randint(1, 40)
        li = [math.log(rng.uniform(1e-6, 1.0)) for _ in range(k)]
        lt = [min(0.0, x + rng.gauss(0, scale)) for x in li]
        seqs.append((lt, li))
    return seqs


def flat(seqs):
    lt = np.array([x for s in seqs for x in s[0]], dtype=np.float64)
    li = np.array([x for s in seqs for x in s[1]], dtype=np.float64)
    ids = np.repeat(np.arange(len(seqs)), [len(s[0]) for s in seqs])
    return lt, li, segment_starts(ids)


@pytest.mark.parametrize("scale", [1e-4, 0.05, 1.5])
def test_all_metrics_match_float64_reference(scale):
    rng = random.Random(int(scale * 1e4))
    seqs = random_sequences(rng, 60, scale)
    th = CorrectionThresholds(token_tis=1.01, token_mask_low=0.99, token_mask_high=1.01, geo_eps=1e-3)
    lt, li, starts = flat(seqs)
    got, corr = compute_metrics(lt, li, starts, th)
    want, want_corr = reference_metrics(seqs, th)
    for key in CANONICAL_KEYS + ("chi2_token_sn", "chi2_seq_sn"):
        # quantiles come from |delta| kept as float32 (4 bytes a token); all else is float64
        rel = 1e-6 if key == "abs_delta_p99" else 1e-9
        # E[w^2] / E[w]^2 - 1 as written cancels to ~1e-16 absolute error when the true value is ~1e-8
        abs_tol = 1e-12 if key.endswith("_sn") else 1e-15
        assert got[key] == pytest.approx(want[key], rel=rel, abs=abs_tol), key
    for key in CORRECTION_KEYS:
        assert corr[key] == pytest.approx(want_corr[key], abs=1e-12), key
    for key in KEPT_K3.values():
        if want_corr[key] is None:  # the correction keeps nothing
            assert corr[key] is None, key
        else:
            assert corr[key] == pytest.approx(want_corr[key], rel=1e-9, abs=1e-15), key


def test_k3_is_accurate_for_tiny_deltas():
    # ratio - delta - 1 in float64 cancels to 0 for |delta| ~ 1e-9; the true K3 is delta^2/2.
    lt = np.array([-1.0 + 1e-9])
    li = np.array([-1.0])
    m, _ = compute_metrics(lt, li, np.array([0]))
    delta = lt[0] - li[0]
    assert m["k3_kl"] == pytest.approx(delta * delta / 2, rel=1e-6)
    assert m["k3_kl"] > 0


def test_hand_computed_single_token():
    # p_train = 0.5, p_infer = 0.25: delta = log 2, ratio = 2.
    m, c = compute_metrics(np.log([0.5]), np.log([0.25]), np.array([0]))
    assert m["k1_kl"] == pytest.approx(-math.log(2))
    assert m["k3_kl"] == pytest.approx(2 - math.log(2) - 1)
    assert m["prob_diff_max"] == pytest.approx(0.25)
    assert m["mult_prob_error"] == pytest.approx(2.0)
    assert m["chi2_token"] == pytest.approx(3.0)
    assert m["chi2_token_sn"] == 0 and m["chi2_seq_sn"] == 0  # one weight: no spread around its own mean
    assert m["ess"] == pytest.approx(1.0)
    assert m["pearson_prob"] is None  # undefined for one token
    assert m["log_ppl_infer"] == pytest.approx(math.log(4))
    assert m["log_ppl_train"] == pytest.approx(math.log(2))
    assert m["abs_delta_p99"] == pytest.approx(math.log(2))
    assert (m["n_model_tokens"], m["n_sequences"]) == (1, 1)
    # ratio exactly 2 is at the TIS threshold, which clips strictly above it.
    assert c["token_tis_clipped_share"] == 0.0
    assert c["seq_tis_clipped_share"] == 0.0
    assert c["token_mask_share"] == 0.0
    assert c["geo_rejected_share"] == 1.0


def test_empty_input_gives_none_and_zero_counts():
    m, c = compute_metrics(np.zeros(0), np.zeros(0), np.zeros(0, np.int64))
    assert m["n_model_tokens"] == 0 and m["n_sequences"] == 0
    for key in CANONICAL_KEYS:
        if not key.startswith("n_"):
            assert m[key] is None, key
    assert all(c[k] is None for k in CORRECTION_KEYS)
    assert "thresholds" in c


def test_identical_logprobs_are_perfect():
    lp = np.log(np.array([0.9, 0.5, 0.01, 0.7]))
    m, c = compute_metrics(lp, lp.copy(), np.array([0, 2]))
    assert m["k3_kl"] == 0 and m["k1_kl"] == 0 and m["prob_diff_max"] == 0
    assert m["mult_prob_error"] == 1.0 and m["ess"] == 1.0 and m["chi2_token"] == 0
    assert m["pearson_prob"] == pytest.approx(1.0)
    assert all(c[k] == 0 for k in CORRECTION_KEYS if k != "geo_rejected_share")
    assert c["geo_rejected_share"] == 0


def test_neg_inf_logp_train_is_zero_probability():
    lt = np.array([-np.inf, np.log(0.5)])
    li = np.array([np.log(0.2), np.log(0.5)])
    acc = MetricsAccumulator()
    acc.add(lt, li, np.array([0]))
    m, c = acc.metrics(), acc.corrections()
    assert m["n_zero_prob_train"] == 1
    assert m["prob_diff_max"] == pytest.approx(0.2)  # |0 - 0.2|
    assert m["k3_kl"] == math.inf and m["k1_kl"] == math.inf and m["abs_delta_mean"] == math.inf
    assert m["abs_delta_p99"] == math.inf  # interpolation touching an infinite value stays inf
    assert m["chi2_token"] == pytest.approx((0 + 1) / 2 - 1)  # ratios 0 and 1
    assert m["chi2_token_sn"] == pytest.approx((0 + 1) / 2 / 0.5**2 - 1)  # = 1
    assert c["worst_token_rejected_share"] == 1.0  # ratio 0 < 1e-4
    assert m["log_ppl_train"] == math.inf


@pytest.mark.parametrize(
    "lt, li, match",
    [
        ([np.nan, -1.0], [-1.0, -1.0], "NaN logp_train"),
        ([-1.0, -1.0], [-1.0, np.nan], "NaN logp_infer"),
        ([-1.0], [-np.inf], "logp_infer = -inf"),
        ([np.inf], [-1.0], r"\+inf"),
    ],
)
def test_invalid_logprobs_raise(lt, li, match):
    with pytest.raises(DataError, match=match):
        compute_metrics(np.array(lt), np.array(li), np.array([0]))


def test_streaming_equals_one_shot():
    rng = random.Random(3)
    seqs = random_sequences(rng, 50, 0.3)
    lt, li, starts = flat(seqs)
    whole, whole_c = compute_metrics(lt, li, starts)
    acc = MetricsAccumulator()
    cut_seq = [0, 7, 8, 30, 50]  # chunk boundaries on sequence boundaries, one chunk of one sequence
    bounds = list(starts) + [len(lt)]
    for a, b in itertools.pairwise(cut_seq):
        lo, hi = bounds[a], bounds[b]
        acc.add(lt[lo:hi], li[lo:hi], np.asarray(starts[a:b]) - lo)
    got, got_c = acc.metrics(), acc.corrections()
    for key in whole:
        assert got[key] == pytest.approx(whole[key], rel=1e-12), key
    assert got_c.keys() == whole_c.keys()
    for key, value in whole_c.items():  # sums: equal up to the order of summation
        assert got_c[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key


def test_self_normalized_chi2_is_never_negative_where_the_verl_form_is():
    # Weights 0.9 and 1.05 (mean 0.975): E[w^2] - 1 = -0.0487 < 0 though the weights do differ;
    # E[w^2] / E[w]^2 - 1 = 0.075^2 / 0.975^2 = 0.005917...
    lt = np.log(np.array([0.9, 1.05]) * 0.5)
    li = np.log(np.array([0.5, 0.5]))
    m, _ = compute_metrics(lt, li, np.array([0, 1]))
    assert m["chi2_token"] == pytest.approx((0.81 + 1.1025) / 2 - 1) and m["chi2_token"] < 0
    assert m["chi2_token_sn"] == pytest.approx(0.075**2 / 0.975**2, rel=1e-12)
    assert m["chi2_seq"] < 0 and m["chi2_seq_sn"] == pytest.approx(m["chi2_token_sn"], rel=1e-12)
    assert m["ess"] == pytest.approx(1 / (1 + m["chi2_token_sn"]), rel=1e-12)
    # equal weights: exactly 0, never a rounding residue below it
    m, _ = compute_metrics(np.full(1000, np.log(0.3)), np.full(1000, np.log(0.3 / 1.0001)), np.arange(0, 1000, 7))
    assert m["chi2_token_sn"] >= 0 and m["chi2_token_sn"] < 1e-20 and m["chi2_seq_sn"] >= 0


def test_chi2_seq_clamps_the_sequence_log_ratio():
    # One sequence with log ratio 30: exp(2*30) would dominate; clamped to 20.
    lt = np.array([-0.0, -0.0, -0.0])
    li = np.array([-10.0, -10.0, -10.0])
    m, c = compute_metrics(lt, li, np.array([0]))
    assert m["chi2_seq"] == pytest.approx(math.exp(40) - 1)
    assert c["seq_tis_clipped_share"] == 1.0


def test_seq_max_mismatch_share_counts_sequences():
    # seq A: max |dp| = 0.6; seq B: 0.1; seq C: 0.5 exactly (not above).
    lt = np.log([0.9, 0.8, 0.6, 0.75])
    li = np.log([0.3, 0.7, 0.5, 0.25])
    starts = np.array([0, 1, 3])
    m, _ = compute_metrics(lt, li, starts)
    assert m["seq_max_mismatch_gt_0_5_share"] == pytest.approx(1 / 3)
    assert m["seq_max_mismatch_gt_0_5_count"] == 1
    assert m["seq_max_mismatch_mean"] == pytest.approx((0.6 + 0.1 + 0.5) / 3)


def test_p_infer_buckets():
    p_infer = np.array([5e-6, 5e-4, 5e-4, 0.05, 0.3, 0.95, 0.995, 1.0])
    p_train = np.clip(p_infer * np.array([2, 1.5, 0.5, 1.1, 1.0, 1.0, 1.001, 1.0]), 0, 1)
    acc = MetricsAccumulator()
    acc.add(np.log(p_train), np.log(p_infer), np.array([0]), positions=np.arange(8) * 40)
    rows = acc.breakdowns()["p_infer_buckets"]
    assert [r["p_infer_lo"] for r in rows] == list(P_INFER_BUCKET_EDGES[:-1])
    assert [r["count"] for r in rows] == [1, 0, 2, 0, 1, 1, 0, 1, 2]
    bucket = rows[2]  # [1e-4, 1e-3): the two 5e-4 tokens
    deltas = np.abs(np.log(p_train[1:3]) - np.log(p_infer[1:3]))
    assert bucket["abs_delta_mean"] == pytest.approx(deltas.mean())
    assert bucket["abs_delta_p50"] == pytest.approx(np.quantile(deltas, 0.5), rel=1e-6)
    assert bucket["abs_delta_max"] == pytest.approx(deltas.max(), rel=1e-6)
    assert "abs_delta_mean" not in rows[1]
    pos_rows = acc.breakdowns()["position_buckets"]
    # positions 0,40,80,...,280 -> buckets [0,16):1, [32,64):1, [64,128):2, [128,256):3, [256,512):1
    assert [(r["position_lo"], r["count"]) for r in pos_rows] == [(0, 1), (32, 1), (64, 2), (128, 3), (256, 1)]


def test_response_length_buckets():
    lt = np.log(np.full(20, 0.5))
    li = np.log(np.full(20, 0.4))
    starts = np.array([0, 3, 10])  # lengths 3, 7, 10
    acc = MetricsAccumulator()
    acc.add(lt, li, starts)
    rows = acc.breakdowns()["response_length_buckets"]
    assert [(r["length_lo"], r["length_hi"], r["count"]) for r in rows] == [(1, 8, 2), (8, 16, 1)]
    assert rows[1]["seq_abs_log_ratio_mean"] == pytest.approx(10 * abs(math.log(0.5 / 0.4)))


def test_segment_starts():
    assert segment_starts(np.array([4, 4, 5, 5, 5, 4])).tolist() == [0, 2, 5]
    assert segment_starts(np.array([1, 1, 1, 1]), np.array([0, 0, 1, 1])).tolist() == [0, 2]
    assert segment_starts(np.zeros(0)).tolist() == []


def test_thresholds_validate():
    with pytest.raises(ValueError, match="token_tis"):
        CorrectionThresholds(token_tis=0.5)
    with pytest.raises(ValueError, match="token_mask_low"):
        CorrectionThresholds(token_mask_low=1.5)


def test_pearson_of_sequence_log_ppl_matches_numpy():
    from mismatch_probe.analysis.metrics import compute_metrics, pearson

    rng = np.random.default_rng(5)
    lt = np.log(rng.uniform(0.05, 1, 40))
    li = lt + rng.normal(0, 0.1, 40)
    starts = np.array([0, 7, 15, 22, 30, 36])
    m, _ = compute_metrics(lt, li, starts)
    ends = np.r_[starts[1:], 40]
    ppl_i = np.array([-li[a:b].mean() for a, b in zip(starts, ends)])
    ppl_t = np.array([-lt[a:b].mean() for a, b in zip(starts, ends)])
    np.testing.assert_allclose(m["pearson_log_ppl"], np.corrcoef(ppl_i, ppl_t)[0, 1], rtol=1e-12)
    assert pearson(np.array([1.0]), np.array([2.0])) is None  # one point
    assert pearson(np.array([1.0, 1.0]), np.array([2.0, 3.0])) is None  # a constant side


def test_the_k3_a_correction_keeps_by_hand():
    # two sequences: [ratio 1.5, p_train = 0] and [ratio e^0.01]; default thresholds (verl's)
    lt = np.array([math.log(0.3) + math.log(1.5), -np.inf, -1.0 + 0.01])
    li = np.array([math.log(0.3), math.log(0.2), -1.0])
    _, corr = compute_metrics(lt, li, np.array([0, 2]))
    k3 = lambda x: math.expm1(x) - x
    # the p_train = 0 token (K3 = inf) is masked by IcePop (ratio 0 < 0.5) and dropped with its
    # sequence by the worst-token rule; what they keep is finite
    assert corr["token_mask_kept_k3"] == pytest.approx((k3(math.log(1.5)) + k3(0.01)) / 2, rel=1e-12)
    assert corr["worst_token_kept_k3"] == pytest.approx(k3(0.01), rel=1e-12)
    # token TIS clips nothing here (no ratio above 2): it keeps the inf
    assert corr["token_tis_clipped_share"] == 0 and math.isinf(corr["token_tis_kept_k3"])
    # sequence TIS/MIS drop nothing (the sequence ratios are 0 and e^0.01)
    assert math.isinf(corr["seq_mis_kept_k3"])


def test_a_correction_that_keeps_nothing_has_no_k3():
    lt, li = np.array([-1.0 + 2.0]), np.array([-1.0])  # one token with ratio e^2: everything is clipped
    _, corr = compute_metrics(np.minimum(lt, 0.0), li, np.array([0]))
    assert corr["token_tis_clipped_share"] == 1.0 and corr["token_tis_kept_k3"] is None
    assert corr["seq_mis_masked_share"] == 1.0 and corr["seq_mis_kept_k3"] is None

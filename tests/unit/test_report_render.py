"""The report's pure helpers: best/worst ranking by a metric's direction, K3 placed among the
published per-GPU ranges, and the GPU type a run is grouped under."""

from __future__ import annotations

import math

from mismatch_probe.analysis.metric_docs import METRIC_DOC, k3_context, rank
from mismatch_probe.record import parse_record


def test_rank_picks_best_and_worst_by_direction():
    assert rank([3.0, 1.0, 2.0], "lower") == ({1}, {0})
    assert rank([3.0, 1.0, 2.0], "higher") == ({0}, {1})
    assert rank([-0.5, 0.1, 0.3], "zero") == ({1}, {0})
    assert rank([0.98, 1.001, 1.5], "one") == ({1}, {2})  # ratios: closest to 1 is best
    assert rank([None, 2.0, "inf", float("nan")], "lower") == ({1}, {2})
    assert rank([1.0, 1.0], "lower") == (set(), set())  # nothing to tell apart
    assert rank([1.0, None], "lower") == (set(), set())
    assert rank([1.0, 1.0, 2.0], "lower") == ({0, 1}, {2})
    assert rank([1.0, 2.0], None) == (set(), set())


def test_a_signed_chi2_estimate_is_ranked_by_its_distance_from_zero():
    """verl's chi2 is an estimate that dips below 0 near 0: the bf16 example's -6.0e-4 is worse
    than the fp32 run's 3.6e-9, not better; the self-normalized form is never negative."""
    for key in ("chi2_token", "chi2_seq"):
        assert rank([-6.0e-4, 3.6e-9], METRIC_DOC[key].better) == ({1}, {0})
        assert METRIC_DOC[f"{key}_sn"].better == "lower"


def test_k3_is_placed_among_the_published_gpu_ranges():
    assert k3_context(None) == ""
    assert "below" in k3_context(1e-5)
    assert "H20" in k3_context(5e-4) and "inside" in k3_context(5e-4)
    assert "L20" in k3_context(1e-3) and "L20" in k3_context(9.9e-3)
    assert "A100" in k3_context(1e-2)
    assert "infinite" in k3_context("inf") and "infinite" in k3_context(math.inf)


def test_a_quantized_or_fp16_rollout_is_placed_among_the_figures_published_for_it():
    assert k3_context(1e-5, "bf16") == k3_context(1e-5)  # bf16: the per-GPU ranges alone
    fp8 = k3_context(1e-3, "fp8")
    # NeMo-RL's 0.0024-0.0031 over 126 steps, xtuner's 3.7e-4 aligned / 8.7e-3 misaligned
    assert "below 0.0024–0.0031 (NeMo-RL" in fp8 and "inside 0.00037–0.0087 (xtuner" in fp8
    assert "above 0.0024–0.0031" in k3_context(0.02, "fp8") and "below 0.00037" in k3_context(1e-4, "fp8")
    assert "2510.26788" in k3_context(1e-6, "fp16")
    assert "no published K3 for int8 rollouts" in k3_context(1e-4, "int8")


def test_mean_prob_diff_is_read_against_verls_faq():
    from mismatch_probe.analysis.metric_docs import prob_diff_context

    assert prob_diff_context(None) == ""
    assert "below verl's expected 0.005" == prob_diff_context(0.0049)
    assert "above verl's expected 0.005" == prob_diff_context(0.01)
    assert "precision issue" in prob_diff_context(0.0101)


def test_the_rollout_precision_is_read_from_the_run():
    from mismatch_probe.report.labels import rollout_precision

    def record(engine: dict, quantization: dict | None = None):
        inputs = {"engine_checkpoint": "w", "engine_checkpoint_quantization": quantization} if quantization else {}
        return parse_record({"spec": {"engine": {"name": "vllm", **engine}}, "inputs": inputs})

    w8a8 = {"method": "compressed-tensors", "groups": {"g": {"weights": "int8 per channel, symmetric, static scales"}}}
    assert rollout_precision(record({"dtype": "bfloat16"}, w8a8)) == "int8"
    w4 = {"method": "compressed-tensors", "groups": {"g": {"weights": "int4 per group, groups of 128"}}}
    assert rollout_precision(record({"dtype": "bfloat16"}, w4)) == "int4"
    assert rollout_precision(record({"dtype": "bfloat16", "quantization": "fp8"})) == "fp8"
    assert rollout_precision(record({"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"})) == "fp8 KV cache"
    assert rollout_precision(record({"dtype": "float16"})) == "fp16"
    assert rollout_precision(record({"dtype": "bfloat16"})) == "bf16"


def test_gpu_type_names_the_hardware_that_ran_the_probe():
    from mismatch_probe.report.labels import gpu_type

    env = {"gpus": [{"name": "NVIDIA H20"}, {"name": "NVIDIA H20"}], "cpu_model": "Xeon"}
    assert (
        gpu_type(parse_record({"environment": env, "engine": {"platform": "cuda"}, "reference": {"device": "cuda"}}))
        == "NVIDIA H20"
    )
    assert (
        gpu_type(parse_record({"environment": env, "engine": {"device": "cuda"}, "reference": {"device": "cpu"}}))
        == "NVIDIA H20"
    )
    assert (
        gpu_type(parse_record({"environment": env, "engine": {"device": "cpu"}, "reference": {"device": "cpu"}}))
        == "CPU: Xeon"
    )
    assert gpu_type(parse_record({"environment": {"gpus": [], "cpu_model": "EPYC"}})) == "CPU: EPYC"

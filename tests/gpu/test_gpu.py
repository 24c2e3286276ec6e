"""On a CUDA GPU: the `hf` engine and the reference as a GPU run has them (the lent H100/H200 image:
torch with CUDA and transformers, no vLLM or SGLang). Every test here skips without CUDA
(tests/conftest.py); ``pytest -m gpu`` runs them on the GPU machine (benchmarks/gpu_check.sh). The
vLLM and SGLang routing tests also skip where that engine is not installed (their markers)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import DENSE, MOE, SGLANG_PYTHON, SINGLE_TURN, cli

from mismatch_probe.config.spec import EngineSpec, ReferenceSpec, SamplingSpec
from mismatch_probe.engines.base import GenerationRequest
from mismatch_probe.engines.hf import HFEngine
from mismatch_probe.environment import fingerprint
from mismatch_probe.modeling.loading import load_tokenizer, stop_token_ids
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.pipeline.determinism import engine_determinism, reference_batch_invariance
from mismatch_probe.reference.scorer import ReferenceScorer
from mismatch_probe.rollout.prompts import tokenize_prompts
from mismatch_probe.table.tokens import Rollout

pytestmark = pytest.mark.gpu
RAW = LogprobSemantics("raw")


def sampled_rollouts(model=DENSE, n: int = 16, dtype: str = "bfloat16", max_tokens: int = 48) -> list[Rollout]:
    """``n`` sequences the `hf` engine sampled on the GPU (T = 1, seed 0)."""
    tok = load_tokenizer(model)
    prompts = [p.token_ids for p in tokenize_prompts(SINGLE_TURN, tok, max_model_len=1024, max_new_tokens=max_tokens)]
    prompts = [prompts[i % len(prompts)] for i in range(n)]
    engine = HFEngine(model, EngineSpec(name="hf", dtype=dtype, device="cuda", logprobs_mode="raw"))
    sampling = SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_tokens, n=1, seed=0)
    done = engine.generate(
        [GenerationRequest(p, max_tokens) for p in prompts], sampling, stop_token_ids=stop_token_ids(model, tok), seed=0
    )
    engine.close()
    out = []
    for i, (p, c) in enumerate(zip(prompts, done)):
        ids = np.concatenate([p, c.token_ids]).astype(np.int32)
        model_token = np.r_[np.zeros(len(p), bool), np.ones(len(c.token_ids), bool)]
        turn = np.where(model_token, 0, -1).astype(np.int16)
        logp = np.r_[np.zeros(len(p)), c.logprobs].astype(np.float32)
        out.append(Rollout(i, str(i), ids, turn, model_token, logp, c.finish_reason))
    return out


def scored(scorer: ReferenceScorer, rollouts: list[Rollout]) -> np.ndarray:
    return np.concatenate([lp[r.is_model_token] for lp, r in zip(scorer.score(rollouts, RAW).logp, rollouts)])


def test_the_environment_card_names_the_gpu():
    env = fingerprint()
    gpu = env["gpus"][0]
    assert env["hardware"] == "gpu" and env["device_name"] == gpu["name"] == torch.cuda.get_device_name(0)
    assert re.fullmatch(r"\d+\.\d+", gpu["compute_capability"]) and gpu["memory_gib"] > 1
    assert env["nvidia_driver"] and re.fullmatch(r"[\d.]+", env["nvidia_driver"])
    assert env["cuda"] == torch.version.cuda


def test_the_float32_reference_on_cuda_is_the_cpu_reference():
    """float32 on CUDA is float32 (no TF32: torch's default, recorded), so the reference's log-probs
    on the GPU are the CPU's up to summation order."""
    rollouts = sampled_rollouts()
    gpu = ReferenceScorer(DENSE, ReferenceSpec(dtype="float32", device="cuda"))
    cpu = ReferenceScorer(DENSE, ReferenceSpec(dtype="float32", device="cpu"))
    numerics = gpu.info()["numerics"]
    assert numerics["tf32_matmul"] is False and numerics["float32_matmul_precision"] == "highest"
    assert "numerics" not in cpu.info()
    delta = np.abs(scored(gpu, rollouts).astype(np.float64) - scored(cpu, rollouts))
    assert delta.max() < 1e-4, delta.max()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """compare on the GPU: the `hf` engine in bfloat16 and in float16 against a float32 reference
    with a float32 LM head, the same prompts and seed."""
    out = {}
    for dtype in ("bfloat16", "float16"):
        run = tmp_path_factory.mktemp("gpu") / dtype
        proc = cli(
            *("compare", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--out", str(run)),
            *("--engine", "hf", "--engine-dtype", dtype, "--engine-device", "cuda"),
            *("--train-dtype", "float32", "--logits-fp32", "--train-device", "cuda"),
            *("--n", "4", "--max-tokens", "64", "--temperature", "1.0", "--seed", "3"),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[dtype] = json.loads((run / "run.json").read_text())
    return out


def test_bf16_engine_against_the_fp32_reference_on_cuda(runs):
    rec = runs["bfloat16"]
    assert rec["engine"]["device"] == "cuda" and rec["reference"]["device"] == "cuda"
    assert rec["environment"]["hardware"] == "gpu" and rec["environment"]["gpus"]
    assert rec["reference"]["numerics"]["tf32_matmul"] is False and rec["engine"]["numerics"]["sdpa_backends"]
    m = rec["metrics"]
    # the published bf16 ranges (docs/concepts/metrics.md, published figures); a 2-layer model sits below them
    assert 1e-7 < m["k3_kl"] < 1e-2 and 0 < m["prob_diff_max"] < 0.5
    assert rec["decode_vs_prefill"]["n_model_tokens"] == m["n_model_tokens"]


def test_float16_rollouts_mismatch_less_than_bfloat16(runs):
    """float16 keeps 10 mantissa bits to bfloat16's 7: against the same fp32 reference its K3 is
    far smaller (arXiv 2510.26788 reports an order of magnitude on real models)."""
    k3 = {dtype: rec["metrics"]["k3_kl"] for dtype, rec in runs.items()}
    assert 0 < k3["float16"] < k3["bfloat16"] / 4, k3


def test_float16_on_both_sides(tmp_path):
    proc = cli(
        *("compare", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--out", str(tmp_path / "run")),
        *("--engine", "hf", "--engine-dtype", "float16", "--train-dtype", "float16", "--logits-fp32"),
        *("--max-prompts", "16", "--n", "2", "--max-tokens", "48", "--temperature", "1.0"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert rec["engine"]["dtype"] == rec["reference"]["dtype"] == "float16"
    assert all(np.isfinite(rec["metrics"][k]) for k in ("k3_kl", "prob_diff_max", "seq_max_mismatch_mean"))
    assert rec["metrics"]["n_zero_prob_train"] == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_both_sides_repeat_themselves_on_cuda(dtype):
    """The same batch twice and the same seed twice give bitwise the same log-probs and tokens; a
    batch of another size need not (bench_determinism.py measures how far)."""
    rollouts = sampled_rollouts(n=16, dtype=dtype)
    engine = HFEngine(DENSE, EngineSpec(name="hf", dtype=dtype, device="cuda", logprobs_mode="raw"))
    sampling = SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, max_tokens=32, n=1, seed=5)
    eng = engine_determinism(engine, rollouts[:8], rollouts[8:], sampling, engine_name="hf")
    engine.close()
    assert eng["prefill"]["same_batch_twice"]["bitwise_equal_share"] == 1.0
    assert eng["same_seed"]["identical_tokens_share"] == 1.0 and eng["same_seed"]["bitwise_equal_share"] == 1.0
    scorer = ReferenceScorer(DENSE, ReferenceSpec(dtype=dtype, device="cuda", logits_fp32=True))
    ref = reference_batch_invariance(scorer, rollouts[:8], rollouts[8:], RAW)
    assert ref["same_batch_twice"]["bitwise_equal_share"] == 1.0
    assert ref["alone_vs_batched"]["max_abs_delta"] < (1e-4 if dtype == "float32" else 0.1)


def test_gpt_oss_reference_with_flex_attention_matches_eager(zoo):
    """gpt-oss's attention sinks and alternating sliding window through flex_attention (compiled
    kernels on the GPU) against the eager implementation, float32 on both."""
    model = zoo["gpt_oss"]
    rollouts = sampled_rollouts(model, n=8, dtype="float32", max_tokens=32)
    eager = ReferenceScorer(model, ReferenceSpec(dtype="float32", device="cuda", attn_implementation="eager"))
    flex = ReferenceScorer(model, ReferenceSpec(dtype="float32", device="cuda", attn_implementation="flex_attention"))
    assert flex.info()["attn_implementation"] == "flex_attention"
    delta = np.abs(scored(flex, rollouts).astype(np.float64) - scored(eager, rollouts))
    assert delta.max() < 1e-3, delta.max()


# ---- the engines' own routing (enable_return_routed_experts) ------------------------------------


def routing_run(tmp_path, engine: str, *extra: str) -> tuple[dict, str]:
    """compare on the MoE fixture (4 MoE layers, top-2 of 8) with the engine's routing recorded:
    bfloat16 rollouts against a float32 reference on the GPU."""
    run = tmp_path / engine
    proc = cli(
        *("compare", "--model", str(MOE), "--prompts", str(SINGLE_TURN), "--out", str(run)),
        *("--engine", engine, "--engine-dtype", "bfloat16", "--record-routing", *extra),
        *("--train-dtype", "float32", "--logits-fp32", "--train-device", "cuda"),
        *("--max-prompts", "16", "--n", "2", "--max-tokens", "48", "--temperature", "1.0", "--seed", "3"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run / "run.json").read_text()), (run / "report.md").read_text()


def check_routing_agreement(rec: dict, report: str) -> None:
    """The engine returned the experts behind every model token, aligned with the reference's: a
    bf16 engine against an fp32 reference keeps most tokens' expert sets in every layer (routing
    one position off would agree on about 1 token in 28, the chance two top-2-of-8 sets match)."""
    eng = rec["engine"]
    assert "routing_unavailable" not in eng, eng.get("routing_unavailable")
    assert eng["routing"] == {"moe_layers": [0, 1, 2, 3], "top_k": 2, "num_experts": 8}
    routing = rec["routing"]
    assert routing["n_tokens"] == rec["metrics"]["n_model_tokens"] > 0
    assert routing["moe_layers"] == [0, 1, 2, 3] and len(routing["set_agreement_by_layer"]) == 4
    assert min(routing["set_agreement_by_layer"]) > 0.7, routing["set_agreement_by_layer"]
    assert routing["flipped"]["n_tokens"] + routing["agreed"]["n_tokens"] == routing["n_tokens"]
    assert "MoE routing agreement" in report and "Routing agreement by layer" in report
    assert "not measured" not in report.split("MoE routing agreement", 1)[1][:400]


@pytest.mark.vllm
def test_vllm_returns_its_routed_experts_on_cuda(tmp_path):
    """vLLM's V2 model runner captures each token's experts (enable_return_routed_experts, per request
    routed_experts_prompt_start = the last prompt position); the run reports routing agreement."""
    rec, report = routing_run(tmp_path, "vllm", "--gpu-memory-utilization", "0.4")
    assert rec["engine"]["requested"]["enable_return_routed_experts"] is True
    check_routing_agreement(rec, report)


@pytest.mark.vllm
def test_vllm_without_prefix_caching_says_why_routing_is_not_measured(tmp_path):
    rec, report = routing_run(tmp_path, "vllm", "--gpu-memory-utilization", "0.4", "--no-prefix-caching")
    assert rec["engine"]["routing"] is None and "prefix caching" in rec["engine"]["routing_unavailable"]
    assert "not measured: vLLM returns routed experts only with prefix caching on" in report


@pytest.mark.sglang
def test_sglang_returns_its_routed_experts_on_cuda(tmp_path):
    """SGLang's capturer (enable_return_routed_experts; per request return_routed_experts, one
    routed_experts_start_len per batch: the shortest prompt's last position)."""
    assert SGLANG_PYTHON is not None
    rec, report = routing_run(tmp_path, "sglang", "--engine-python", SGLANG_PYTHON)
    assert rec["engine"]["requested"]["enable_return_routed_experts"] is True
    check_routing_agreement(rec, report)

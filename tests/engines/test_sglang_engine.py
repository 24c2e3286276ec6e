"""The SGLang engine for real: SGLang's own CPU engine here (the venv of tests/sglang-cpu/install.sh,
run through --engine-python as users run an engine from its own venv); the same adapter runs
SGLang's CUDA build on GPUs. What only SGLang does; what every engine does is in
test_engine_conformance.py.

The in-process tests share the session's bf16 engine (``sglang_engine``, tests/engine_fixtures.py;
a start is ~15 s on 2 cores); the CLI tests start their own, as a user's run does.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch
from conftest import DENSE, ROOT, SGLANG_PYTHON, SINGLE_TURN, cli
from engine_fixtures import CONFIGS, sglang_spec

from mismatch_probe.config.spec import EngineSpec, ProbeSpec, SamplingSpec
from mismatch_probe.engines import get_entry
from mismatch_probe.engines.process import EngineProcess
from mismatch_probe.engines.sglang import ROUTING_UNAVAILABLE_CPU, routing_refusal
from mismatch_probe.errors import ConfigError
from mismatch_probe.pipeline import compare

pytestmark = pytest.mark.sglang

SAMPLING = CONFIGS["sglang"].sampling  # T=0.7
engine_spec = sglang_spec


def probe(out, logprobs: str = "engine", top_p: float = 1.0) -> ProbeSpec:
    s = ProbeSpec(model=str(DENSE), prompts=str(SINGLE_TURN), out=str(out), max_prompts=24, shard_size=16)
    s.engine = engine_spec(logprobs_mode="processed")
    s.sampling = SamplingSpec(**{**vars(SAMPLING), "top_p": top_p, "n": 2})
    s.reference.dtype = "float32"
    s.reference.logprobs = logprobs
    return s


def test_top_p_leaves_sglang_logprobs_at_temperature_only(sglang_engine, tmp_path):
    """SGLang applies top-p to what it samples from, not to the log-probs it returns: the engine's
    semantics say so, and a reference that renormalizes over the nucleus (vLLM's processed) is
    further off than one that matches."""
    matched = compare(probe(tmp_path / "engine", top_p=0.8), engine=sglang_engine.process).record
    nucleus = compare(
        probe(tmp_path / "processed", top_p=0.8, logprobs="processed"), engine=sglang_engine.process
    ).record
    assert matched["logprob_semantics"]["engine"]["top_p"] == 1.0  # not applied to the log-probs
    assert matched["metrics"]["n_zero_prob_train"] == 0
    assert nucleus["metrics"]["abs_delta_p99"] > 2 * matched["metrics"]["abs_delta_p99"]


def compare_cli(tmp_path, *args, expect_rc: int = 0, spec_tail: str = ""):
    """probes/demo-sglang.toml, smaller, with flags on top (as a user runs it); ``spec_tail`` adds
    TOML to a copy of the spec."""
    spec = ROOT / "probes" / "demo-sglang.toml"
    if spec_tail:
        text = spec.read_text().replace('"../', f'"{ROOT}/') + "\n" + spec_tail
        spec = tmp_path / "spec.toml"
        spec.write_text(text)
    out = tmp_path / "run"
    proc = cli(
        "compare",
        str(spec),
        "--engine-python",
        SGLANG_PYTHON,
        "--out",
        str(out),
        "--max-prompts",
        "16",
        "--n",
        "2",
        "--max-tokens",
        "48",
        "--seed",
        "3",
        *args,
    )
    assert proc.returncode == expect_rc, proc.stderr[-3000:]
    return json.loads((out / "run.json").read_text()) if expect_rc == 0 else proc


def test_fp32_engine_with_raw_logprobs_matches_the_fp32_reference(tmp_path):
    """SGLang in fp32 with raw log-probs (SGLANG_RETURN_ORIGINAL_LOGPROB=1) at T=0.7: what is left is
    kernel order, and decode vs its own prefill is comparable (both raw) and just as close. Had the
    engine returned logits / T instead, k3_kl would be ~1e-2 (the matched-semantics test)."""
    rec = compare_cli(tmp_path, "--engine-dtype", "float32", "--logprobs-mode", "raw", "--temperature", "0.7")
    eng = rec["engine"]
    assert eng["dtype"] == "float32" and eng["env"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert rec["logprob_semantics"]["engine"]["mode"] == "raw" and rec["logprob_semantics"]["matched"]
    assert rec["metrics"]["k3_kl"] < 1e-8 and rec["metrics"]["prob_diff_max"] < 1e-4
    dvp = rec["decode_vs_prefill"]
    assert dvp["n_model_tokens"] == rec["metrics"]["n_model_tokens"] and dvp["k3_kl"] < 1e-8
    assert rec["engine_process"]["exit_code"] == 0 and rec["spec"]["reference"]["logits_fp32"] is True
    assert (tmp_path / "run" / "report.html").is_file()


def test_tensor_parallel_2_and_an_fp32_lm_head(tmp_path):
    """TP=2 (one core per rank on CPU), SGLang's fp32 LM head, no radix cache and an engine seed
    from [engine.extra_args], all recorded as built."""
    rec = compare_cli(
        tmp_path,
        "--tp",
        "2",
        "--engine-logits-fp32",
        "--no-prefix-caching",
        "--temperature",
        "1.0",
        spec_tail="[engine.extra_args]\nrandom_seed = 7\n",
    )
    eng = rec["engine"]
    # the engine seed is a default mismatch-probe sets, which [engine.extra_args] overrides
    assert eng["random_seed"] == 7 and eng["requested"]["random_seed"] == 7
    assert "random_seed" not in eng["defaults_applied_by_mismatch_probe"]
    assert eng["tp_size"] == 2 and eng["requested"]["tp_size"] == 2
    assert eng["enable_fp32_lm_head"] is True and eng["disable_radix_cache"] is True
    if eng["platform"] == "cpu":
        assert "SGLANG_CPU_OMP_THREADS_BIND" in eng["env"]
    m = rec["metrics"]
    assert 0 < m["k3_kl"] < 5e-4 and np.isfinite(m["prob_diff_max"])
    assert rec["decode_vs_prefill"]["n_model_tokens"] == m["n_model_tokens"]


def test_settings_sglang_cannot_honor_fail_before_sampling(tmp_path):
    """(A misspelled engine argument and one mismatch-probe sets itself: test_engine_conformance.py.)"""
    log = tmp_path / "engine.log"
    proc = compare_cli(tmp_path, "--cascade-attn", expect_rc=2)
    assert "engine 'sglang' has no setting engine.cascade_attn" in proc.stderr and "Traceback" not in proc.stderr
    if not torch.cuda.is_available():
        # SGLang's deterministic mode (and rl_on_policy_target, which implies it) needs a GPU
        # attention backend; on CPU that is SGLang's own refusal, naming the backend set for it
        for kw in ({"batch_invariant": True}, {"rl_on_policy_target": "fsdp"}):
            with pytest.raises(
                ConfigError,
                match="deterministic inference.*'torch_native'.*"
                "mismatch-probe itself set .*attention_backend='torch_native'",
            ):
                EngineProcess(get_entry("sglang"), DENSE, engine_spec(**kw), log_path=log)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of SGLang's CPU engine")
def test_quantized_rollouts_sglang_cannot_run_on_cpu_are_refused_by_name(tmp_path):
    """The exports vLLM's CPU build runs (compressed-tensors) have no CPU path in SGLang; its own
    w8a8_int8 / fp8 methods need sgl-kernel's CPU ops, absent here. Each is refused before the engine
    starts, with what it needs; on a GPU they run (the GPU tests)."""
    log = tmp_path / "engine.log"
    with pytest.raises(ConfigError, match="compressed-tensors checkpoints on CUDA only.*int8_scaled_mm"):
        EngineProcess(
            get_entry("sglang"),
            DENSE,
            engine_spec(checkpoint=str(ROOT / "fixtures/models/tiny-qwen2-w8a8")),
            log_path=log,
        )
    with pytest.raises(
        ConfigError, match="cannot run quantization 'w8a8_int8'.*torch.ops.sgl_kernel.int8_scaled_mm_with_quant"
    ):
        EngineProcess(get_entry("sglang"), DENSE, engine_spec(quantization="w8a8_int8"), log_path=log)


def test_fp16_on_both_sides(tmp_path):
    """probes/precision.toml's fp16 level with SGLang: the engine runs float16 (read back from its
    server info), the reference too, and the mismatch sits well below bf16's."""
    rec = compare_cli(tmp_path, "--engine-dtype", "float16", "--train-dtype", "float16")
    assert rec["engine"]["dtype"] == "float16" and rec["spec"]["reference"]["dtype"] == "float16"
    assert 0 < rec["metrics"]["k3_kl"] < 1e-5


def test_moe_routing_and_the_r3_what_if_from_sglang(tmp_path):
    """An MoE checkpoint (the family suite's tiny Qwen3-MoE, untied: SGLang 0.5.23's
    Qwen3MoeForCausalLM ignores tie_word_embeddings, docs/engine-findings/) sampled once by SGLang in
    float32 with its routed experts (on CPU through tests/sglang-cpu's unpinned capture buffer,
    recorded as a workaround), scored twice: by the float32 reference, which routes every token as
    the engine did and leaves the R3 what-if nothing to close; then, from the same rollouts, by a
    bfloat16 reference, where some tokens route differently and forcing the engine's experts
    (R3) takes their K3 down by two orders of magnitude (measured on 2 CPU cores: 13 of 472 tokens
    flip, their K3 5.6e-2 -> 1.4e-4)."""
    import tiny_models

    model = tiny_models.build("qwen3_moe", tmp_path / "tiny-qwen3-moe", tie_word_embeddings=False)
    spec = ROOT / "probes" / "demo-sglang.toml"
    common = ["--model", str(model), "--engine-python", SGLANG_PYTHON, "--max-prompts", "8", "--n", "2"]
    common += ["--max-tokens", "32", "--seed", "3", "--engine-dtype", "float32"]
    runs = {}
    for name, extra in (
        ("fp32", []),
        ("bf16", ["--train-dtype", "bfloat16", "--rollouts-from", str(tmp_path / "fp32")]),
    ):
        proc = cli("compare", str(spec), "--out", str(tmp_path / name), *common, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((tmp_path / name / "run.json").read_text())

    same, flips = runs["fp32"], runs["bf16"]
    eng = same["engine"]
    assert eng["routing"] == {"moe_layers": [0, 1], "top_k": 2, "num_experts": 8}
    assert "routing_unavailable" not in eng and eng["requested"]["enable_return_routed_experts"] is True
    if eng["platform"] == "cpu":
        assert "unpinned" in eng["workarounds"]["routed_experts_host_buffer_unpinned_on_cpu"]["what"]
    for rec in (same, flips):
        assert rec["reference"]["routing_replay"] == "the engine's experts forced (R3)"
        routing = rec["routing"]
        assert routing["n_tokens"] == rec["metrics"]["n_model_tokens"] > 100
        assert len(routing["set_agreement_by_layer"]) == 2 and routing["replay"]["n_tokens"] == routing["n_tokens"]
        report = (tmp_path / ("fp32" if rec is same else "bf16") / "report.md").read_text()
        assert "## MoE routing agreement" in report and "## Routing replay (R3) what-if" in report

    # float32 against float32: the same experts for every token, so replay changes nothing
    r = same["routing"]
    exact = eng["platform"] == "cpu"
    assert r["set_agreement_by_layer"] == [1.0, 1.0] if exact else min(r["set_agreement_by_layer"]) > 0.98
    if exact:
        assert r["tokens_with_flip_share"] == 0 and r["replay"]["flipped"]["n_tokens"] == 0
        assert r["replay"]["k3_replayed"] == pytest.approx(r["replay"]["k3_free"], rel=1e-6, abs=1e-12)
    assert same["metrics"]["k3_kl"] < 1e-8

    # a bfloat16 reference on the same tokens: some route differently, and R3 closes most of their gap
    r = flips["routing"]
    assert flips["engine"]["routing"] == eng["routing"]  # the engine's experts came with the rollouts
    assert r["flipped"]["n_tokens"] > 0 and min(r["set_agreement_by_layer"]) < 1.0
    flipped = r["replay"]["flipped"]
    assert flipped["n_tokens"] == r["flipped"]["n_tokens"]
    assert flipped["k3_replayed"] < 0.1 * flipped["k3_free"]
    assert r["replay"]["k3_replayed"] < r["replay"]["k3_free"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="SGLang's CPU engine")
def test_the_adapter_reads_whether_sglang_can_capture_routing_on_cpu():
    """In the SGLang venv: the stock capture buffer (cudaHostRegister) fails on this torch as the
    refusal says, and the adapter sees it; with tests/sglang-cpu's hook the same buffer is allocated
    unpinned and the adapter asks for routing."""
    code = """
import json, sys
import mismatch_probe_sglang_cpu as hook
sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, hook._AfterCapturer)]  # stock SGLang
from mismatch_probe.engines.sglang import cpu_capture_allocator
stock = cpu_capture_allocator()
from sglang.srt.state_capturer import base
try:
    base.BaseHostCache(8, 2, 2, name="t", device="cpu")
    died = None
except Exception as exc:
    died = f"{type(exc).__name__}: {exc}"
hook.patch_capturer(base)
buffer = base.BaseHostCache(8, 2, 2, name="t", device="cpu").buffer
print(json.dumps({"stock": stock, "died": died, "patched": cpu_capture_allocator(),
                  "buffer": [list(buffer.shape), str(buffer.dtype), buffer.is_pinned(), int(buffer.abs().sum())]}))
"""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    proc = subprocess.run([SGLANG_PYTHON, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["stock"] == "host_register" and got["died"] == "AssertionError: Torch not compiled with CUDA enabled"
    assert got["patched"] == "unpinned" and got["buffer"] == [[8, 2, 2], "torch.int32", False, 0]
    spec = EngineSpec(name="sglang")
    known = {"enable_return_routed_experts"}
    assert (
        routing_refusal(spec, device="cpu", version="0.5.23", known=known, cpu_allocator=got["stock"])
        == ROUTING_UNAVAILABLE_CPU
    )
    assert routing_refusal(spec, device="cpu", version="0.5.23", known=known, cpu_allocator=got["patched"]) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="SGLang's CPU engine")
def test_the_engine_records_its_cpu_kernels(sglang_engine):
    """SGLang's CPU engine takes its AMX backend (sgl-kernel's packed GEMMs) only where the CPU has
    AMX tiles and sgl-kernel was built with it: the run record says which, with the attention backend
    mismatch-probe starts it with."""
    kernels = sglang_engine.process.info()["kernels"]
    assert set(kernels) == {"amx", "attention"} and kernels["attention"] == "torch_native", kernels
    assert isinstance(kernels["amx"], bool) and (kernels["amx"] <= torch.cpu._is_amx_tile_supported()), kernels

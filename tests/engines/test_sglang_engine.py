"""The SGLang engine for real: SGLang's own CPU engine here (the venv of tests/sglang-cpu/install.sh,
run through --engine-python as users run an engine from its own venv); the same adapter runs
SGLang's CUDA build on GPUs. What only SGLang does; what every engine does is in
test_engine_conformance.py.

The in-process tests share the session's bf16 engine (``sglang_engine``, tests/engine_fixtures.py;
a start is ~15 s on 2 cores); the CLI tests start their own, as a user's run does.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import DENSE, ROOT, SGLANG_PYTHON, SINGLE_TURN, cli
from engine_fixtures import CONFIGS, sglang_spec

from mismatch_probe.config.spec import ProbeSpec, SamplingSpec
from mismatch_probe.engines import get_entry
from mismatch_probe.engines.process import EngineProcess
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

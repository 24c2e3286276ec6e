"""The SGLang engine for real: SGLang's own CPU engine here (the venv of tests/sglang-cpu/install.sh,
run through --engine-python as users run an engine from its own venv); the same adapter runs
SGLang's CUDA build on GPUs.

One bf16 engine per module for the in-process tests (a start is ~15 s on 2 cores); the CLI tests
start their own, as a user's run does.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from conftest import DENSE, MULTI_TURN, ROOT, SGLANG_PYTHON, SINGLE_TURN, check_first_and_later_turns, cli
from reference_checks import check_engine_prefill_against_independent

from mismatch_probe.config.spec import EngineSpec, ProbeSpec, SamplingSpec
from mismatch_probe.engines import GenerationRequest, get_entry
from mismatch_probe.engines.process import EngineProcess
from mismatch_probe.errors import ConfigError
from mismatch_probe.pipeline import run_compare

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SAMPLING = SamplingSpec(temperature=0.7, top_p=1.0, top_k=0, max_tokens=48, seed=5)


def engine_spec(**kw) -> EngineSpec:
    return EngineSpec(**{"name": "sglang", "python": SGLANG_PYTHON, "dtype": "bfloat16", **kw})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A bf16 engine with SGLang's default log-probs (processed: log_softmax(logits / T))."""
    log = tmp_path_factory.mktemp("sglang") / "engine.log"
    eng = EngineProcess(get_entry("sglang"), DENSE, engine_spec(logprobs_mode="processed"), log_path=log)
    yield eng
    eng.close()


def probe(out, logprobs: str = "engine", top_p: float = 1.0) -> ProbeSpec:
    s = ProbeSpec(model=str(DENSE), prompts=str(SINGLE_TURN), out=str(out), max_prompts=24, shard_size=16)
    s.engine = engine_spec(logprobs_mode="processed")
    s.sampling = SamplingSpec(**{**vars(SAMPLING), "top_p": top_p, "n": 2})
    s.reference.dtype = "float32"
    s.reference.logprobs = logprobs
    return s


def test_the_engine_runs_in_its_own_venv_and_says_what_it_built(engine):
    info = engine.info()
    assert "sglang" not in sys.modules  # the parent never imports the engine
    assert info["engine"] == "sglang" and info["versions"]["sglang"]
    assert info["dtype"] == "bfloat16" and info["tp_size"] == 1 and info["requested"]["skip_tokenizer_init"] is True
    assert info["logprobs_mode"] == "processed" and info["env"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"
    assert info["random_seed"] == 0 and info["defaults_applied_by_mismatch_probe"]["random_seed"] == 0
    if info["platform"] == "cpu":
        # the CPU fallback: SGLang's own CPU engine with its torch-native kernels and a KV-cache cap
        assert info["env"]["SGLANG_USE_CPU_ENGINE"] == "1" and info["attention_backend"] == "torch_native"
        assert info["max_total_num_tokens"] <= info["defaults_applied_by_mismatch_probe"]["max_total_tokens"]
        assert info["per_request_seeds"] is False and "sampling_seed" in info["per_request_seeds_off_because"]


def test_matched_logprob_semantics_sit_at_the_dtype_floor(engine, tmp_path):
    """At T=0.7 SGLang returns log_softmax(logits / T). A reference scoring that distribution sits
    at the bf16-vs-fp32 floor; one scoring raw logits (a trainer that forgot the temperature) is far
    off, although nothing about the engine changed."""
    matched = run_compare(probe(tmp_path / "matched"), engine=engine).record
    raw = run_compare(probe(tmp_path / "raw", logprobs="raw"), engine=engine).record

    sem = matched["logprob_semantics"]
    assert sem["matched"] is True and raw["logprob_semantics"]["matched"] is False
    assert sem["engine"] == {
        "mode": "processed",
        "temperature": 0.7,
        "top_k": 0,
        "top_p": 1.0,
        "distribution": "log_softmax(logits / temperature)",
    }
    k3_matched, k3_raw = matched["metrics"]["k3_kl"], raw["metrics"]["k3_kl"]
    assert 0 < k3_matched < 5e-4, (k3_matched, k3_raw)
    assert k3_raw > 20 * k3_matched, (k3_matched, k3_raw)
    # processed (T != 1) log-probs cannot be compared with SGLang's raw prefill log-probs: said, not faked
    assert "not comparable" in matched["decode_vs_prefill"]["skipped"]


def test_top_p_leaves_sglang_logprobs_at_temperature_only(engine, tmp_path):
    """SGLang applies top-p to what it samples from, not to the log-probs it returns: the engine's
    semantics say so, and a reference that renormalizes over the nucleus (vLLM's processed) is
    further off than one that matches."""
    matched = run_compare(probe(tmp_path / "engine", top_p=0.8), engine=engine).record
    nucleus = run_compare(probe(tmp_path / "processed", top_p=0.8, logprobs="processed"), engine=engine).record
    assert matched["logprob_semantics"]["engine"]["top_p"] == 1.0  # not applied to the log-probs
    assert matched["metrics"]["n_zero_prob_train"] == 0
    assert nucleus["metrics"]["abs_delta_p99"] > 2 * matched["metrics"]["abs_delta_p99"]


def test_sampled_tokens_carry_their_own_logprobs(engine):
    prompts = [np.array([1, 7, 80 + k, 90], np.int32) for k in range(6)]
    outs = engine.generate([GenerationRequest(p, 24) for p in prompts], SAMPLING, stop_token_ids=[2], seed=1)
    assert len(outs) == len(prompts)
    for c in outs:
        assert len(c.logprobs) == len(c.token_ids) and np.all(c.logprobs <= 0) and np.isfinite(c.logprobs).all()
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == 2  # the stop token is part of the response
        else:
            assert len(c.token_ids) == 24


def test_prefill_scores_the_given_tokens_not_the_sampled_ones(engine):
    """Prefill log-probs (logprob_start_len) of arbitrary, never sampled sequences agree with an fp32
    HF forward to bf16 precision, position by position from each request's start."""
    check_engine_prefill_against_independent(engine, starts=[4, 10, 1])


def test_multi_turn_tool_use_continues_from_token_ids(engine, tmp_path):
    """SGLang continues each conversation from its exact ids across calculator turns (tool outputs
    spliced in as tokens, never re-tokenized); later turns are scored like the first."""
    s = probe(tmp_path / "mt")
    s.prompts, s.max_turns, s.max_prompts = str(MULTI_TURN), 4, 16
    rec = run_compare(s, engine=engine).record
    check_first_and_later_turns(rec)
    assert rec["tokenization_check"]["n_checked"] > 0


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
    log = tmp_path / "engine.log"
    with pytest.raises(ConfigError, match="has no argument 'disable_radx_cache'.*disable_radix_cache"):
        EngineProcess(get_entry("sglang"), DENSE, engine_spec(extra_args={"disable_radx_cache": True}), log_path=log)
    with pytest.raises(ConfigError, match="sets 'tp_size', which mismatch-probe sets itself"):
        EngineProcess(
            get_entry("sglang"), DENSE, engine_spec(tensor_parallel_size=2, extra_args={"tp_size": 2}), log_path=log
        )
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

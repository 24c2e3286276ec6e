"""The vLLM engine for real (the CPU build here; the same adapter runs the CUDA build on GPUs).

One engine per module where the tests can share it (an engine start is ~40-80 s on 2 cores);
the CLI tests start their own, as a user's run does.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import DENSE, MOE, SINGLE_TURN, cli
from reference_checks import check_engine_prefill_against_independent

from mismatch_probe.config.spec import EngineSpec, ProbeSpec, SamplingSpec
from mismatch_probe.engines import GenerationRequest, get_entry
from mismatch_probe.engines.process import EngineProcess
from mismatch_probe.errors import ConfigError
from mismatch_probe.pipeline import run_compare

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# No memory settings: on vLLM's CPU build mismatch-probe sizes the KV cache itself (what the run
# needs, capped by the NUMA node's free memory), which is what these tests rely on.
SAMPLING = SamplingSpec(temperature=0.7, top_p=0.9, top_k=0, max_tokens=48, seed=5)


def dense_engine_spec(**kw) -> EngineSpec:
    return EngineSpec(name="vllm", dtype="bfloat16", logprobs_mode="processed", enforce_eager=True, **kw)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A dense bf16 engine with processed log-probs, shared by this module's tests."""
    log = tmp_path_factory.mktemp("vllm") / "engine.log"
    eng = EngineProcess(get_entry("vllm"), DENSE, dense_engine_spec(extra_args={"seed": 11}), log_path=log)
    yield eng
    eng.close()


def probe(out, top_p: float = SAMPLING.top_p, logprobs: str = "engine") -> ProbeSpec:
    s = ProbeSpec(model=str(DENSE), prompts=str(SINGLE_TURN), out=str(out), max_prompts=24, shard_size=16)
    s.engine = dense_engine_spec()
    s.sampling = SamplingSpec(**{**vars(SAMPLING), "top_p": top_p, "n": 2})
    s.reference.dtype = "float32"
    s.reference.logprobs = logprobs
    return s


def test_parent_process_never_imports_vllm(engine):
    assert engine.info()["engine"] == "vllm"
    assert "vllm" not in sys.modules
    # the engine seed (what the CPU build samples from) is mismatch-probe's 0 unless extra_args set it
    assert engine.info()["requested"]["seed"] == 11


def test_matched_logprob_semantics_sit_at_the_dtype_floor(engine, tmp_path):
    """At T=0.7 vLLM returns processed log-probs (of logits / T). A reference scoring the same
    distribution sits at the bf16-vs-fp32 floor; one scoring raw logits (a trainer that forgot the
    temperature) is far off, although nothing about the engine changed."""
    matched = run_compare(probe(tmp_path / "matched", top_p=1.0), engine=engine).record
    raw = run_compare(probe(tmp_path / "raw", top_p=1.0, logprobs="raw"), engine=engine).record

    assert matched["logprob_semantics"]["matched"] is True and raw["logprob_semantics"]["matched"] is False
    assert matched["logprob_semantics"]["engine"]["mode"] == "processed"
    k3_matched, k3_raw = matched["metrics"]["k3_kl"], raw["metrics"]["k3_kl"]
    assert 0 < k3_matched < 5e-4, (k3_matched, k3_raw)
    assert k3_raw > 20 * k3_matched, (k3_matched, k3_raw)
    if matched["engine"]["per_request_seeds"]:  # same seeds, same engine: the very same samples
        assert matched["metrics"]["n_model_tokens"] == raw["metrics"]["n_model_tokens"]
    # processed (T != 1) log-probs cannot be compared with raw prefill log-probs: said, not faked
    assert "not comparable" in matched["decode_vs_prefill"]["skipped"]


def test_top_p_semantics_and_the_nucleus_boundary(engine, tmp_path):
    """With top-p the processed distributions match too, except that a token inside bf16's nucleus
    can fall just outside fp32's: the reference then gives it probability 0 (logp_train = -inf),
    counted in n_zero_prob_train rather than hidden."""
    runs = {
        name: run_compare(probe(tmp_path / name, logprobs=name), engine=engine).record["metrics"]
        for name in ("engine", "raw", "temperature")
    }
    p99 = {name: m["abs_delta_p99"] for name, m in runs.items()}
    assert p99["engine"] < 0.1 and p99["raw"] > 5 * p99["engine"] and p99["temperature"] > p99["engine"], p99
    assert runs["raw"]["n_zero_prob_train"] == 0 and runs["temperature"]["n_zero_prob_train"] == 0
    assert runs["engine"]["n_zero_prob_train"] <= 0.01 * runs["engine"]["n_model_tokens"]


def test_sampled_tokens_carry_their_own_logprobs(engine):
    prompts = [np.array([1, 7, 80 + k, 90], np.int32) for k in range(6)]
    requests = [GenerationRequest(p, 24) for p in prompts]
    a = engine.generate(requests, SAMPLING, stop_token_ids=[2], seed=1)
    b = engine.generate(requests, SAMPLING, stop_token_ids=[2], seed=1)
    c = engine.generate(requests, SAMPLING, stop_token_ids=[2], seed=2)
    seeded = engine.info()["per_request_seeds"]
    for x, y, p in zip(a, b, prompts):
        if seeded:
            assert np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.logprobs, y.logprobs)
        assert np.array_equal(x.prompt_token_ids, p)
        assert len(x.logprobs) == len(x.token_ids) and np.all(x.logprobs <= 0)
        assert x.finish_reason in ("stop", "length")
        if x.finish_reason == "stop":
            assert x.token_ids[-1] == 2  # the stop token is part of the response
        else:
            assert len(x.token_ids) == 24
    if seeded:
        assert any(not np.array_equal(x.token_ids, z.token_ids) for x, z in zip(a, c))
    else:  # vLLM's CPU build: a known engine limitation, stated in run.json
        assert "CPU Generator does not use offset" in engine.info()["per_request_seeds_off_because"]


def test_prefill_scores_the_given_tokens_not_the_sampled_ones(engine):
    """Prefill log-probs of arbitrary (never sampled) sequences agree with an fp32 HF forward to
    bf16 precision: the engine really re-runs the sequence."""
    check_engine_prefill_against_independent(engine, starts=[4, 10, 2])


def test_unsupported_settings_fail_loudly(tmp_path):
    log = tmp_path / "engine.log"
    with pytest.raises(ConfigError, match="batch-invariant mode .* runs on CPU"):
        EngineProcess(get_entry("vllm"), DENSE, dense_engine_spec(batch_invariant=True), log_path=log)
    with pytest.raises(ConfigError, match="no cascade attention"):
        EngineProcess(get_entry("vllm"), DENSE, dense_engine_spec(cascade_attn=True), log_path=log)
    with pytest.raises(ConfigError, match="has no argument 'enable_prefx_caching'.*enable_prefix_caching"):
        EngineProcess(
            get_entry("vllm"), DENSE, dense_engine_spec(extra_args={"enable_prefx_caching": True}), log_path=log
        )


def compare_cli(tmp_path, *args):
    out = tmp_path / "run"
    proc = cli(
        "compare",
        "--engine",
        "vllm",
        "--prompts",
        str(SINGLE_TURN),
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
        "--enforce-eager",
        *args,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "run.json").read_text())


def test_fp32_engine_matches_fp32_reference(tmp_path):
    """vLLM in fp32 against the fp32 reference: what is left is kernel order, far below bf16's."""
    rec = compare_cli(tmp_path, "--model", str(DENSE), "--engine-dtype", "float32", "--train-dtype", "float32")
    assert rec["engine"]["dtype"] == "float32"
    assert rec["metrics"]["k3_kl"] < 1e-8 and rec["metrics"]["prob_diff_max"] < 1e-3
    dvp = rec["decode_vs_prefill"]
    assert dvp["n_model_tokens"] == rec["metrics"]["n_model_tokens"] and dvp["k3_kl"] < 1e-8


def test_flags_only_run_sizes_the_kv_cache_itself(tmp_path):
    """No memory flag: vLLM's CPU default (0.92 of the NUMA node) need not be free; mismatch-probe
    gives it what the run needs, capped by what the node has free, and records the choice."""
    out = tmp_path / "run"
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--engine",
        "vllm",
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(out),
        "--max-prompts",
        "4",
        "--max-tokens",
        "16",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    eng = json.loads((out / "run.json").read_text())["engine"]
    sizing = eng["kv_cache_sizing"]
    assert (
        eng["kv_cache_memory_bytes"]
        == sizing["kv_cache_memory_bytes"]
        == min(sizing["needed_bytes"], sizing["cap_bytes"])
    )
    # the fixture: 4 layers x 2 KV heads x head_dim 64 x K and V x 2 bytes (bf16 checkpoint)
    assert sizing["bytes_per_token"] == 4 * 2 * 64 * 2 * 2
    assert sizing["cap_bytes"] < sizing["node_available_bytes"]


def test_a_memory_refusal_names_mismatch_probes_own_settings(tmp_path):
    """All of the node's memory cannot be free: vLLM refuses, and the message says which of our
    flags and spec keys size its memory (vLLM's own message names only vLLM's)."""
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--engine",
        "vllm",
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(tmp_path / "run"),
        "--max-prompts",
        "2",
        "--max-tokens",
        "8",
        "--gpu-memory-utilization",
        "1.0",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "less than desired CPU memory utilization" in proc.stderr
    assert "--kv-cache-memory-bytes N (engine.kv_cache_memory_bytes)" in proc.stderr
    assert "engine.gpu_memory_utilization" in proc.stderr and "Traceback" not in proc.stderr


def test_moe_at_tensor_parallel_2(tmp_path):
    rec = compare_cli(tmp_path, "--model", str(MOE), "--tp", "2", "--train-dtype", "float32")
    eng = rec["engine"]
    assert eng["tensor_parallel_size"] == 2 and eng["dtype"] == "bfloat16" and eng["platform"] == "cpu"
    assert eng["requested"]["tensor_parallel_size"] == 2
    assert "VLLM_CPU_OMP_THREADS_BIND" in eng["env"]
    m = rec["metrics"]
    assert all(np.isfinite(m[k]) for k in ("k3_kl", "prob_diff_max", "seq_max_mismatch_mean"))
    assert 0 < m["k3_kl"] < 0.05
    assert rec["decode_vs_prefill"]["n_model_tokens"] == m["n_model_tokens"]
    assert rec["engine_process"]["exit_code"] == 0
    assert set(rec["timings"]) >= {"engine_start_s", "generation_s", "prefill_s", "scoring_s", "metrics_s", "report_s"}


def test_multi_turn_tool_use_continues_from_token_ids(engine, tmp_path):
    """vLLM continues each conversation from its exact ids across tool turns; later turns are scored.
    32 conversations of 100+ tokens exceed one step's token budget, so chunked prefill splits prompts
    (the case that kills per-request seeded sampling on vLLM's CPU build)."""
    from conftest import MULTI_TURN, check_first_and_later_turns

    s = probe(tmp_path / "mt", top_p=1.0)
    s.prompts, s.max_turns, s.max_prompts = str(MULTI_TURN), 4, 32
    rec = run_compare(s, engine=engine).record
    check_first_and_later_turns(rec)


@pytest.mark.distributed
def test_parallelism_probe_scores_vllm_tp2_rollouts_in_three_training_layouts(tmp_path):
    """probes/parallelism-tp2.toml: vLLM samples at TP=2 once; references at TP=2, SP=2 and TP=1
    (bf16, as learners run) score those same tokens."""
    from conftest import ROOT, token_rows

    out = tmp_path / "study"
    proc = cli(
        "compare", str(ROOT / "probes" / "parallelism-tp2.toml"), "--out", str(out), "--max-prompts", "8", "--n", "2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    layouts = {"learner-tp2": (1, 2), "learner-sp2": (2, 1), "learner-tp1": (1, 1)}
    logp = {}
    for name, (sp, tp) in layouts.items():
        rec = json.loads((out / name / "run.json").read_text())
        assert rec["engine"]["tensor_parallel_size"] == 2
        ref = rec["reference"]
        assert (ref["sequence_parallel_size"], ref["tensor_parallel_size"], ref["dtype"]) == (sp, tp, "bfloat16")
        assert 0 < rec["metrics"]["k3_kl"] < 0.05
        logp[name] = token_rows(out / name, model_only=True).column("logp_train").to_numpy().astype(np.float64)
    assert len({len(v) for v in logp.values()}) == 1
    tp_gap = np.abs(logp["learner-tp2"] - logp["learner-tp1"])
    sp_gap = np.abs(logp["learner-sp2"] - logp["learner-tp1"])
    assert tp_gap.mean() > 1e-4 and sp_gap.max() <= tp_gap.max() / 10
    assert "All runs score the same rollouts" in (out / "compare.html").read_text()

"""What every engine adapter must do, checked on each real engine: hf, vLLM (its CPU build here) and
SGLang (its CPU engine from .venv-sglang); the same adapters run the CUDA builds on GPUs.

Each engine is started once per session (tests/engine_fixtures.py) and shared by these tests and
its engine-specific ones (tests/engines/test_<engine>_engine.py). Where engines legitimately
differ (what their info records, the requests' seeding on CPU), the difference is written down
per engine below, not skipped.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import DENSE, MULTI_TURN, SINGLE_TURN, check_first_and_later_turns
from engine_fixtures import CONFIGS, FIRST_PROMPTS, SharedEngine, first_batch
from reference_checks import check_engine_prefill_against_independent

from mismatch_probe.config.spec import ProbeSpec, SamplingSpec
from mismatch_probe.engines import BUILTIN_ENGINES, GenerationRequest, get_entry
from mismatch_probe.engines.process import EngineProcess
from mismatch_probe.errors import ConfigError
from mismatch_probe.pipeline import compare

# every built-in engine (the registry's) runs this suite, but for the ones named here with where
# they are tested instead; a new built-in engine needs its marks here (and a shared engine in
# tests/engine_fixtures.py: CONFIGS), or the suite fails to collect
MARKS = {"hf": (), "vllm": (pytest.mark.vllm,), "sglang": (pytest.mark.sglang,)}
ELSEWHERE = {"remote": "a running server's: tests/engines/test_remote_servers.py, against real vLLM and SGLang servers"}
ENGINES = [pytest.param(name, marks=MARKS[name], id=name) for name in BUILTIN_ENGINES if name not in ELSEWHERE]


def test_every_builtin_engine_runs_the_suite():
    assert set(BUILTIN_ENGINES) == set(MARKS) | set(ELSEWHERE)
    assert set(MARKS) == set(CONFIGS)  # each has its shared engine


@pytest.fixture(params=ENGINES)
def engine(request) -> SharedEngine:
    """The session's shared engine (started once, by whichever test asks for it first)."""
    return request.getfixturevalue(f"{request.param}_engine")


# prompts per probe run: the hf engine samples in Python, one step for the whole batch at a time
PROBE_PROMPTS = {"hf": 8, "vllm": 24, "sglang": 24}


def probe(engine: SharedEngine, out, *, top_p: float = 1.0, logprobs: str = "engine") -> ProbeSpec:
    s = ProbeSpec(
        model=str(DENSE), prompts=str(SINGLE_TURN), out=str(out), max_prompts=PROBE_PROMPTS[engine.name], shard_size=16
    )
    s.engine = engine.config.spec(**engine.config.probe)
    s.sampling = SamplingSpec(**{**vars(engine.config.sampling), "top_p": top_p, "n": 2})
    s.reference.dtype = "float32"
    s.reference.logprobs = logprobs
    return s


# ---- engine info: the settings it was built with, read back ------------------------------------


def _vllm_info(info):
    # the engine seed (what the CPU build samples from) is mismatch-probe's 0 unless extra_args set it
    assert info["requested"]["seed"] == 11


def _sglang_info(info):
    assert info["versions"]["sglang"]
    assert info["tp_size"] == 1 and info["requested"]["skip_tokenizer_init"] is True
    assert info["logprobs_mode"] == "processed" and info["env"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"
    assert info["random_seed"] == 0 and info["defaults_applied_by_mismatch_probe"]["random_seed"] == 0
    if info["platform"] == "cpu":
        # the CPU fallback: SGLang's own CPU engine with its torch-native kernels and a KV-cache cap
        assert info["env"]["SGLANG_USE_CPU_ENGINE"] == "1" and info["attention_backend"] == "torch_native"
        assert info["max_total_num_tokens"] <= info["defaults_applied_by_mismatch_probe"]["max_total_tokens"]
        assert info["per_request_seeds"] is False and "sampling_seed" in info["per_request_seeds_off_because"]


def _hf_info(info):
    assert info["logprobs_mode"] == "processed" and info["versions"]["transformers"]


INFO_CHECKS = {"vllm": _vllm_info, "sglang": _sglang_info, "hf": _hf_info}


def test_engine_info_reads_back_its_settings(engine):
    info = engine.process.info()
    assert info["engine"] == engine.name and info["dtype"] == "bfloat16"
    # the parent never imports an engine library: each runs in its worker (SGLang in its own venv)
    assert "vllm" not in sys.modules and "sglang" not in sys.modules
    INFO_CHECKS[engine.name](info)


# ---- log-prob semantics: matched vs raw --------------------------------------------------------

# the distribution each engine's processed log-probs are of, at T=0.7 without top-k/top-p
SEMANTICS = {
    "sglang": {
        "mode": "processed",
        "temperature": 0.7,
        "top_k": 0,
        "top_p": 1.0,
        "distribution": "log_softmax(logits / temperature)",
    }
}


def test_matched_logprob_semantics_sit_at_the_dtype_floor(engine, tmp_path):
    """At T=0.7 the engine returns processed log-probs (of logits / T). A reference scoring the same
    distribution sits at the bf16-vs-fp32 floor; one scoring raw logits (a trainer that forgot the
    temperature) is far off, although nothing about the engine changed."""
    matched = compare(probe(engine, tmp_path / "matched"), engine=engine.process).record
    raw = compare(probe(engine, tmp_path / "raw", logprobs="raw"), engine=engine.process).record

    sem = matched["logprob_semantics"]
    assert sem["matched"] is True and raw["logprob_semantics"]["matched"] is False
    assert sem["engine"]["mode"] == "processed"
    if engine.name in SEMANTICS:
        assert sem["engine"] == SEMANTICS[engine.name]
    k3_matched, k3_raw = matched["metrics"]["k3_kl"], raw["metrics"]["k3_kl"]
    assert 0 < k3_matched < 5e-4, (k3_matched, k3_raw)
    assert k3_raw > 20 * k3_matched, (k3_matched, k3_raw)
    if matched["engine"].get("per_request_seeds", True):  # same seeds, same engine: the very same samples
        assert matched["metrics"]["n_model_tokens"] == raw["metrics"]["n_model_tokens"]
    # processed (T != 1) log-probs cannot be compared with raw prefill log-probs: said, not faked
    assert "not comparable" in matched["decode_vs_prefill"]["skipped"]


# ---- sampling: tokens, their log-probs, stopping, seeds ------------------------------------------

# why an engine's build cannot seed each request (then it samples from its engine seed)
NO_REQUEST_SEEDS_BECAUSE = {"vllm": "CPU Generator does not use offset", "sglang": "sampling_seed"}


def test_sampled_tokens_carry_their_own_logprobs(engine):
    sampling = engine.config.sampling
    requests = [GenerationRequest(p, 24) for p in FIRST_PROMPTS]
    a = engine.first  # seed 1, sampled right after the start
    b = engine.process.generate(requests, sampling, stop_token_ids=[2], seed=1)
    c = engine.process.generate(requests, sampling, stop_token_ids=[2], seed=2)
    assert len(a) == len(FIRST_PROMPTS)
    info = engine.process.info()
    seeded = info.get("per_request_seeds", True)
    for x, y, p in zip(a, b, FIRST_PROMPTS):
        if seeded:
            assert np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.logprobs, y.logprobs)
        if x.prompt_token_ids is not None or engine.name == "vllm":  # hf does not echo the prompt's ids
            assert np.array_equal(x.prompt_token_ids, p)
        assert len(x.logprobs) == len(x.token_ids) and np.all(x.logprobs <= 0) and np.isfinite(x.logprobs).all()
        assert x.finish_reason in ("stop", "length")
        if x.finish_reason == "stop":
            assert x.token_ids[-1] == 2  # the stop token is part of the response
        else:
            assert len(x.token_ids) == 24
    if seeded:
        assert any(not np.array_equal(x.token_ids, z.token_ids) for x, z in zip(a, c))
    else:  # a known limitation of the engine's CPU build, stated in run.json
        assert NO_REQUEST_SEEDS_BECAUSE[engine.name] in info["per_request_seeds_off_because"]


def test_a_fresh_engine_with_the_same_seeds_samples_the_same_tokens(engine, tmp_path):
    """Determinism on this machine: a second engine started with the same settings samples the same
    first batch, token for token and log-prob for log-prob (engines that seed each request: hf; vLLM
    and SGLang on CPU seed the engine only, see the skips)."""
    if engine.name == "sglang" and not engine.process.info()["per_request_seeds"]:
        pytest.skip("SGLang's CPU engine seeds no request and its run-to-run repeatability is not established")
    if engine.name == "vllm" and not engine.process.info()["per_request_seeds"]:
        # measured in this suite: a second vLLM CPU engine (TP=1, the same engine seed 11) started
        # beside the first sampled another first batch from its very first token (306 vs 359);
        # sequential runs of the whole probe at TP=1 did repeat. Until that is understood, only engines
        # that seed each request are held to token-for-token repeatability here.
        pytest.skip("vLLM's CPU build seeds no request; a second engine beside the first does not repeat it")
    twin = engine.config.start(tmp_path / "engine.log")
    try:
        again = first_batch(twin, engine.config.sampling)
    finally:
        twin.close()
    for x, y in zip(engine.first, again):
        assert np.array_equal(x.token_ids, y.token_ids) and np.array_equal(x.logprobs, y.logprobs)
        assert x.finish_reason == y.finish_reason


# ---- decode vs prefill -----------------------------------------------------------------------

PREFILL_STARTS = {"hf": [4, 10, 2], "vllm": [4, 10, 2], "sglang": [4, 10, 1]}


def test_prefill_scores_the_given_tokens_not_the_sampled_ones(engine):
    """Prefill log-probs of arbitrary (never sampled) sequences agree with an fp32 HF forward to bf16
    precision, position by position from each request's start: the engine really re-runs them."""
    check_engine_prefill_against_independent(engine.process, starts=PREFILL_STARTS[engine.name])


# ---- refusals ------------------------------------------------------------------------------------

REFUSALS = [
    pytest.param(
        "hf",
        {"tensor_parallel_size": 2},
        r"engine 'hf' has no setting engine.tensor_parallel_size \(--tp\)",
        id="hf-tp",
    ),
    pytest.param(
        "vllm", {"batch_invariant": True}, "batch-invariant mode .* runs on CPU", marks=pytest.mark.vllm, id="vllm-bi"
    ),
    pytest.param("vllm", {"cascade_attn": True}, "no cascade attention", marks=pytest.mark.vllm, id="vllm-cascade"),
    pytest.param(
        "vllm",
        {"extra_args": {"enable_prefx_caching": True}},
        "has no argument 'enable_prefx_caching'.*enable_prefix_caching",
        marks=pytest.mark.vllm,
        id="vllm-typo",
    ),
    pytest.param(
        "sglang",
        {"extra_args": {"disable_radx_cache": True}},
        "has no argument 'disable_radx_cache'.*disable_radix_cache",
        marks=pytest.mark.sglang,
        id="sglang-typo",
    ),
    pytest.param(
        "sglang",
        {"tensor_parallel_size": 2, "extra_args": {"tp_size": 2}},
        "sets 'tp_size', which mismatch-probe sets itself",
        marks=pytest.mark.sglang,
        id="sglang-own-setting",
    ),
]


@pytest.mark.parametrize(("name", "settings", "message"), REFUSALS)
def test_unsupported_settings_fail_loudly(name, settings, message, tmp_path):
    """What a run does before sampling: the registry's settings check, then the engine's own start;
    either refuses a setting the engine cannot honor, with what to do instead."""
    spec = CONFIGS[name].spec(**settings)
    with pytest.raises(ConfigError, match=message):
        get_entry(name).check_settings(spec)
        EngineProcess(get_entry(name), DENSE, spec, log_path=tmp_path / "engine.log")


# ---- multi-turn tool use -----------------------------------------------------------------------

MULTI_TURN_PROMPTS = {"hf": 4, "vllm": 32, "sglang": 16}


def test_multi_turn_tool_use_continues_from_token_ids(engine, tmp_path):
    """The engine continues each conversation from its exact ids across calculator turns (tool outputs
    spliced in as tokens, never re-tokenized); later turns are scored like the first. On vLLM, 32
    conversations of 100+ tokens exceed one step's token budget, so chunked prefill splits prompts
    (the case that kills per-request seeded sampling on vLLM's CPU build)."""
    s = probe(engine, tmp_path / "mt")
    s.prompts, s.max_turns, s.max_prompts = str(MULTI_TURN), 4, MULTI_TURN_PROMPTS[engine.name]
    rec = compare(s, engine=engine.process).record
    check_first_and_later_turns(rec)
    assert rec["tokenization_check"]["n_checked"] > 0

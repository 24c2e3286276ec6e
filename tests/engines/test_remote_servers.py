"""The remote engine against real rollout servers on 127.0.0.1: vLLM's OpenAI server (its CPU build,
started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script looks up
the metadata of a distribution named ``vllm``, which the CPU wheel is not) and SGLang's HTTP server
(``python -m sglang.launch_server`` from the SGLang venv). Each server runs the settings of the
session's in-process engine (tests/engine_fixtures.py); a probe through the server and one through
the in-process engine on the same spec must agree within sampling noise (the sequence bootstrap's
99.9% interval of their difference covers 0 for every metric), and the settings the server exposes
are read back into run.json.
"""

from __future__ import annotations

import sys

import pyarrow.parquet as pq
import pytest
from conftest import DENSE, MULTI_TURN, SGLANG_PYTHON, SINGLE_TURN, check_first_and_later_turns
from engine_fixtures import CONFIGS
from remote_fixtures import Server, free_port

from mismatch_probe.analysis.intervals import unpaired_intervals
from mismatch_probe.analysis.sequences import group_columns
from mismatch_probe.config.spec import EngineSpec, ProbeSpec, SamplingSpec
from mismatch_probe.pipeline import compare


# 16 prompts x 4 samples a side: the intervals of the difference stay informative (every metric but
# the extremes is estimated from ~64 sequences) at half the generation and scoring of 32 prompts
def probe(out, engine: EngineSpec, sampling: SamplingSpec, prompts: int = 16, n: int = 4) -> ProbeSpec:
    s = ProbeSpec(model=str(DENSE), prompts=str(SINGLE_TURN), out=str(out), max_prompts=prompts, shard_size=64)
    s.engine = engine
    s.sampling = SamplingSpec(**{**vars(sampling), "n": n})
    s.reference.dtype = "float32"
    return s


def assert_within_noise(a, b) -> dict:
    """Every metric of run ``b`` equals run ``a``'s within the two runs' sequence-sampling noise."""
    cols = [group_columns(pq.read_table(r.run_dir / "sequences.parquet"), "all") for r in (a, b)]
    intervals = unpaired_intervals([cols[0]], cols[1], n_boot=2000, level=0.999, seed=1)
    checked = {k: v.difference for k, v in intervals.items() if v is not None}
    assert len(checked) >= 8, checked
    for k, d in checked.items():  # pytest -s: the figures
        print(f"{k}: in process {a.record['metrics'].get(k)}, server {b.record['metrics'].get(k)}, difference {d}")
    outside = {k: d for k, d in checked.items() if not d.covers(0.0)}
    assert not outside, outside
    return checked


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    port = free_port()
    # the shared in-process engine's settings (engine_fixtures.vllm_spec, extra_args seed 11)
    cmd = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(DENSE), "--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", "bfloat16", "--logprobs-mode", "processed_logprobs", "--enforce-eager", "--seed", "11"),
        *("--kv-cache-memory-bytes", str(256 * 2**20)),
    ]
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    with Server(cmd, log=log, port=port, env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        server.wait_ready("/health", timeout_s=600)
        yield server


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory):
    if SGLANG_PYTHON is None:
        pytest.skip("SGLang is not installed (bash tests/sglang-cpu/install.sh .venv-sglang)")
    port = free_port()
    # the shared in-process engine's settings (engine_fixtures.sglang_spec on CPU: engines/sglang.py's defaults)
    cmd = [
        *(SGLANG_PYTHON, "-m", "sglang.launch_server", "--model-path", str(DENSE)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"),
        *("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"),
        *("--max-total-tokens", "32768", "--sleep-on-idle", "--log-level", "warning"),
    ]
    log = tmp_path_factory.mktemp("sglang-server") / "server.log"
    with Server(cmd, log=log, port=port, env={"SGLANG_USE_CPU_ENGINE": "1"}) as server:
        server.wait_ready("/health_generate", timeout_s=600)
        yield server


@pytest.mark.vllm
def test_vllm_server_probe_agrees_with_the_in_process_engine(vllm_server, vllm_engine, tmp_path):
    # top-p 1: with a nucleus, a token inside bf16's can fall outside fp32's (logp_train = -inf,
    # test_vllm_engine.py), and metrics that are infinite on one run and finite on the other compare nothing
    sampling = SamplingSpec(**{**vars(CONFIGS["vllm"].sampling), "top_p": 1.0})
    in_process = compare(probe(tmp_path / "in-process", CONFIGS["vllm"].spec(), sampling), engine=vllm_engine.process)
    remote_spec = EngineSpec(url=vllm_server.url, dtype="bfloat16", logprobs_mode="processed")
    served = compare(probe(tmp_path / "server", remote_spec, sampling))
    engine = served.record["engine"]
    # what the server runs with, read back (/server_info in dev mode, /metrics, the model card)
    assert engine["engine"] == "remote" and engine["versions"] == {
        "vllm": in_process.record["engine"]["versions"]["vllm"]
    }
    assert engine["dtype"] == "bfloat16" and engine["enforce_eager"] is True and engine["device"] == "cpu"
    assert engine["logprobs_mode"] == "processed" and engine["logprobs_mode_source"] == "read from the server"
    assert engine["max_model_len"] == 1024 and engine["block_size"] > 0 and engine["unknown"] == {}
    assert engine["model_check"] == {**engine["model_check"], "names": True, "tokenizer": True, "matched": True}
    assert "per_request_seeds_off_because" in engine  # vLLM's CPU build, as in process
    checked = assert_within_noise(in_process, served)
    assert {"k3_kl", "prob_diff_mean", "log_ppl_infer", "chi2_seq"} <= set(checked)

    # decode vs the server's own prefill (T = 1: processed log-probs are raw ones), equal as in process
    at_t1 = SamplingSpec(**{**vars(sampling), "temperature": 1.0, "top_p": 1.0})
    rec = compare(probe(tmp_path / "t1", remote_spec, at_t1, prompts=8, n=2)).record
    dvp = rec["decode_vs_prefill"]
    assert dvp["n_model_tokens"] == rec["metrics"]["n_model_tokens"] > 0
    assert dvp["abs_delta_max"] == 0.0 and dvp["k3_kl"] == 0.0

    # multi-turn tool use through the server: each turn's context goes out as ids and comes back the same
    multi = probe(tmp_path / "multi-turn", remote_spec, sampling, prompts=8, n=2)
    multi.prompts, multi.max_turns = str(MULTI_TURN), 3
    rec = compare(multi).record
    check_first_and_later_turns(rec)
    assert rec["tokenization_check"]["n_differing"] == 0


@pytest.mark.sglang
def test_sglang_server_probe_agrees_with_the_in_process_engine(sglang_server, sglang_engine, tmp_path):
    sampling = CONFIGS["sglang"].sampling
    in_process_spec = CONFIGS["sglang"].spec(**CONFIGS["sglang"].probe)
    in_process = compare(probe(tmp_path / "in-process", in_process_spec, sampling), engine=sglang_engine.process)
    remote_spec = EngineSpec(url=sglang_server.url, api="sglang", dtype="bfloat16", logprobs_mode="processed")
    served = compare(probe(tmp_path / "server", remote_spec, sampling))
    engine = served.record["engine"]
    assert engine["versions"] == {"sglang": in_process.record["engine"]["versions"]["sglang"]}
    assert engine["attention_backend"] == "torch_native" and engine["device"] == "cpu"
    assert engine["enforce_eager"] is True and engine["max_total_tokens"] == 32768
    assert engine["model_check"]["architectures"] is True and engine["model_check"]["matched"] is True
    assert "logprobs_mode" in engine["unknown"]  # SGLang does not say; the spec did
    assert engine["per_request_seeds"] is False  # SGLang seeds requests only in deterministic mode
    checked = assert_within_noise(in_process, served)
    assert "k3_kl" in checked

    # decode vs the server's own prefill at T = 1 (processed = raw): measured, as in process
    at_t1 = SamplingSpec(**{**vars(sampling), "temperature": 1.0})
    rec = compare(probe(tmp_path / "t1", remote_spec, at_t1, prompts=8, n=2)).record
    dvp = rec["decode_vs_prefill"]
    assert dvp["n_model_tokens"] == rec["metrics"]["n_model_tokens"] > 0 and dvp["k3_kl"] < 1e-3

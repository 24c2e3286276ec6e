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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import DENSE, MULTI_TURN, SGLANG_PYTHON, SINGLE_TURN, check_first_and_later_turns
from engine_fixtures import CONFIGS
from remote_fixtures import Server, free_port, scripted_server

from mismatch_probe.analysis.intervals import unpaired_intervals
from mismatch_probe.analysis.sequences import group_columns
from mismatch_probe.config.spec import EngineSpec, ProbeSpec, SamplingSpec, SyncSpec
from mismatch_probe.engines import ScoreRequest, get_entry
from mismatch_probe.engines import weight_sync as ws
from mismatch_probe.engines.process import EngineProcess
from mismatch_probe.engines.remote import RemoteEngine, check_sync
from mismatch_probe.errors import ConfigError
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

    # decode vs the server's own prefill (T = 1: processed log-probs are raw ones). Prefill is batch
    # invariant, but on an AMX CPU a decode step's log-probs depend on how many sequences decode
    # together (docs/concepts/engines.md), and a server's decode batches follow the requests' arrival:
    # most tokens are bitwise equal, the rest differ in the last bits (max 0.003 seen; in process,
    # where every request arrives at once, all are equal)
    at_t1 = SamplingSpec(**{**vars(sampling), "temperature": 1.0, "top_p": 1.0})
    rec = compare(probe(tmp_path / "t1", remote_spec, at_t1, prompts=8, n=2)).record
    dvp = rec["decode_vs_prefill"]
    assert dvp["n_model_tokens"] == rec["metrics"]["n_model_tokens"] > 0
    assert dvp["abs_delta_p50"] == 0.0 and dvp["abs_delta_max"] < 0.02 and dvp["k3_kl"] < 1e-5

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


# ---- weight sync through the servers' own routes (engines/remote/engine.py: sync_weights) ----------------
# After the probes above: each server syncs the perturbed checkpoint in (the next step's weights) and
# the fixture model back, so it serves the model as it started when the module ends. A server's
# parameters cannot be read from outside it, so its prompt log-probs on fixed sequences are checked.
# four fixed sequences of the fixture's vocabulary (1024 ids), scored from the second token on
SEQUENCES = [np.random.default_rng(k).integers(3, 1000, 24).astype(np.int32) for k in range(4)]
REPORT_KEYS = {"transfer", "dtype_sent", "call", "buckets", "tensors", "bytes", "reset_prefix_cache", "seconds"}
# The servers run bf16, the reference fp32: on these sequences a server's log-probs are within
# ~0.02 nats of the reference on average (~0.11 at most), SGLang's and vLLM's alike, while the
# perturbation moves them by ~0.34 on average
BF16_MEAN, BF16_MAX, PERTURBED_MEAN = 0.04, 0.2, 0.2


def hf_logprobs(model_dir: Path, *, lm_head_of: Path | None = None) -> np.ndarray:
    """The in-process reference: each token's log-prob under the checkpoint, in fp32; with
    ``lm_head_of``, the LM head (tied: the embedding) of that other checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if lm_head_of is not None:
        other = AutoModelForCausalLM.from_pretrained(lm_head_of, dtype=torch.float32)
        model.lm_head.weight = torch.nn.Parameter(other.get_output_embeddings().weight.detach().clone())
    out = []
    with torch.no_grad():
        for ids in SEQUENCES:
            x = torch.from_numpy(ids.astype(np.int64))[None]
            logp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
            out.append(logp.gather(-1, x[0, 1:, None])[:, 0].numpy())
    return np.concatenate(out)


def scores(engine) -> np.ndarray:
    """The server's prompt log-probs of SEQUENCES, one request at a time: requests sent together are
    batched as they arrive, and on this CPU (AMX) a bf16 GEMM's result depends on the batch's size,
    so only a batch of one is the same batch every time (the comparisons below are bitwise)."""
    return np.concatenate([engine.prefill_logprobs([ScoreRequest(ids, 1)])[0] for ids in SEQUENCES])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote-sync")
    start = ws.perturbed_checkpoint(DENSE, tmp / "perturbed")
    return start, hf_logprobs(DENSE), hf_logprobs(start)


@dataclass
class Synced:
    """What one server did, synced through one engine process."""

    at_start: np.ndarray  # its log-probs as started (the fixture model)
    synced: np.ndarray  # after the sync of the perturbed checkpoint (the next step's weights)
    back: np.ndarray  # after a sync of the fixture model again
    report: dict  # the sync's report


def sync_round_trip(server: Server, api: str, target: Path, sync: SyncSpec, tmp: Path) -> Synced:
    """The server (serving the fixture model) syncs ``target`` in, then the fixture model back."""
    spec = EngineSpec(url=server.url, api=api, dtype="bfloat16", logprobs_mode="processed")
    engine = EngineProcess(
        get_entry("remote"), DENSE, spec, log_path=tmp / f"{api}.log", state_dir=tmp / "received", sync=sync
    )
    try:
        at_start = scores(engine)
        report = engine.sync_weights(target, tmp / f"{sync.transfer}-1")
        synced = scores(engine)
        engine.sync_weights(DENSE, tmp / f"{sync.transfer}-2")
        back = scores(engine)
    finally:
        engine.close()
    return Synced(at_start, synced, back, report)


def close_to(logprobs: np.ndarray, reference: np.ndarray) -> bool:
    """Within bf16's rounding of the fp32 reference."""
    diff = np.abs(logprobs - reference)
    return bool(diff.mean() < BF16_MEAN and diff.max() < BF16_MAX)


def check_round_trip(s: Synced, start_reference: np.ndarray, expected: np.ndarray) -> None:
    """The server served the fixture model, then ``expected``'s weights (the journal of answers, in
    the worker's state directory, did not give back the ones from before the sync), then the model
    again, bitwise as it started: its update path loads what its start loads."""
    assert close_to(s.at_start, start_reference)
    assert np.abs(s.synced - s.at_start).mean() > PERTURBED_MEAN
    assert close_to(s.synced, expected)
    np.testing.assert_array_equal(s.back, s.at_start)
    assert REPORT_KEYS <= set(s.report) and s.report["fault"] is None
    assert s.report["tensors"] == len(list(ws.checkpoint_tensors(DENSE))) and s.report["bytes"] > 0


@pytest.fixture(scope="module")
def sglang_disk(sglang_server, checkpoints, tmp_path_factory) -> Synced:
    start = checkpoints[0]
    tmp = tmp_path_factory.mktemp("sglang-disk")
    return sync_round_trip(sglang_server, "sglang", start, SyncSpec(start_from=str(start), transfer="disk"), tmp)


@pytest.mark.sglang
def test_sglang_disk_sync(sglang_disk, checkpoints):
    """/update_weights_from_disk reads the checkpoint the probe wrote, and the server then scores as
    the fixture model does; it flushes the radix cache by itself (flush_cache in the body), and names
    its model by that path afterwards."""
    _, reference, reference_start = checkpoints
    check_round_trip(sglang_disk, reference, reference_start)
    report = sglang_disk.report
    assert report["transfer"] == "disk" and report["buckets"] == 1
    assert "/update_weights_from_disk" in report["call"]
    assert report["engine_report"]["success"] is True, report
    assert report["engine_report"]["model_info_after"]["model_path"].endswith("disk-1")  # its name afterwards
    flush = report["reset_prefix_cache"]
    assert flush["engine_flushes_itself"] is True and "flush_cache_after_weight_update" in flush["by"]


@pytest.mark.sglang
def test_sglang_tensor_sync_over_http(sglang_server, sglang_disk, checkpoints, tmp_path):
    """/update_weights_from_tensor takes the buckets' bytes inline over HTTP from this (unrelated)
    process, inside a weight-update session: the server then scores bitwise as after the disk
    update; /flush_cache resets the cache; a trainer-side fault reaches the server; a fault that
    acts inside the engine is refused by name."""
    start = checkpoints[0]
    sync = SyncSpec(start_from=str(start), transfer="tensor", bucket_mb=1.0)  # several buckets
    spec = EngineSpec(url=sglang_server.url, api="sglang", dtype="bfloat16", logprobs_mode="processed")
    engine = EngineProcess(
        get_entry("remote"), DENSE, spec, log_path=tmp_path / "tensor.log", state_dir=tmp_path / "received", sync=sync
    )
    try:
        report = engine.sync_weights(start, tmp_path / "unused")  # the tensor transfer writes nothing
        np.testing.assert_array_equal(scores(engine), sglang_disk.synced)
        assert REPORT_KEYS <= set(report) and report["transfer"] == "tensor" and report["buckets"] > 1
        assert report["tensors"] == len(list(ws.checkpoint_tensors(start)))
        assert report["engine_report"]["begin"] == report["engine_report"]["end"] == "Success", report
        assert report["reset_prefix_cache"]["call"].startswith("POST /flush_cache")
        assert report["reset_prefix_cache"]["result"] is True
        # a parameter the trainer does not send keeps the previous value
        engine.sync_weights(DENSE, tmp_path / "unused")
        skipped = engine.sync_weights(start, tmp_path / "unused", fault="skip")
        assert skipped["fault"] == "skip" and skipped["tensors"] == report["tensors"] - 1
        assert not np.array_equal(scores(engine), sglang_disk.synced)
        with pytest.raises(ConfigError, match="untie_lm_head fault acts inside the engine"):
            engine.sync_weights(DENSE, tmp_path / "unused", fault="untie_lm_head")
        engine.sync_weights(DENSE, tmp_path / "unused")  # the server serves the model again
        np.testing.assert_array_equal(scores(engine), sglang_disk.at_start)
    finally:
        engine.close()


@pytest.mark.sglang
def test_sglang_unreadable_checkpoint_is_named(sglang_server, checkpoints, tmp_path, monkeypatch):
    """A path the server cannot read (here: never written) is named, with where the server must find it."""
    start = checkpoints[0]
    spec = EngineSpec(url=sglang_server.url, api="sglang", dtype="bfloat16", logprobs_mode="processed")
    engine = RemoteEngine(DENSE, spec, sync=SyncSpec(start_from=str(start), transfer="disk"))
    monkeypatch.setattr(ws, "write_checkpoint", lambda named, out, model: {"tensors": 0, "bytes": 0})
    with pytest.raises(ConfigError, match="cannot read the checkpoint the probe wrote") as caught:
        engine.sync_weights(DENSE, str(tmp_path / "not-there"))
    assert str(tmp_path / "not-there") in caught.value.message and "same path" in caught.value.hint


@pytest.mark.vllm
def test_vllm_disk_sync(vllm_server, checkpoints, tmp_path):
    """/collective_rpc runs the worker's reload_weights on the checkpoint the probe wrote, and
    /reset_prefix_cache resets the cache. vLLM 0.32's CPU build then scores with the new weights but
    the LM head it was started with: the tied head's repacked kernel is not re-processed by the
    in-place reload (tests/engines/test_vllm_sync.py finds it in process); the test requires that,
    so a vLLM that fixes it says so here."""
    start, reference, reference_start = checkpoints
    synced = sync_round_trip(vllm_server, "openai", start, SyncSpec(start_from=str(start), transfer="disk"), tmp_path)
    import torch

    if torch.cuda.is_available():  # a GPU build: no repacked kernels
        check_round_trip(synced, reference, reference_start)
    else:
        check_round_trip(synced, reference, hf_logprobs(start, lm_head_of=DENSE))
        assert not close_to(synced.synced, reference_start)
    report = synced.report
    assert report["transfer"] == "disk" and "reload_weights" in report["call"]
    assert report["engine_report"]["results"] == [None]  # one worker, reload_weights returns nothing
    assert report["reset_prefix_cache"] == {
        "call": "POST /reset_prefix_cache (vllm/entrypoints/serve/dev/cache/api_router.py)",
        "result": True,
    }

    # a path the server cannot read is named
    spec = EngineSpec(url=vllm_server.url, dtype="bfloat16", logprobs_mode="processed")
    engine = RemoteEngine(DENSE, spec, sync=SyncSpec(start_from=str(start), transfer="disk"))
    with pytest.MonkeyPatch.context() as mp:  # the checkpoint is never written
        mp.setattr(ws, "write_checkpoint", lambda named, out, model: {"tensors": 0, "bytes": 0})
        with pytest.raises(ConfigError, match="cannot read the checkpoint the probe wrote"):
            engine.sync_weights(DENSE, str(tmp_path / "not-there"))


# ---- what no server can do, refused before any request ----------------------------------------
def test_refused_by_name_before_any_request(tmp_path):
    sync = SyncSpec(start_from="perturbed", transfer="tensor")
    # nothing listens there: a request would fail otherwise
    nowhere = EngineSpec(url="http://127.0.0.1:9", api="openai")
    with pytest.raises(ConfigError, match="no route that takes the tensors' bytes") as caught:
        RemoteEngine(DENSE, nowhere, sync=sync)
    assert "--sync-transfer disk" in caught.value.hint
    for api in ("openai", "sglang"):
        with pytest.raises(ConfigError, match="needs a trainer process in the server's NCCL group"):
            check_sync(SyncSpec(start_from="perturbed", transfer="nccl"), api)
    check_sync(SyncSpec(start_from="perturbed", transfer="tensor"), "sglang")  # SGLang takes tensors over HTTP
    with pytest.raises(ConfigError, match="flushes its radix cache by itself when it releases"):
        check_sync(SyncSpec(start_from="perturbed", sleep_level=1, reset_prefix_cache=False), "sglang")


def test_server_without_the_routes_is_refused(tmp_path):
    """vLLM without its development routes, and an SGLang router (no /server_info), in one line each."""
    sync = SyncSpec(start_from="perturbed", transfer="disk")
    with scripted_server(tmp_path) as server:  # vLLM's API without VLLM_SERVER_DEV_MODE
        with pytest.raises(ConfigError, match="no development routes") as caught:
            RemoteEngine(DENSE, EngineSpec(url=server.url, check_model=False), sync=sync)
        assert "VLLM_SERVER_DEV_MODE=1" in caught.value.hint
    with scripted_server(tmp_path, "--sglang-router") as server, pytest.raises(ConfigError, match="no /server_info"):
        RemoteEngine(DENSE, EngineSpec(url=server.url, api="sglang", check_model=False), sync=sync)


@pytest.mark.sglang
def test_sglang_server_returns_its_moe_routing(tmp_path):
    """An SGLang server started with --enable-return-routed-experts on an MoE checkpoint (the family
    suite's tiny Qwen3-MoE, untied: docs/engine-findings/sglang-qwen3-moe-untied-lm-head.md): the
    remote engine reads from /server_info that it returns them, asks for them from the last prompt
    position, and reads each answer's meta_info.routed_experts into the routing behind each sampled
    token, so the run compares the server's routing with the reference's and runs the R3 what-if.
    On CPU the capture needs tests/sglang-cpu's unpinned buffer (engines/sglang.py)."""
    import tiny_models

    if SGLANG_PYTHON is None:
        pytest.skip("SGLang is not installed (bash tests/sglang-cpu/install.sh .venv-sglang)")
    model = tiny_models.build("qwen3_moe", tmp_path / "tiny-qwen3-moe", tie_word_embeddings=False)
    port = free_port()
    cmd = [
        *(SGLANG_PYTHON, "-m", "sglang.launch_server", "--model-path", str(model)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enable-return-routed-experts"),
        *("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"),
        *("--max-total-tokens", "8192", "--sleep-on-idle", "--log-level", "warning"),
    ]
    with Server(cmd, log=tmp_path / "server.log", port=port, env={"SGLANG_USE_CPU_ENGINE": "1"}) as server:
        server.wait_ready("/health_generate", timeout_s=600)
        spec = ProbeSpec(model=str(model), prompts=str(SINGLE_TURN), out=str(tmp_path / "run"), max_prompts=8)
        spec.engine = EngineSpec(url=server.url, api="sglang", dtype="float32", logprobs_mode="raw")
        spec.sampling = SamplingSpec(temperature=1.0, max_tokens=24, n=2)
        spec.reference.dtype = "float32"
        rec = compare(spec).record
    eng, routing = rec["engine"], rec["routing"]
    assert eng["return_routed_experts"] is True and "routing_unavailable" not in eng
    assert eng["routing"] == {"moe_layers": [0, 1], "top_k": 2, "num_experts": 8}
    # float32 server, float32 reference: every sampled token routed as the reference routes it
    assert routing["n_tokens"] == rec["metrics"]["n_model_tokens"] > 100
    assert routing["set_agreement_by_layer"] == [1.0, 1.0] and routing["flipped"]["n_tokens"] == 0
    assert rec["reference"]["routing_replay"] == "the engine's experts forced (R3)"
    assert routing["replay"]["k3_replayed"] == pytest.approx(routing["replay"]["k3_free"], abs=1e-9)

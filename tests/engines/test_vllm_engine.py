"""The vLLM engine for real (the CPU build here; the same adapter runs the CUDA build on GPUs): what
only vLLM does. What every engine does is in test_engine_conformance.py.

The in-process tests share the session's engine (``vllm_engine``, tests/engine_fixtures.py; a start
is ~40-80 s on 2 cores); the CLI tests start their own, as a user's run does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DENSE, MOE, SINGLE_TURN, cli
from engine_fixtures import CONFIGS

from mismatch_probe.config.spec import ProbeSpec, SamplingSpec
from mismatch_probe.pipeline import compare

pytestmark = pytest.mark.vllm

SAMPLING = CONFIGS["vllm"].sampling  # T=0.7, top-p 0.9


def probe(out, top_p: float = SAMPLING.top_p, logprobs: str = "engine") -> ProbeSpec:
    s = ProbeSpec(model=str(DENSE), prompts=str(SINGLE_TURN), out=str(out), max_prompts=24, shard_size=16)
    s.engine = CONFIGS["vllm"].spec()
    s.sampling = SamplingSpec(**{**vars(SAMPLING), "top_p": top_p, "n": 2})
    s.reference.dtype = "float32"
    s.reference.logprobs = logprobs
    return s


def test_top_p_semantics_and_the_nucleus_boundary(vllm_engine, tmp_path):
    """With top-p the processed distributions match too, except that a token inside bf16's nucleus
    can fall just outside fp32's: the reference then gives it probability 0 (logp_train = -inf),
    counted in n_zero_prob_train rather than hidden.

    The three modes score the same rollouts (``rollouts_from``): a shared engine samples a new batch
    each run, and comparing p99s across batches measured sampling noise as much as the mode."""
    sampled = compare(probe(tmp_path / "engine", logprobs="engine"), engine=vllm_engine.process)
    runs = {"engine": sampled.record["metrics"]}
    for name in ("raw", "temperature"):
        rescored = compare(probe(tmp_path / name, logprobs=name), rollouts_from=sampled.run_dir)
        assert rescored.record["samples"] == sampled.record["samples"]
        runs[name] = rescored.record["metrics"]
    p99 = {name: m["abs_delta_p99"] for name, m in runs.items()}
    # measured on 24x2 rollouts: engine 0.066-0.094 (bf16 against fp32, by batch), raw 0.46, temperature 0.13
    assert p99["engine"] < 0.15 and p99["raw"] > 3 * p99["engine"] and p99["temperature"] > p99["engine"], p99
    assert runs["raw"]["n_zero_prob_train"] == 0 and runs["temperature"]["n_zero_prob_train"] == 0
    assert runs["engine"]["n_zero_prob_train"] <= 0.01 * runs["engine"]["n_model_tokens"]


def compare_cli(tmp_path, *args, env: dict | None = None):
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
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "run.json").read_text())


def test_fp32_engine_matches_fp32_reference_and_sizes_its_kv_cache_itself(tmp_path):
    """vLLM in fp32 against the fp32 reference: what is left is kernel order, far below bf16's.

    Flags only, no memory flag: vLLM's CPU default (0.92 of the NUMA node) need not be free;
    mismatch-probe gives it what the run needs, capped by what the node has free, and records the
    choice.

    The engine runs in-process in the engine worker ("uni", which the CPU build takes with
    VLLM_ENABLE_V1_MULTIPROCESSING=0): the same CPU worker, kernels and KV cache as vLLM's default
    mp executor (the shared engine's), without two more processes importing vLLM (~20 s)."""
    args = ("--engine-dtype", "float32", "--train-dtype", "float32", "--distributed-executor-backend", "uni")
    rec = compare_cli(tmp_path, "--model", str(DENSE), *args, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    eng = rec["engine"]
    assert eng["dtype"] == "float32" and eng["distributed_executor_backend"] == "uni"
    assert rec["metrics"]["k3_kl"] < 1e-8 and rec["metrics"]["prob_diff_max"] < 1e-3
    dvp = rec["decode_vs_prefill"]
    assert dvp["n_model_tokens"] == rec["metrics"]["n_model_tokens"] and dvp["k3_kl"] < 1e-8
    sizing = eng["kv_cache_sizing"]
    assert (
        eng["kv_cache_memory_bytes"]
        == sizing["kv_cache_memory_bytes"]
        == min(sizing["needed_bytes"], sizing["cap_bytes"])
    )
    # the fixture: 4 layers x 2 KV heads x head_dim 64 x K and V x 4 bytes (the fp32 engine's KV cache)
    assert sizing["bytes_per_token"] == 4 * 2 * 64 * 2 * 4
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
    # this build cannot return routed experts: the run says exactly why, and so does the report
    from mismatch_probe.engines.vllm import ROUTING_UNAVAILABLE_CPU

    assert eng["routing"] is None and eng["routing_unavailable"] == ROUTING_UNAVAILABLE_CPU
    assert rec["routing"] is None and "routing_replay" not in rec["reference"]
    report = " ".join((tmp_path / "run" / "report.md").read_text().split())
    assert "not measured: vLLM's CPU build cannot return expert ids" in report
    m = rec["metrics"]
    assert all(np.isfinite(m[k]) for k in ("k3_kl", "prob_diff_max", "seq_max_mismatch_mean"))
    assert 0 < m["k3_kl"] < 0.05
    assert rec["decode_vs_prefill"]["n_model_tokens"] == m["n_model_tokens"]
    assert rec["engine_process"]["exit_code"] == 0
    assert set(rec["timings"]) >= {"engine_start_s", "generation_s", "prefill_s", "scoring_s", "metrics_s", "report_s"}


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


# ---- the CPU build's AMX attention and the tile permission (engines/vllm_plugin.py) ---------------
HAS_AMX = torch.cpu._is_amx_tile_supported()


def test_the_engine_records_the_kernels_it_chose_for_this_cpu(vllm_engine):
    """Read from the workers' layers (vllm_sync.probe_kernels): on every CPU, each of the fixture's
    4 attention layers runs vLLM's CPU attention and every linear layer a packed GEMM; which
    instruction set and GEMM depend on the CPU (AMX: the AMX attention; else the vector one, and
    oneDNN's GEMMs: a layer's weights are too large for the sgl-kernel's small-GEMM path only on
    AMX), and the run record says which; so does its environment."""
    from mismatch_probe.environment import cpu_features

    if torch.cuda.is_available():
        pytest.skip("the CPU build's kernels")
    kernels = vllm_engine.process.info()["kernels"]
    isa = "amx" if HAS_AMX else "vec"
    assert kernels["amx"] is HAS_AMX and kernels["attention"] == {f"CPU_ATTN ({isa})": 4}, kernels
    assert sum(kernels["gemm"].values()) >= 4 * 4 and set(kernels["gemm"]) <= {"oneDNN", "sgl-kernel (AMX)"}, kernels
    if not HAS_AMX:
        assert set(kernels["gemm"]) == {"oneDNN"}, kernels
    kind = cpu_features()["cpu_kind"]
    assert (kind == "AMX") is HAS_AMX
    expected_library = {
        "AMX": "vllm._C",
        "AVX-512 BF16": "vllm._C",
        "AVX-512": "vllm._C_AVX512",
        "AVX2": "vllm._C_AVX2",
    }
    assert kernels["library"] == expected_library[kind], (kind, kernels)


TILE_PERMISSION = """
import ctypes, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
granted = ctypes.c_uint64(0)
ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(granted))  # arch_prctl(ARCH_GET_XCOMP_PERM)
print(bool(granted.value & (1 << 18)))  # XFEATURE_XTILEDATA
"""
FIRST_STEP_ALONE = """
if __name__ == "__main__":
    import sys
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=64 * 2**20, seed=0)
    out = llm.generate([{"prompt_token_ids": [1, 7, 85, 90]}], SamplingParams(max_tokens=8), use_tqdm=False)
    print(len(out[0].outputs[0].token_ids))
"""


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX tiles, the only case the plugin acts on")
def test_the_plugin_asks_for_amx_tiles_in_every_vllm_process_so_a_lone_short_first_step_runs(tmp_path):
    """vLLM's CPU attention runs AMX tile instructions without asking Linux for them; with the
    fixture's small weights no oneDNN GEMM asks first, so an eager engine whose first step is one
    4-token request died of SIGILL (exit -4). vLLM loads mismatch-probe's general plugin in each
    process, and the plugin asks; without it (VLLM_PLUGINS=none) nothing has asked yet."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    loaded = subprocess.run([sys.executable, "-c", TILE_PERMISSION], capture_output=True, text=True, env=env)
    assert loaded.stdout.split()[-1:] == ["True"], loaded.stderr[-2000:]
    none = subprocess.run(
        [sys.executable, "-c", TILE_PERMISSION], capture_output=True, text=True, env={**env, "VLLM_PLUGINS": "none"}
    )
    assert none.stdout.split()[-1:] == ["False"], none.stderr[-2000:]
    script = tmp_path / "first_step_alone.py"
    script.write_text(FIRST_STEP_ALONE)
    run = subprocess.run([sys.executable, str(script), str(DENSE)], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["8"], run.stderr[-3000:]

"""Quantized rollouts on vLLM's CPU build: the engine loads a compressed-tensors export of the
fixture (fixtures/quantize.py, made here with the compressed-tensors library vLLM ships) while the
reference scores the model itself, as a run with quantized rollouts and a bf16 trainer does. The
engine's own record of each layer (``engine.quantization_layers``, read from its worker) must show
the weights quantized: a silently ignored setting cannot pass."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import DENSE, ROOT, SINGLE_TURN, cli

from mismatch_probe.record import read_record
from mismatch_probe.report.labels import setup_rows

pytestmark = pytest.mark.vllm
sys.path.insert(0, str(ROOT / "fixtures"))


# what vLLM's CPU build runs each export with (read from its worker), on every CPU: the
# compressed-tensors scheme, the kernel, the weights' number format and its width in bits
EXPECTED = {
    "W8A8": ("CompressedTensorsW8A8Int8", "CPUInt8ScaledMMLinearKernel", "int8", 8, "int8 per channel"),
    "W4A16": ("CompressedTensorsWNA16", "CPUWNA16LinearKernel", "uint4b8", 4, "int4 per group"),
    "FP8_DYNAMIC": (
        "CompressedTensorsW8A8Fp8",
        "ChannelWiseTorchFP8ScaledMMLinearKernel",
        "float8_e4m3fn",
        8,
        "fp8 per channel",
    ),
}
# where the kernel keeps the weights, the path it takes and the scales' dtype: vLLM decides each by
# torch.cpu._is_amx_tile_supported() (kernels/linear/scaled_mm/cpu.py: the sgl-kernel int8 GEMM or
# a oneDNN handle that takes the weights out of the layer; mixed_precision/cpu.py: with AMX and
# VLLM_CPU_INT4_W4A8 (default on) an int4 checkpoint runs W4A8, int8 activations, uint8 blocks;
# without, W4A16 over int32 words). Measured: AMX on the Intel CI machines, no AMX on AMD EPYC.
BY_AMX = {
    True: {
        "W8A8": ("weight: int8", {"linear_method": "_apply_weights_sgl"}, "float32"),
        "W4A16": ("weight_packed: uint8", {"isa_hint": "amx", "use_w4a8": True}, "float32"),
        "FP8_DYNAMIC": ("weight: float8_e4m3fn", {}, "float32"),
    },
    False: {
        "W8A8": ("oneDNN handle (CPUDNNLGEMMHandler)", {"linear_method": "_apply_weights_onednn"}, "float32"),
        "W4A16": ("weight_packed: int32", {"isa_hint": "vec", "use_w4a8": False}, "bfloat16"),
        "FP8_DYNAMIC": ("weight: float8_e4m3fn", {}, "float32"),
    },
}
# fp8 runs through torch._scaled_mm, which the CPU emulates: ~6x slower at this size and ~1000x at
# probes/precision.toml's (docs/how-to/precision.md), so a smaller run. vLLM pads each fp8 GEMM to 17 rows
# and the emulation takes ~2 s a forward here, so every decode step costs that much whatever the
# batch: 4 tokens (3 decode steps) take 15 s where 16 took 37 s. Up to 16 model tokens keep the
# checks below meaningful: fp8 moves every token's log-prob (K3 7e-5 on them, 0 would need none
# moved), the 0.01 bound would need one token off by ~0.6 nats (fp8's largest here: 0.1), and the
# decode-vs-prefill equality covers each of them
SIZE = {"FP8_DYNAMIC": ("4", "1", "4")}
# the others: what a run records of the export and of each layer does not need many tokens (the
# K3 each scheme gives is probes/precision.toml's, with its noise floor)
DEFAULT_SIZE = ("8", "2", "16")
# The engine's executor. A user's run on the CPU build has vLLM's default (mp: an engine-core and a
# worker process, each importing vLLM, ~20 s of each start, and ~5 s to stop them); the W8A8 run
# keeps it, so the layers' record crosses the worker's process boundary as it does for a user. The
# other runs put the engine core and its model runner in the engine worker ("uni", as
# tests/families/engine_families.py does): the same CPU worker class and model runner load the
# export, pick the kernels and run them, which is all these runs check.
IN_PROCESS = ("--distributed-executor-backend", "uni")
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # what the CPU build needs for "uni"
MP_SCHEMES = ("W8A8",)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from quantize import quantize

    root = tmp_path_factory.mktemp("quantized")
    return {scheme: quantize(DENSE, root / f"tiny-qwen2-{scheme.lower()}", scheme) for scheme in EXPECTED}


@pytest.mark.parametrize("scheme", list(EXPECTED))
def test_a_quantized_export_runs_quantized_in_every_linear_layer(exports, scheme, tmp_path, record_property):
    out = tmp_path / "run"
    proc = cli(
        *("compare", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--out", str(out)),
        *("--engine", "vllm", "--engine-checkpoint", str(exports[scheme]), "--enforce-eager"),
        *("--train-dtype", "float32", "--logits-fp32"),
        *(x for pair in zip(("--max-prompts", "--n", "--max-tokens"), SIZE.get(scheme, DEFAULT_SIZE)) for x in pair),
        *("--temperature", "1.0", "--seed", "3"),
        *(() if scheme in MP_SCHEMES else IN_PROCESS),
        env=None if scheme in MP_SCHEMES else IN_PROCESS_ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((out / "run.json").read_text())
    expected_backend = "mp" if scheme in MP_SCHEMES else "uni"
    assert rec["engine"]["distributed_executor_backend"] == expected_backend
    expected_scheme, kernel, number_format, bits, declared = EXPECTED[scheme]
    assert rec["inputs"]["engine_checkpoint"].endswith(f"tiny-qwen2-{scheme.lower()}")
    assert rec["inputs"]["engine_checkpoint_quantization"]["groups"]["group_0"]["weights"].startswith(declared)
    layers = rec["engine"]["quantization_layers"]
    assert layers["quant_config"] == "CompressedTensorsConfig" and layers["kv_cache_dtype"] == "auto"
    quantized = [g for g in layers["groups"] if g["quantized"]]
    # every linear layer of the 4 blocks: q/k/v fused, o, gate/up fused, down
    assert sum(g["n_layers"] for g in quantized) == 4 * 4
    amx = rec["engine"]["kernels"]["amx"]
    held_in, path, scale_dtype = BY_AMX[amx][scheme]
    record_property("quantized_weight", {"amx": amx, **quantized[0]["weight"]})
    for group in quantized:
        assert group["scheme"] == expected_scheme and group["kernel"] == kernel
        weight = group["weight"]
        # quantized in whatever the kernel keeps them in: the format's width per weight where a
        # tensor holds them (a bf16 copy would take 16 bits), else the kernel's own handle
        assert (weight["format"], weight["bits"]) == (number_format, bits), weight
        assert weight["held_in"] == held_in and weight.get("path", {}) == path, (amx, weight)
        if "stored_bits_per_weight" in weight:
            assert bits <= weight["stored_bits_per_weight"] < 1.5 * bits, weight
        else:
            assert held_in.startswith("oneDNN handle"), weight
        assert group["params"]["weight_scale"] == scale_dtype, group["params"]
    unquantized = {pattern for g in layers["groups"] if not g["quantized"] for pattern in g["layers"]}
    assert unquantized == {"model.embed_tokens", "lm_head"}
    rows = dict(setup_rows(read_record(out)))
    assert declared in rows["engine checkpoint"] and "not quantized: lm_head" in rows["engine checkpoint"]
    assert (
        f"{expected_scheme}" in rows["quantization (engine)"]
        and f"{number_format} weights in" in rows["quantization (engine)"]
    )
    # how far each scheme moves the mismatch from bf16's (4.7e-5 on these prompts; one run each:
    # W8A8 8.2e-5, FP8_DYNAMIC 4.2e-4, W4A16 1.9e-3) is for a sweep with its noise floor to say
    assert 0 < rec["metrics"]["k3_kl"] < 0.01 and rec["decode_vs_prefill"]["k3_kl"] == 0.0


def test_online_fp8_is_refused_on_the_cpu_build_with_the_engines_reason(tmp_path):
    """quantization = fp8 quantizes a bf16 checkpoint at load with _C::static_scaled_fp8_quant,
    which vLLM's CPU build declares without a kernel: refused before the engine starts."""
    proc = cli(
        *("compare", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--out", str(tmp_path / "run")),
        *("--engine", "vllm", "--quantization", "fp8", "--enforce-eager", "--max-prompts", "2"),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no kernel for _C::static_scaled_fp8_quant" in proc.stderr and "--engine-checkpoint" in proc.stderr


@pytest.mark.parametrize(
    "flags, kv_cache_dtype",
    [
        (("--engine-dtype", "float16", "--train-dtype", "float16"), "auto"),  # fp16 on both sides
        (("--kv-cache-dtype", "fp8"), "fp8"),  # bf16 weights, an fp8 KV cache
    ],
    ids=["fp16-both-sides", "fp8-kv-cache"],
)
def test_the_other_rollout_precisions_run_as_recorded(tmp_path, flags, kv_cache_dtype):
    """probes/precision.toml's other levels on vLLM's CPU build, small: what the engine ran is read
    back from it (dtype, KV-cache dtype), not taken from the request."""
    out = tmp_path / "run"
    proc = cli(
        *("compare", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--out", str(out)),
        *("--engine", "vllm", "--enforce-eager", "--max-prompts", "8", "--n", "2", "--max-tokens", "32"),
        *("--temperature", "1.0", "--seed", "3", "--logits-fp32", *flags, *IN_PROCESS),
        env=IN_PROCESS_ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((out / "run.json").read_text())
    settings = rec["engine"]
    assert settings["kv_cache_dtype"] == kv_cache_dtype
    if "float16" in flags:
        assert settings["dtype"] == "float16" and rec["spec"]["reference"]["dtype"] == "float16"
        # fp16's 10 mantissa bits against bf16's 7: the bf16 runs of these prompts sit near 5e-5
        assert 0 < rec["metrics"]["k3_kl"] < 1e-5
    else:
        assert 0 < rec["metrics"]["k3_kl"] < 0.05

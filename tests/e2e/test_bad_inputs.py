"""Bad inputs a newcomer meets, through the real command line: each is one line saying what is
wrong and how to fix it, exit 2, no traceback, and nothing written that a fixed run would lose."""

from __future__ import annotations

import shutil
import tomllib

import pytest
from conftest import DENSE, ROOT, SINGLE_TURN, cli


def one_line_exit_2(proc, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def compare(tmp_path, *args: str, model=DENSE, prompts=SINGLE_TURN):
    return cli(
        "compare",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "run"),
        "--max-prompts",
        "2",
        "--max-tokens",
        "8",
        *args,
    )


def copy_model(tmp_path, skip=()) -> object:
    model = tmp_path / "model"
    model.mkdir()
    for f in DENSE.iterdir():
        if f.name not in skip:
            shutil.copyfile(f, model / f.name)
    return model


def test_a_prompts_file_that_is_not_utf8(tmp_path):
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes('{"prompt": "fine"}\n{"prompt": "café au lait"}\n'.encode("latin-1"))
    proc = compare(tmp_path, prompts=prompts)
    one_line_exit_2(proc, "latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 16)", "iconv -f latin1 -t utf-8")
    assert not (tmp_path / "run").exists()


def test_spec_and_thresholds_files_that_are_not_utf8(tmp_path):
    spec = tmp_path / "probe.toml"
    spec.write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    one_line_exit_2(cli("compare", str(spec)), "probe.toml:1: not UTF-8 text (byte 0xe9 at column 12)")
    thresholds = tmp_path / "gate.toml"
    thresholds.write_bytes(b"# seuil \xe9\n[[checks]]\n")
    one_line_exit_2(cli("gate", str(tmp_path), "--thresholds", str(thresholds)), "gate.toml:1: not UTF-8 text")


def test_a_model_directory_without_tokenizer_files(tmp_path):
    model = copy_model(tmp_path, skip=("tokenizer.json", "tokenizer_config.json"))
    proc = compare(tmp_path, model=model)
    # not "no chat template": transformers would build an empty tokenizer from config.json alone
    one_line_exit_2(proc, "has no tokenizer files", "copy the tokenizer files")
    assert "chat template" not in proc.stderr


@pytest.mark.parametrize("damage", ["garbage header", "truncated"])
def test_a_damaged_safetensors_file(tmp_path, damage):
    model = copy_model(tmp_path)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64 + data[64:] if damage == "garbage header" else data[:-100])
    proc = compare(tmp_path, model=model)
    one_line_exit_2(proc, "model.safetensors is not a readable safetensors file", "copy or download it again")
    assert not (tmp_path / "run" / "engine.log").exists()  # found before an engine started


def test_a_sharded_checkpoint_missing_a_shard(tmp_path):
    model = copy_model(tmp_path)
    (model / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    )
    one_line_exit_2(
        compare(tmp_path, model=model), "names 1 weight file(s) that are not there", "model-00002-of-00002.safetensors"
    )


def test_a_model_directory_without_weights(tmp_path):
    model = copy_model(tmp_path, skip=("model.safetensors",))
    one_line_exit_2(compare(tmp_path, model=model), "has no weights")


def test_declared_python_covers_what_the_code_imports():
    """The code imports tomllib (3.11+): pyproject must not promise 3.10."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = project["requires-python"].removeprefix(">=").split(",")[0].strip()
    assert tuple(int(x) for x in floor.split(".")) >= (3, 11)
    uses_tomllib = any("import tomllib" in p.read_text() for p in (ROOT / "mismatch_probe").rglob("*.py"))
    assert uses_tomllib  # the reason for the floor; drop this test's floor with the import


@pytest.mark.parametrize("start", ["moe", "wider", "not-a-checkpoint"])
def test_a_sync_start_checkpoint_of_another_model(tmp_path, start):
    """sync.start_from holds the weights the engine syncs the model's into: another architecture,
    other tensor shapes or no checkpoint at all is refused by name before an engine starts (vLLM's
    worker died with an empty message on the MoE fixture)."""
    import json

    from conftest import MOE

    if start == "moe":
        path, says = MOE, ["is a Qwen3MoeForCausalLM checkpoint", "the model", "a Qwen2ForCausalLM"]
    elif start == "wider":  # the model's config, one tensor of another shape
        import torch
        from safetensors.torch import load_file, save_file

        path = copy_model(tmp_path)
        tensors = load_file(str(path / "model.safetensors"))
        name = "model.layers.0.mlp.down_proj.weight"
        tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1, dtype=tensors[name].dtype)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
        says = ["holds other tensors than the model", name]
    else:
        path, says = tmp_path, ["is not a checkpoint directory"]
    proc = compare(tmp_path, "--engine", "vllm", "--sync-from", str(path))
    one_line_exit_2(proc, "sync.start_from", *says, "sync.start_from = 'perturbed'")
    assert not (tmp_path / "run").exists()

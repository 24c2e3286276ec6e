"""The committed fixture checkpoints, and the script that builds them."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from conftest import DENSE, FIXTURES, MOE, MULTI_TURN, SINGLE_TURN

from mismatch_probe.modeling.loading import load_tokenizer


def test_fixture_sizes_and_architectures():
    total = sum(p.stat().st_size for d in (DENSE, MOE) for p in d.iterdir())
    assert total < 30 * 2**20
    dense = json.loads((DENSE / "config.json").read_text())
    moe = json.loads((MOE / "config.json").read_text())
    assert dense["architectures"] == ["Qwen2ForCausalLM"]
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (moe.get("num_experts") or moe.get("num_local_experts")) >= 4 and moe["num_experts_per_tok"] == 2
    for d in (DENSE, MOE):
        info = json.loads((d / "build_info.json").read_text())
        assert 1e6 < info["parameters"] < 10e6
        # peaked, not uniform: mean next-token entropy far below log(vocab)
        assert info["heldout_entropy"] < 0.25 * math.log(info["vocab_size"])


def test_tokenizer_has_chat_tokens_and_template():
    tok = load_tokenizer(DENSE)
    for special in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert len(tok) <= json.loads((DENSE / "config.json").read_text())["vocab_size"]


def test_prompt_files():
    for path in (SINGLE_TURN, MULTI_TURN):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 32 and len({r["id"] for r in rows}) == 32
        assert all(r["messages"][-1]["role"] == "user" for r in rows)
    assert all(r["messages"][0]["role"] == "system" for r in map(json.loads, MULTI_TURN.read_text().splitlines()))


def test_build_script_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(FIXTURES / "build.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "mean next-token entropy" in proc.stdout
    from transformers import AutoModelForCausalLM

    for name in ("tiny-qwen2", "tiny-qwen3-moe"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "models" / name))
    assert (tmp_path / "prompts" / "single_turn.jsonl").is_file()

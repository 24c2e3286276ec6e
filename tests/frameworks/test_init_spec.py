"""`init` as a whole: the config's dataset keys and chat template decide how the prompts are read."""

from __future__ import annotations

import json

from conftest import DENSE
from framework_checks import CONFIGS

from mismatch_probe.frameworks.init import init_spec
from mismatch_probe.rollout.prompts import read_prompt_records


def test_slime_reads_its_prompt_key_and_applies_the_chat_template(tmp_path):
    # slime's run-qwen3-4B.sh: --input-key prompt --apply-chat-template (a string wrapped as a user turn)
    data = tmp_path / "dapo.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * (i + 1), "label": "1"}) + "\n" for i in range(40)))
    out = tmp_path / "probe.toml"
    result = init_spec("slime", [str(CONFIGS / "slime" / "run-qwen3-4B.sh")], out=out, dataset=str(data), num_prompts=8)
    assert result.prompts.written == 8 and result.prompts.layout.shape == "text-as-chat"
    rows = [json.loads(line) for line in result.prompts_path.read_text().splitlines()]
    assert all(r["messages"][0]["role"] == "user" for r in rows)
    # stratified by length: the sample spans the short and the long prompts
    lengths = sorted(len(r["messages"][0]["content"]) for r in rows)
    assert lengths[0] <= 10 and lengths[-1] >= 31
    assert 'prompts = "probe-prompts.jsonl"' in out.read_text()


def test_openrlhf_without_the_chat_template_writes_raw_text_and_tokenizes_with_the_model(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"question {i}" * (i % 5 + 1)}) + "\n" for i in range(20)))
    result = init_spec(
        "openrlhf",
        [
            str(CONFIGS / "openrlhf" / "train_ppo_ray_hybrid_engine.sh"),
        ],
        out=tmp_path / "probe.toml",
        dataset=str(data),
        prompt_key="input",
        num_prompts=5,
        model=str(DENSE),
    )
    assert result.prompts.length_unit == "tokens"
    records = read_prompt_records(result.prompts_path)
    assert len(records) == 5


def test_init_refuses_bad_input_in_one_line_with_exit_2(tmp_path):
    from typer.testing import CliRunner

    from mismatch_probe.cli import app

    def run(*args):
        result = CliRunner().invoke(app, ["init", *args])
        return result.exit_code, result.output.strip()

    code, text = run("axolotl", "x.yaml", "--out", str(tmp_path / "p.toml"))
    assert code == 2 and "unknown framework 'axolotl'" in text and "verl" in text
    code, text = run("verl", str(tmp_path / "missing.sh"), "--out", str(tmp_path / "p.toml"))
    assert code == 2 and "no such file" in text
    (tmp_path / "p.toml").write_text("")
    code, text = run("verl", str(CONFIGS / "verl" / "run_qwen2-7b.sh"), "--out", str(tmp_path / "p.toml"))
    assert code == 2 and "--overwrite" in text
    code, text = run(
        "verl", str(CONFIGS / "verl" / "run_qwen2-7b.sh"), "--out", str(tmp_path / "q.toml"), "--set", "engine.nope=1"
    )
    assert code == 2 and "engine.nope" in text


def test_a_bad_set_value_is_refused_by_its_flag_and_nothing_is_written(tmp_path):
    import pytest

    from mismatch_probe.errors import ConfigError

    out = tmp_path / "probe.toml"
    with pytest.raises(ConfigError, match="engine.dtype"):
        init_spec("verl", [str(CONFIGS / "verl" / "run_qwen2-7b.sh")], out=out, settings={"engine.dtype": "int3"})
    assert list(tmp_path.iterdir()) == []

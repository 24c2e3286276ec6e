"""`mismatch-probe init verl CONFIG --dataset DATA.parquet` then `mismatch-probe compare probe.toml`,
end to end on the CPU fixture: verl's own example config, a dataset in verl's parquet layout, the
real vLLM engine; only the model and what this machine cannot run are overridden."""

from __future__ import annotations

import json
import tomllib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DENSE, ROOT, SINGLE_TURN, cli

pytestmark = pytest.mark.vllm

VERL_EXAMPLE = ROOT / "tests" / "frameworks" / "configs" / "verl" / "run_qwen2-7b.sh"
# what a 2-core CPU cannot run of verl's GPU settings: one rank, eager, short responses, sdpa
FOR_THIS_MACHINE = [
    "engine.tensor_parallel_size=1",
    "engine.enforce_eager=true",
    "sampling.max_tokens=16",
    "sampling.n=2",
    "reference.attn_implementation=sdpa",
]


def verl_parquet(path):
    """The fixture's prompts as verl's data preprocessing writes them: a ``prompt`` column of chat
    messages (list<struct<content, role>>) beside columns init must not read."""
    rows = [json.loads(line) for line in SINGLE_TURN.read_text().splitlines() if line.strip()]
    table = pa.table(
        {
            "data_source": ["openai/gsm8k"] * len(rows),
            "prompt": [r["messages"] for r in rows],
            "reward_model": [{"ground_truth": "0", "style": "rule"}] * len(rows),
        }
    )
    pq.write_table(table, path)
    return len(rows)


def test_init_from_verls_config_and_dataset_then_compare(tmp_path):
    data = tmp_path / "train.parquet"
    rows = verl_parquet(data)
    sets = [a for s in FOR_THIS_MACHINE for a in ("--set", s)]
    spec = tmp_path / "probe.toml"
    proc = cli(
        "init", "verl", str(VERL_EXAMPLE), "--dataset", str(data), "--model", str(DENSE),
        "--num-prompts", "6", "--out", str(spec), *sets,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "vLLM cascade attention on shared prefixes" in proc.stdout
    written = tomllib.loads(spec.read_text())
    assert written["engine"]["name"] == "vllm" and written["engine"]["logprobs_mode"] == "processed"
    assert written["reference"]["fsdp"] is True and written["reference"]["logprobs"] == "temperature"
    assert written["stack"]["framework"] == "verl"
    prompts = (tmp_path / "probe-prompts.jsonl").read_text().splitlines()
    assert len(prompts) == 6 < rows and all("messages" in json.loads(p) for p in prompts)

    out = tmp_path / "run"
    proc = cli("compare", str(spec), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "complete"
    assert {r["id"] for r in record["spec"]["stack"]["risks"]} == {"engine-version", "cascade-attention"}
    assert record["spec"]["sampling"]["n"] == 2 and record["spec"]["reference"]["fsdp"] is True
    assert record["metrics"]["n_model_tokens"] > 0
    report = (out / "report.md").read_text()
    assert "Known risks of this verl configuration" in report and "vllm-project/vllm/issues/17652" in report
    assert "known risk of this configuration" in proc.stdout

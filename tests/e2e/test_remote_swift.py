"""ms-swift's rollout server (`swift rollout`, its external GRPO mode) through the remote engine's
``swift`` dialect, against the scripted server (tests/remote_server.py --swift): it takes chat
messages as ms-swift's trainer sends them and renders them with its own template, so its prompt ids
are checked against the checkpoint's chat template (a finding, not an error), and the probe scores
the ids the server sampled from. The reference is the real HF forward on the fixture model.

tests/swift/test_swift_protocol.py checks the scripted server's requests and answers against
ms-swift's own protocol classes; tests/swift/test_swift_rollout.py runs a real `swift rollout`.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import DENSE, MULTI_TURN, SINGLE_TURN, cli
from remote_fixtures import scripted_server

SYSTEM = "You are a helpful assistant."


def spec_file(tmp_path) -> str:
    path = tmp_path / "probe.toml"
    path.write_text('shard_size = 4\n[engine]\napi = "swift"\nmax_retries = 1\nretry_backoff_s = 0.05\n')
    return str(path)


def compare(tmp_path, url: str, out: str, *extra: str, prompts=SINGLE_TURN):
    return cli(
        "compare",
        spec_file(tmp_path),
        "--model",
        str(DENSE),
        "--prompts",
        str(prompts),
        "--engine-url",
        url,
        "--max-prompts",
        "3",
        "--n",
        "2",
        "--max-tokens",
        "10",
        "--temperature",
        "0.8",
        "--train-dtype",
        "float32",
        "--out",
        str(tmp_path / out),
        *extra,
    )


@pytest.fixture(scope="module")
def swift_server(tmp_path_factory):
    """A scripted swift rollout whose template adds a default system prompt, as ms-swift's own
    templates do (a difference from the checkpoint's chat template)."""
    tmp = tmp_path_factory.mktemp("swift")
    with scripted_server(tmp, "--swift", "--swift-tokenizer", str(DENSE), "--swift-default-system", SYSTEM) as server:
        yield server


def test_a_swift_server_is_probed_with_its_template_difference_reported(tmp_path, swift_server):
    proc = compare(tmp_path, swift_server.url, "run")
    assert proc.returncode == 0, proc.stderr
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    check = rec["server_template_check"]
    assert check["n_turns"] == check["n_prompts"] == 6 and check["n_differing"] == 6 and check["share_differing"] == 1
    first = check["examples"][0]
    # the checkpoint's template renders no system prompt; the server's starts with its default one
    assert first["first_difference_at"] == 1 and first["turn"] == 0
    assert first["server_text"].startswith("<|im_start|>system\n" + SYSTEM)
    assert first["tokens_server"] > first["tokens_ours"]
    # the probe scores what the server saw: each rollout starts with the server's rendering
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DENSE)
    chat = next(json.loads(line) for line in SINGLE_TURN.read_text().splitlines())["messages"]
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, *chat], tokenize=False, add_generation_prompt=True
    )
    server_ids = tok.encode(rendered, add_special_tokens=False)
    rollouts = pq.read_table(tmp_path / "run" / "rollouts" / "part-00000.parquet").to_pylist()
    row = next(r for r in rollouts if r["sample_id"] == 0)
    assert row["token_ids"][: len(server_ids)] == server_ids
    assert not any(row["is_model_token"][: len(server_ids)]) and row["is_model_token"][len(server_ids)]
    engine = rec["engine"]
    assert engine["api"] == "swift" and engine["renders_prompts"] == "swift rollout"
    assert engine["world_size"] == 1 and engine["engine_type"] == "LLMEngine"
    assert "processed_logprobs" in engine["unknown"]["logprobs_mode"]
    assert rec["logprob_semantics"]["engine"]["mode"] == "processed"
    assert "swift rollout takes chat messages" in rec["decode_vs_prefill"]["skipped"]
    assert rec["metrics"]["n_model_tokens"] > 0
    report = (tmp_path / "run" / "report.md").read_text()
    assert "server's chat template" in report and "6 of 6 contexts (100%) differ" in report
    # the gate reads the share
    gate = tmp_path / "gate.toml"
    gate.write_text(
        '[[checks]]\nname = "template"\nmetric = "server_template_check.share_differing"\nop = "<="\n'
        'threshold = 0\nseverity = "fail"\n'
    )
    proc = cli("gate", str(tmp_path / "run"), "--thresholds", str(gate))
    assert proc.returncode == 1, proc.stdout + proc.stderr


def test_later_turns_whose_server_rendering_differs_end_the_conversation(tmp_path, swift_server):
    # a recorded conversation: the server re-renders the whole chat each turn, the sampled turn as text
    system, user = json.loads(MULTI_TURN.read_text().splitlines()[0])["messages"]
    recorded = [system, user, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "180"}]
    prompts = tmp_path / "recorded.jsonl"
    prompts.write_text(json.dumps({"id": "replay", "messages": recorded}) + "\n")
    proc = compare(tmp_path, swift_server.url, "run", "--max-turns", "2", prompts=prompts)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    check = rec["server_template_check"]
    # the first turns agree (the chat has its own system prompt); a sampled turn decoded and re-encoded
    # by the server's template differs from the sampled ids (random tiny-model tokens), so it ends there
    assert check["n_prompts"] == 2 and check["n_prompts_differing"] == 0
    later = [e for e in check["examples"] if e["turn"] == 1]
    assert check["n_cut"] == len(later) == check["n_differing"] >= 1
    assert rec["samples"]["finish_reasons"].get("context_differs") == check["n_cut"]
    rollouts = pq.read_table(tmp_path / "run" / "rollouts" / "part-00000.parquet").to_pylist()
    for row in rollouts:  # a cut conversation keeps its first turn and the recorded tool block
        turns = np.array(row["turn"])
        assert set(turns[np.array(row["is_model_token"])]) == (
            {0} if row["finish_reason"] == "context_differs" else {0, 1}
        )


def test_what_a_swift_server_cannot_do_is_refused(tmp_path, swift_server):
    token_prompts = tmp_path / "ids.jsonl"
    token_prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    proc = compare(tmp_path, swift_server.url, "ids", prompts=token_prompts)
    assert proc.returncode == 2 and "has no chat messages, but swift rollout takes chat messages" in proc.stderr
    proc = compare(tmp_path, swift_server.url, "sync", "--sync-from", str(DENSE), "--no-prefill-check")
    assert proc.returncode == 2 and "NCCL broadcast" in proc.stderr
    with scripted_server(tmp_path, "--swift", "--swift-multi-turn-scheduler") as scheduler:
        proc = compare(tmp_path, scheduler.url, "scheduler")
    assert (
        proc.returncode == 2
        and "its own multi-turn scheduler" in proc.stderr
        and "--multi_turn_scheduler" in proc.stderr
    )

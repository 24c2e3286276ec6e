"""ms-swift's rollout server through the remote engine's ``swift`` dialect, against the scripted
server (tests/remote_server.py --swift, whose template adds a default system prompt): a multi-turn
probe, in which the server re-renders the whole conversation each turn, and prompts it cannot take.
The reference is the real HF forward on the fixture model.

tests/swift/test_swift_rollout.py runs a real `swift rollout` (the single-turn probe, its template
check in run.json, the report and the gate); tests/swift/test_swift_protocol.py checks the scripted
server's requests and answers against ms-swift's own protocol classes; tests/unit/test_swift_dialect.py
the dialect on answers written by hand.
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


def test_prompts_without_chat_messages_are_refused(tmp_path, swift_server):
    token_prompts = tmp_path / "ids.jsonl"
    token_prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    proc = compare(tmp_path, swift_server.url, "ids", prompts=token_prompts)
    assert proc.returncode == 2 and "has no chat messages, but swift rollout takes chat messages" in proc.stderr
    assert not (tmp_path / "ids" / "rollouts" / "part-00000.parquet").exists()

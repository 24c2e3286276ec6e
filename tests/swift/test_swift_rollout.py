"""A real `swift rollout` (ms-swift 4.6.0, its vLLM CPU engine; tests/swift/launch_rollout.py
applies the two patches it needs on a CPU-only machine) probed through the remote engine's
``swift`` dialect: a normal run whose rollouts start with the prompt ids the server rendered, and
whose template check finds what ms-swift's default Qwen template does (it adds its own system
prompt, which the checkpoint's chat template does not). The reference is the real HF forward.

MISMATCH_PROBE_REQUIRE_SWIFT=1 (set by CI) turns the skip into a failure.
"""

from __future__ import annotations

import json
import sys

import pyarrow.parquet as pq
import pytest
from conftest import DENSE, ROOT, SINGLE_TURN, cli
from remote_fixtures import Server, free_port
from required import unavailable

SITE = ROOT / ".swift-site"
SWIFT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@pytest.fixture(scope="module")
def swift_rollout(tmp_path_factory):
    if not (SITE / "swift").is_dir():
        unavailable("SWIFT", f"swift rollout needs ms-swift in {SITE}: bash tests/swift/install.sh .swift-site")
    port = free_port()
    cmd = [sys.executable, str(ROOT / "tests" / "swift" / "launch_rollout.py"), "--model", str(DENSE)]
    cmd += ["--model_type", "qwen2", "--template", "qwen2_5", "--port", str(port), "--torch_dtype", "bfloat16"]
    log = tmp_path_factory.mktemp("swift") / "swift-rollout.log"
    server = Server(cmd, log=log, port=port, env={"PYTHONPATH": str(SITE)})
    try:
        server.wait_ready("/health/", timeout_s=600)
        yield server
    finally:
        server.stop()


def test_a_real_swift_rollout_is_probed(tmp_path, swift_rollout):
    spec = tmp_path / "probe.toml"
    spec.write_text('[engine]\napi = "swift"\ndtype = "bfloat16"\n')
    out = tmp_path / "run"
    proc = cli(
        "compare", str(spec), "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--engine-url",
        swift_rollout.url, "--max-prompts", "4", "--n", "2", "--max-tokens", "16", "--temperature", "0.8",
        "--train-dtype", "float32", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((out / "run.json").read_text())
    engine = rec["engine"]
    assert engine["api"] == "swift" and engine["world_size"] == 1 and engine["engine_type"] == "LLMEngine"
    # ms-swift's Qwen2.5 template (the one Qwen2.5 checkpoints match) inserts its own system prompt
    check = rec["server_template_check"]
    assert check["n_prompts"] == 8 and check["share_differing"] == 1
    first = check["examples"][0]
    assert first["first_difference_at"] == 1 and first["server_text"].startswith("<|im_start|>system\nYou are Qwen")
    # the rollouts start with the server's rendering, and the reference scores exactly those tokens:
    # its processed log-probs of what the bf16 engine sampled agree as a bf16-vs-fp32 pair does
    rows = pq.read_table(out / "rollouts").to_pylist()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DENSE)
    for row in rows:
        n_prompt = row["is_model_token"].index(True)
        assert tok.decode(row["token_ids"][:n_prompt]).startswith(f"<|im_start|>system\n{SWIFT_SYSTEM}")
    metrics = rec["metrics"]
    assert metrics["n_model_tokens"] > 40 and 0 < metrics["k3_kl"] < 1e-2, metrics
    assert rec["logprob_semantics"]["engine"]["mode"] == "processed" and rec["logprob_semantics"]["matched"]
    report = (out / "report.md").read_text()
    assert "server's chat template" in report and "8 of 8 contexts (100%) differ" in report
    # the gate reads the share
    gate = tmp_path / "gate.toml"
    gate.write_text(
        '[[checks]]\nname = "template"\nmetric = "server_template_check.share_differing"\nop = "<="\n'
        'threshold = 0\nseverity = "fail"\n'
    )
    proc = cli("gate", str(out), "--thresholds", str(gate))
    assert proc.returncode == 1 and "template" in proc.stdout, proc.stdout + proc.stderr

"""A real `trl vllm-serve` (TRL 1.16.0 from .trl-site, on vLLM's CPU build; tests/trl/install.sh
says what it adds for that build) probed through the remote engine's ``trl`` dialect: it samples
and re-scores the sampled ids through the server's /v1/completions, as TRL's trainers do, with the
settings trl vllm-serve imposes read back into run.json; its weight sync is refused before any
request. One server for the module (a vLLM start).

MISMATCH_PROBE_REQUIRE_TRL=1 (set by CI) turns the skip into a failure.
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import DENSE, ROOT, SINGLE_TURN, cli
from remote_fixtures import Server, free_port
from required import unavailable

from mismatch_probe.config.spec import SyncSpec
from mismatch_probe.engines.remote import check_sync
from mismatch_probe.errors import ConfigError

SITE = ROOT / ".trl-site"


@pytest.fixture(scope="module")
def trl_serve(tmp_path_factory):
    if not (SITE / "trl").is_dir():
        unavailable("TRL", f"trl vllm-serve needs TRL in {SITE}: bash tests/trl/install.sh .trl-site")
    port = free_port()
    cmd = [sys.executable, "-m", "trl.scripts.vllm_serve", "--model", str(DENSE), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", "bfloat16", "--enforce_eager", "true", "--max_model_len", "1024"]
    cmd += ["--seed", "11", "--kv-cache-memory-bytes", str(256 * 2**20)]  # passed on to vllm serve as they are
    log = tmp_path_factory.mktemp("trl") / "trl-vllm-serve.log"
    server = Server(cmd, log=log, port=port, env={"PYTHONPATH": str(SITE), "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        server.wait_ready("/health", timeout_s=600)
        yield server
    finally:
        server.stop()


def test_a_real_trl_vllm_serve_is_probed(tmp_path, trl_serve):
    spec = tmp_path / "probe.toml"
    spec.write_text('[engine]\napi = "trl"\ndtype = "bfloat16"\n')
    out = tmp_path / "run"
    proc = cli(
        "compare", str(spec), "--model", str(DENSE), "--prompts", str(SINGLE_TURN), "--engine-url",
        trl_serve.url, "--max-prompts", "4", "--n", "2", "--max-tokens", "16", "--temperature", "1.0",
        "--train-dtype", "float32", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((out / "run.json").read_text())
    engine = rec["engine"]
    # what trl vllm-serve imposes (trl/scripts/vllm_serve.py: build_command), read back from the server
    assert engine["api"] == "trl" and engine["world_size"] == 1 and engine["weight_transfer_backend"] == "nccl"
    assert engine["server"]["trl"] == {
        "logprobs_mode": "processed_logprobs",
        "max_logprobs": -1,
        "weight_transfer_config": {"backend": "nccl"},
    }
    assert engine["logprobs_mode"] == "processed" and engine["logprobs_mode_source"] == "read from the server"
    assert engine["versions"] == {"vllm": "0.32.0"} and "trl_version" in engine["unknown"]
    assert engine["model_check"]["matched"] and engine["model_check"]["tokenizer"]
    # TRL's processed log-probs, matched by the reference's distribution at the bf16-vs-fp32 floor; at
    # temperature 1 without top-k/top-p they are the raw ones, so the prefill re-score is comparable
    assert rec["logprob_semantics"]["matched"]
    metrics = rec["metrics"]
    assert metrics["n_model_tokens"] > 40 and 0 < metrics["k3_kl"] < 1e-2, metrics
    # the sampled ids re-scored through the same route's prompt_logprobs (as get_sequence_logprobs does)
    prefill = rec["decode_vs_prefill"]
    assert "skipped" not in prefill and prefill["n_model_tokens"] == metrics["n_model_tokens"], prefill


@pytest.mark.parametrize("transfer", ["disk", "tensor", "nccl"])
def test_its_weight_sync_is_refused_before_any_request(transfer):
    with pytest.raises(ConfigError, match="NCCL weight-transfer engine") as caught:
        check_sync(SyncSpec(start_from="perturbed", transfer=transfer), "trl")
    assert "--engine-api openai --sync-transfer disk" in caught.value.hint

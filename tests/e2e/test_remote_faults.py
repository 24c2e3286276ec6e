"""A remote engine's faults, through the CLI a user runs, against the scripted server
(tests/remote_server.py, deterministic per request body): 500s and timeouts retried then reported;
a server killed mid-run gives a one-line error, keeps what it answered, and the re-run completes
with the results of an uninterrupted run; a server with another model, one that answers text
only, and ms-swift's `swift rollout` are refused; the API key appears in no file and no output.

The reference is the real HF forward on the fixture model; only the engine's side is scripted.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
from conftest import DENSE, SINGLE_TURN, cli
from remote_fixtures import scripted_server


def write_spec(tmp_path, **engine) -> str:
    """The client settings a fault test needs (short waits), in a spec file."""
    settings = {"max_retries": 1, "retry_backoff_s": 0.05, "max_concurrency": 4, **engine}
    lines = ["shard_size = 4", "[engine]"] + [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path = tmp_path / "probe.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def compare(spec: str, url: str, out, *extra: str, env: dict | None = None, prompts: int = 8):
    return cli(
        "compare",
        spec,
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--engine-url",
        url,
        "--max-prompts",
        str(prompts),
        "--n",
        "2",
        "--max-tokens",
        "12",
        "--temperature",
        "0.8",
        "--train-dtype",
        "float32",
        "--out",
        str(out),
        *extra,
        env=env,
    )


def error_lines(proc) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def assert_same_rollouts(a, b) -> None:
    ta, tb = (pq.read_table(d / "rollouts").sort_by("sample_id") for d in (a, b))
    assert ta.column("sample_id").to_pylist() == tb.column("sample_id").to_pylist()
    assert ta.column("token_ids").to_pylist() == tb.column("token_ids").to_pylist()
    for name in ("logp_infer", "logp_prefill"):  # NaN where there is nothing to score, on both sides
        x, y = (np.concatenate(t.column(name).to_numpy(zero_copy_only=False)) for t in (ta, tb))
        np.testing.assert_array_equal(x, y)


def test_a_server_killed_mid_run_keeps_its_answers_and_the_rerun_completes_identically(tmp_path):
    spec = write_spec(tmp_path)
    run = tmp_path / "run"
    # 16 samples in 4 shards, each 4 sampled + 4 prefilled: the server dies in the second shard
    with scripted_server(tmp_path, "--die-after", "10") as dying:
        proc = compare(spec, dying.url, run)
    assert proc.returncode == 1, proc.stderr
    (line,) = error_lines(proc)
    assert "failed 2 times" in line and "answers received are kept" in line and "re-run the same command" in line
    assert sorted(p.name for p in (run / "rollouts").glob("part-*")) == ["part-00000.parquet"]
    received = (run / "rollouts" / ".received" / "received.jsonl").read_text().splitlines()
    assert len(received) == 10
    assert json.loads((run / "run.json").read_text())["status"] == "failed"

    with scripted_server(tmp_path, "--version", "0.0.1-other") as upgraded:  # another build: no mixing
        proc = compare(spec, upgraded.url, run)
        assert proc.returncode == 2 and upgraded.stats()["attempts"] == 0
        assert "the server now runs vllm 0.0.1-other (was 0.0.0-scripted)" in proc.stderr

    with scripted_server(tmp_path) as restarted:  # back, at another port
        proc = compare(spec, restarted.url, run)
        assert proc.returncode == 0, proc.stderr
        # only what was not received: 16 samples x (sampling + prefill), less the journal's
        assert restarted.stats()["attempts"] == 32 - len(received)
    assert not (run / "rollouts" / ".received").exists()  # every answer is in a shard now

    with scripted_server(tmp_path) as fresh:
        proc = compare(spec, fresh.url, tmp_path / "uninterrupted")
        assert proc.returncode == 0, proc.stderr
    assert_same_rollouts(run, tmp_path / "uninterrupted")
    metrics = [json.loads((d / "run.json").read_text())["metrics"] for d in (run, tmp_path / "uninterrupted")]
    assert metrics[0] == metrics[1]


def test_500s_and_timeouts_are_retried_then_reported(tmp_path):
    # every request: a 500, then no answer within the timeout, then the answer
    spec = write_spec(tmp_path, max_retries=2, request_timeout_s=0.5)
    with scripted_server(tmp_path, "--fail-attempts", "1", "--hang-attempts", "2", "--hang-s", "2") as server:
        proc = compare(spec, server.url, tmp_path / "run", prompts=2)
        assert proc.returncode == 0, proc.stderr
        assert server.stats()["attempts"] == 3 * 8  # 4 samples, sampled and prefilled
    log = (tmp_path / "run" / "engine.log").read_text()
    assert log.count("HTTP 500: scripted failure 1; retry 1/2") == 8
    assert log.count("no answer in time (ReadTimeout); retry 2/2") == 8

    with scripted_server(tmp_path, "--fail-attempts", "99") as server:
        proc = compare(write_spec(tmp_path), server.url, tmp_path / "failing", prompts=2)
    assert proc.returncode == 1
    (line,) = error_lines(proc)
    assert "failed 2 times; last: HTTP 500: scripted failure 2" in line


def test_a_server_with_another_model_is_refused_unless_overridden(tmp_path):
    spec = write_spec(tmp_path)
    with scripted_server(tmp_path, "--model", "other-model", "--root", "/models/Other-Model-7B") as server:
        proc = compare(spec, server.url, tmp_path / "run", prompts=2)
        assert proc.returncode == 2
        (line,) = error_lines(proc)
        assert (
            "does not serve the checkpoint the reference loads (tiny-qwen2): it serves Other-Model-7B, other-model"
            in line
        )
        assert "--no-check-model" in proc.stderr

        proc = compare(spec, server.url, tmp_path / "named", "--engine-model", "tiny-qwen2", prompts=2)
        assert proc.returncode == 2 and "does not serve a model named 'tiny-qwen2'" in proc.stderr

        proc = compare(spec, server.url, tmp_path / "overridden", "--no-check-model", prompts=2)
        assert proc.returncode == 0, proc.stderr
    check = json.loads((tmp_path / "overridden" / "run.json").read_text())["engine"]["model_check"]
    assert check["matched"] is False and check["overridden"] == "engine.check_model = false"


def test_the_api_key_is_used_and_never_written(tmp_path):
    key = "sk-probe-3c9e41f0a7"
    spec = write_spec(tmp_path, api_key_env="MP_TEST_SERVER_KEY")
    with scripted_server(tmp_path, "--api-key", key) as server:
        proc = compare(spec, server.url, tmp_path / "run", env={"MP_TEST_SERVER_KEY": key}, prompts=2)
        assert proc.returncode == 0, proc.stderr
        assert server.stats()["auth"] == 0
        wrong = compare(spec, server.url, tmp_path / "wrong", env={"MP_TEST_SERVER_KEY": "nope"}, prompts=2)
        unset = compare(spec, server.url, tmp_path / "unset", prompts=2)
    assert key not in proc.stdout + proc.stderr
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(files) > 5 and not [p for p in files if key.encode() in p.read_bytes()]
    engine = json.loads((tmp_path / "run" / "run.json").read_text())["engine"]
    assert engine["client"]["api_key"] == "from $MP_TEST_SERVER_KEY"
    assert wrong.returncode == 2 and "HTTP 401: Unauthorized" in wrong.stderr and "api_key_env" in wrong.stderr
    assert unset.returncode == 2 and "MP_TEST_SERVER_KEY, which is not set" in unset.stderr


def test_servers_that_cannot_give_token_ids_are_refused(tmp_path):
    spec = write_spec(tmp_path)
    with scripted_server(tmp_path, "--text-only") as server:
        proc = compare(spec, server.url, tmp_path / "text", prompts=2)
    assert proc.returncode == 2
    assert "returns sampled tokens as text, not ids" in proc.stderr and "--return-tokens-as-token-ids" in proc.stderr
    with scripted_server(tmp_path, "--swift") as server:
        proc = compare(spec, server.url, tmp_path / "swift", prompts=2)
    assert (
        proc.returncode == 2
        and "ms-swift's `swift rollout` server" in proc.stderr
        and "--engine-api swift" in proc.stderr
    )
    with scripted_server(tmp_path, "--trl-serve") as server:
        proc = compare(spec, server.url, tmp_path / "trl", prompts=2)
    assert proc.returncode == 2 and "TRL's `trl vllm-serve`" in proc.stderr
    proc = compare(spec, "http://127.0.0.1:9", tmp_path / "nothing", prompts=2)
    assert proc.returncode == 2 and "cannot reach the rollout server at http://127.0.0.1:9/v1/models" in proc.stderr


def test_an_sglang_router_without_server_info_is_probed_with_its_settings_unknown(tmp_path):
    spec = write_spec(tmp_path, api="sglang", logprobs_mode="raw")
    with scripted_server(tmp_path, "--sglang-router") as router:
        proc = compare(spec, router.url, tmp_path / "run", prompts=2)
        assert proc.returncode == 0, proc.stderr
        assert router.stats()["attempts"] == 8  # 4 samples, sampled and prefilled
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    unknown = rec["engine"]["unknown"]
    assert "a router?" in unknown["dtype"] and "a router?" in unknown["tensor_parallel_size"]
    assert rec["engine"]["versions"] == {} and "a router?" in unknown["version"]
    assert rec["decode_vs_prefill"]["n_model_tokens"] == rec["metrics"]["n_model_tokens"] > 0

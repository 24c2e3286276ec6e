"""The remote engine's HTTP client against the scripted server (tests/remote_server.py): retries on
500, 429 and timeouts, then a report; nothing retried on a refusal; answers journaled as they
arrive and never asked for twice; the API key in the header only. Plus the pure helpers and the
spec's remote settings."""

from __future__ import annotations

import json
import shutil

import pytest
from remote_fixtures import scripted_server, self_signed_certificate

from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.config.spec_reading import spec_from_dict
from mismatch_probe.engines import get_entry
from mismatch_probe.engines.http_client import Client, Journal, RequestFailed, body_key, redact_url
from mismatch_probe.engines.remote import check_spec, server_changes
from mismatch_probe.engines.remote.openai import _label_value, _prometheus_labels, _token_id
from mismatch_probe.errors import ConfigError

MODEL = "tiny-qwen2"


def bodies(n: int, **kw) -> list[dict]:
    return [{"model": MODEL, "prompt": [1, 7, 80 + i], "max_tokens": 4, "seed": i, **kw} for i in range(n)]


def client(url: str, logs: list | None = None, **kw) -> Client:
    sink = logs if logs is not None else []
    return Client(url=url, backoff_s=0.01, log=sink.append, **kw)


def test_500s_are_retried_with_backoff_then_answered(tmp_path):
    logs: list[str] = []
    with scripted_server(tmp_path, "--fail-attempts", "2") as server:
        answers = client(server.url, logs, max_retries=3).post_all("/v1/completions", bodies(5), what=str)
        stats = server.stats()
    assert len(answers) == 5 and all(a["choices"][0]["token_ids"] for a in answers)
    assert stats["attempts"] == 15 and stats["answered"] == 5  # two failures, then the answer, each
    assert sum("HTTP 500: scripted failure" in line for line in logs) == 10
    assert any("retry 2/3" in line for line in logs)


def test_500s_past_the_retries_are_reported_with_the_servers_message(tmp_path):
    with scripted_server(tmp_path, "--fail-attempts", "10") as server:
        with pytest.raises(RequestFailed) as err:
            client(server.url, max_retries=2).post_all("/v1/completions", bodies(1), what=lambda i: f"request {i}")
        assert server.stats()["attempts"] == 3
    assert str(err.value) == "request 0 failed 3 times; last: HTTP 500: scripted failure 3"
    assert err.value.retried


def test_429_waits_as_told_then_answers(tmp_path):
    with scripted_server(tmp_path, "--throttle-attempts", "2") as server:
        answers = client(server.url, max_retries=2).post_all("/v1/completions", bodies(3), what=str)
        assert server.stats()["attempts"] == 9
    assert len(answers) == 3


def test_a_request_past_its_timeout_is_retried_then_reported(tmp_path):
    with scripted_server(tmp_path, "--hang-attempts", "1", "--hang-s", "3") as server:
        answers = client(server.url, timeout_s=0.5, max_retries=1).post_all("/v1/completions", bodies(2), what=str)
        assert len(answers) == 2
    timed_out = pytest.raises(RequestFailed, match=r"failed 2 times; last: no answer in time \(ReadTimeout\)")
    with scripted_server(tmp_path, "--hang-attempts", "5", "--hang-s", "3") as server, timed_out:
        client(server.url, timeout_s=0.5, max_retries=1).post_all("/v1/completions", bodies(1), what=str)


def test_a_refusal_is_not_retried(tmp_path):
    refused = pytest.raises(RequestFailed, match="HTTP 404: The model `other` does not exist")
    with scripted_server(tmp_path) as server, refused as err:
        client(server.url).post_all("/v1/completions", [{**bodies(1)[0], "model": "other"}], what=str)
    assert err.value.status == 404 and not err.value.retried


def test_answers_are_journaled_as_they_arrive_and_not_asked_for_again(tmp_path):
    journal_dir = tmp_path / "received"
    with scripted_server(tmp_path) as server:
        first = client(server.url).post_all("/v1/completions", bodies(4), what=str, journal=Journal(journal_dir))
        journal = Journal(journal_dir)
        assert len(journal) == 4
        seen = []
        again = client(server.url).post_all(
            "/v1/completions", bodies(6), what=str, journal=journal, on_answer=lambda i, a: seen.append(i)
        )
        assert server.stats()["attempts"] == 6  # 4, then only the 2 new ones
    assert again[:4] == first and sorted(seen) == list(range(6))
    assert len(Journal(journal_dir)) == 6


def test_a_journal_line_cut_short_by_a_kill_is_ignored_and_the_next_starts_fresh(tmp_path):
    journal = Journal(tmp_path)
    journal.put("a", {"x": 1})
    journal.close()
    with open(tmp_path / "received.jsonl", "ab") as f:
        f.write(b'{"key": "b", "answer": {"x"')  # the process died here
    journal = Journal(tmp_path)
    assert journal.answers == {"a": {"x": 1}}
    journal.put("c", {"x": 3})
    journal.close()
    assert Journal(tmp_path).answers == {"a": {"x": 1}, "c": {"x": 3}}


def test_the_api_key_goes_in_the_header_and_is_scrubbed_from_messages(tmp_path):
    key = "sk-test-8f1d2c"
    with scripted_server(tmp_path, "--api-key", key) as server:
        assert len(client(server.url, api_key=key).post_all("/v1/completions", bodies(2), what=str)) == 2
        with pytest.raises(RequestFailed, match="HTTP 401: Unauthorized") as err:
            client(server.url, api_key="wrong").post_all("/v1/completions", bodies(1), what=str)
    assert err.value.status == 401
    assert client("http://x", api_key=key).redact(f"echo {key} back") == "echo *** back"


def test_body_keys_ignore_the_model_name_only():
    a, b = bodies(2)
    assert body_key("/p", a) == body_key("/p", {**a, "model": "renamed"})
    assert body_key("/p", a) != body_key("/p", b) != body_key("/q", b)
    assert body_key("/p", a) == body_key("/p", dict(reversed(list(a.items()))))  # key order


def test_url_passwords_are_redacted():
    assert redact_url("https://me:secret@host:8443/x") == "https://me:***@host:8443/x"
    assert redact_url("http://host:8000") == "http://host:8000"


def test_prometheus_labels_and_token_ids():
    text = (
        "# HELP vllm:cache_config_info Information\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="fp8",enable_prefix_caching="True",'
        'gpu_memory_utilization="0.9",num_cpu_blocks="None",note="a \\"q\\""} 1.0\n'
    )
    labels = _prometheus_labels(text, "vllm:cache_config_info")
    assert labels == {
        "block_size": "16",
        "cache_dtype": "fp8",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "num_cpu_blocks": "None",
        "note": 'a "q"',
    }
    assert [_label_value(labels[k]) for k in ("block_size", "enable_prefix_caching", "gpu_memory_utilization")] == [
        16,
        True,
        0.9,
    ]
    assert _label_value("None") is None and _prometheus_labels("", "x") is None
    assert _token_id("token_id:42") == 42 and _token_id("Hello") is None and _token_id("token_id:x") is None


def spec(**engine) -> ProbeSpec:
    return spec_from_dict({"model": "m", "prompts": "p.jsonl", "engine": engine}).normalized()


def test_a_url_selects_the_remote_engine_and_its_default_logprobs():
    assert spec(url="http://h:1").engine.name == "remote"
    assert spec(url="http://h:1").engine.logprobs_mode == "raw"  # vLLM's raw_logprobs
    assert spec(url="http://h:1", api="sglang").engine.logprobs_mode == "processed"


def test_how_the_server_is_reached_changes_no_fingerprint():
    a = spec(url="http://h:1")
    b = spec(url="http://other:2", served_model="x", max_concurrency=4, request_timeout_s=5, api_key_env="K")
    assert a.fingerprint() == b.fingerprint() and a.rollout_fingerprint() == b.rollout_fingerprint()
    assert a.fingerprint() != spec(url="http://h:1", seed_requests=False).fingerprint()
    assert a.rollout_fingerprint() != spec(url="http://h:1", api="sglang").rollout_fingerprint()


def test_remote_settings_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="needs the server's address"):
        check_spec(spec(name="remote").engine)
    with pytest.raises(ConfigError, match="is not an http"):
        check_spec(spec(url="ftp://h").engine)
    with pytest.raises(ConfigError, match="ends in /v1"):
        check_spec(spec(url="http://h:8000/v1").engine)
    with pytest.raises(ConfigError, match="engine.api must be one of openai, sglang"):
        check_spec(spec(url="http://h:1", api="grpc").engine)
    with pytest.raises(ConfigError, match=r"engine 'vllm' has no setting engine.url \(--engine-url\)") as err:
        get_entry("vllm").check_settings(spec(name="vllm", url="http://h:1").engine)
    assert err.value.hint == "it applies to: remote"
    with pytest.raises(ConfigError, match=r"engine 'remote' has no setting engine.tensor_parallel_size"):
        get_entry("remote").check_settings(spec(url="http://h:1", tensor_parallel_size=2).engine)
    with pytest.raises(ConfigError, match="engine.ca_bundle '/nowhere.pem' is not a file"):
        check_spec(spec(url="https://h:1", ca_bundle="/nowhere.pem").engine)
    with pytest.raises(ConfigError, match="max_concurrency must be >= 1"):
        spec(url="http://h:1", max_concurrency=0)


def test_the_remote_engine_is_listed(tmp_path):
    entry = get_entry("remote")
    assert entry.missing() == [] and "openai" in entry.description
    assert json.dumps(sorted(entry.settings))  # a plain list of names, for `mismatch-probe engines`


def test_a_server_restarted_with_other_settings_is_a_change():
    before = {"engine": "remote", "versions": {"vllm": "0.11.0"}, "dtype": "bfloat16", "block_size": 16}
    assert server_changes(before, {**before, "block_size": 32}) == []  # not a sampling setting
    assert server_changes(before, {**before, "dtype": "float16", "versions": {"vllm": "0.11.1"}}) == [
        "vllm 0.11.1 (was 0.11.0)",
        "dtype='float16' (was 'bfloat16')",
    ]
    assert server_changes(before, {k: v for k, v in before.items() if k != "dtype"}) == []  # unknown now
    assert server_changes({**before, "engine": "vllm"}, {**before, "dtype": "float16"}) == []


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_certificates_are_verified_unless_a_ca_bundle_vouches_for_them(tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    with scripted_server(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key)) as server:
        server.scheme = "https"
        with pytest.raises(ConfigError, match="cannot reach the rollout server at https://.*CERTIFICATE_VERIFY_FAILED"):
            Client(url=server.url, backoff_s=0.01).get("/v1/models")
        status, models = Client(url=server.url, verify=str(cert)).get("/v1/models")
        assert status == 200 and models["data"][0]["id"] == MODEL
        assert Client(url=server.url, verify=False).get("/version")[0] == 200

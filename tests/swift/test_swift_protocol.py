"""The ``swift`` dialect against ms-swift's own protocol classes (swift/infer_engine/protocol.py,
from the ms-swift release tests/swift/install.sh puts in .swift-site): what the dialect sends
parses as the RolloutInferRequest and RequestConfig ms-swift's server builds from it; what the
scripted server (tests/remote_server.py --swift) answers validates as RolloutOutput and has no
field ms-swift's models lack; and an answer built with ms-swift's own classes reads back as the
sampled ids, their log-probs and the prompt ids it carries.

ms-swift runs in a subprocess (PYTHONPATH=.swift-site over this interpreter): importing it patches
transformers, which the rest of the test session must not see. MISMATCH_PROBE_REQUIRE_SWIFT=1 (set
by CI) turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from conftest import DENSE, ROOT
from remote_fixtures import scripted_server
from required import unavailable

from mismatch_probe.config.spec import SamplingSpec
from mismatch_probe.engines.base import GenerationRequest
from mismatch_probe.engines.remote.swift import SwiftDialect

SITE = ROOT / ".swift-site"


def run_with_swift(code: str, payload) -> dict:
    """Run ``code`` with ms-swift importable; it reads ``payload`` (JSON) from stdin as ``data`` and
    sets ``out``, which comes back."""
    if not (SITE / "swift").is_dir():
        unavailable("SWIFT", f"ms-swift's protocol classes need {SITE}: bash tests/swift/install.sh .swift-site")
    script = f"import json, sys\ndata = json.load(sys.stdin)\n{code}\nprint(json.dumps(out))"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SITE)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CHECK = """
import dataclasses
from swift.infer_engine.protocol import (
    ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage, RequestConfig, RolloutInferRequest,
    RolloutOutput, UsageInfo,
)

def names(cls):
    return sorted(f.name for f in dataclasses.fields(cls))

out = {"requests": [], "answers": []}
for body in data["bodies"]:
    # the server's FastAPI route takes these two embedded bodies (rollout.py: SwiftRolloutDeploy.infer)
    assert sorted(body) == ["infer_requests", "request_config"], sorted(body)
    config = RequestConfig(**body["request_config"])  # a dataclass: an unknown field raises TypeError
    requests = [RolloutInferRequest(**r) for r in body["infer_requests"]]
    out["requests"].append({"config": dataclasses.asdict(config), "messages": [r.messages for r in requests]})
for answer in data["answers"]:
    for item in answer:
        output = RolloutOutput.model_validate(item)
        response = item["response"]
        choice = response["choices"][0]
        extra = {
            "output": sorted(set(item) - set(RolloutOutput.model_fields)),
            "response": sorted(set(response) - set(names(ChatCompletionResponse))),
            "choice": sorted(set(choice) - set(names(ChatCompletionResponseChoice))),
            "message": sorted(set(choice["message"]) - set(names(ChatMessage))),
            "usage": sorted(set(response["usage"]) - set(names(UsageInfo))),
        }
        out["answers"].append({"extra": extra, "type": type(output.response).__name__})
# an answer as ms-swift's own server makes it (grpo_vllm_engine.py: _create_chat_completion_response)
choice = ChatCompletionResponseChoice(
    index=0,
    message=ChatMessage(role="assistant", content="2+3=5"),
    finish_reason="stop",
    logprobs={"content": [{"token": "2", "logprob": -0.5, "bytes": [50]}, {"token": "5", "logprob": -0.25, "bytes": [53]}]},
    token_ids=[17, 20],
)
response = ChatCompletionResponse(
    model="tiny-qwen2", choices=[choice], usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5),
    prompt_token_ids=[1, 2, 3],
)
out["swift_made"] = [RolloutOutput(response=response).model_dump(mode="json")]
"""


def test_the_swift_dialect_speaks_ms_swifts_protocol(tmp_path):
    dialect = SwiftDialect()
    chat = [{"role": "user", "content": "What is 2+3?"}]
    request = GenerationRequest(np.array([1, 2, 3], np.int32), 12, chat)
    sampling = SamplingSpec(temperature=0.7, top_p=0.9, top_k=20, max_tokens=12)
    bodies = [
        dialect.generate_body("", request, sampling, [5], 1234),
        dialect.generate_body("", request, SamplingSpec(temperature=1.0), [5], None),
    ]
    with scripted_server(tmp_path, "--swift", "--swift-tokenizer", str(DENSE)) as server:
        answers = [httpx.post(server.url + "/infer/", json=b, timeout=60).json() for b in bodies]
    out = run_with_swift(CHECK, {"bodies": bodies, "answers": answers})

    config = out["requests"][0]["config"]
    assert out["requests"][0]["messages"] == [chat]
    assert config["logprobs"] is True and config["return_details"] is True and config["n"] == 1
    assert (config["temperature"], config["top_p"], config["top_k"], config["seed"]) == (0.7, 0.9, 20, 1234)
    assert config["max_tokens"] == 12 and config["stream"] is False
    assert out["requests"][1]["config"]["top_k"] == -1  # no top-k: ms-swift's trainer sends -1
    for checked in out["answers"]:
        assert checked["type"] == "ChatCompletionResponse"
        assert all(not fields for fields in checked["extra"].values()), checked["extra"]
    # the scripted answers and one made by ms-swift's classes read back the same way
    for answer in answers:
        completion = dialect.completion(answer, request, "test")
        choice = answer[0]["response"]["choices"][0]
        assert completion.token_ids.tolist() == choice["token_ids"]
        assert completion.logprobs.tolist() == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]])
    made = dialect.completion(out["swift_made"], request, "test")
    assert made.token_ids.tolist() == [17, 20] and made.logprobs.tolist() == [-0.5, -0.25]
    assert made.prompt_token_ids.tolist() == [1, 2, 3] and made.finish_reason == "stop"

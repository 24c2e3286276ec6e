"""The remote engine's ``swift`` dialect (ms-swift's ``swift rollout``) on answers written out by
hand, and the chat messages a request carries across the engine worker's wire: what is read, and
what is refused in one line. The protocol itself is checked against ms-swift's own classes in
tests/swift/test_swift_protocol.py."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_probe.engines.base import GenerationRequest
from mismatch_probe.engines.remote.swift import SwiftDialect
from mismatch_probe.engines.wire import requests_to_table, table_to_requests
from mismatch_probe.errors import ConfigError, EngineError
from mismatch_probe.rollout.multiturn import Conversation, ServerTemplateCheck

CHAT = [{"role": "user", "content": "hi"}]
REQUEST = GenerationRequest(np.array([7, 8, 9], np.int32), 4, CHAT)


def answer(**changes) -> list[dict]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "ab"},
        "finish_reason": "stop",
        "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.25}]},
        "token_ids": [11, 12],
    }
    response = {"model": "m", "choices": [choice], "prompt_token_ids": [1, 7, 8, 9]}
    output = {"response": response, "response_token_ids": [], "rollout_logprobs": []}
    for key, value in changes.items():
        target = choice if key in choice else response if key in response else output
        target[key] = value
    return [output]


def test_an_answer_gives_the_sampled_ids_their_logprobs_and_the_servers_prompt_ids():
    c = SwiftDialect().completion(answer(), REQUEST, "request 1")
    assert c.token_ids.tolist() == [11, 12] and c.token_ids.dtype == np.int32
    assert c.logprobs.tolist() == [-0.5, -1.25] and c.finish_reason == "stop"
    assert c.prompt_token_ids.tolist() == [1, 7, 8, 9]


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ({"token_ids": None}, ConfigError, "no token_ids / prompt_token_ids (request_config.return_details"),
        ({"prompt_token_ids": None}, ConfigError, "no token_ids / prompt_token_ids"),
        ({"logprobs": None}, EngineError, "no log-probs (request_config.logprobs = true was sent)"),
        ({"token_ids": [11]}, EngineError, "1 sampled tokens but 2 log-probs"),
        ({"response_token_ids": [[11], [12]]}, EngineError, "ran several turns itself"),
        ({"finish_reason": "abort"}, EngineError, "finish_reason 'abort'"),
    ],
)
def test_an_answer_that_cannot_be_used_is_refused_in_one_line(bad, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        SwiftDialect().completion(answer(**bad), REQUEST, "request 1")
    assert "\n" not in str(caught.value)
    with pytest.raises(EngineError, match="a list of one RolloutOutput"):
        SwiftDialect().completion(answer() * 2, REQUEST, "request 1")


def test_a_request_without_messages_is_refused_and_messages_cross_the_wire():
    with pytest.raises(ConfigError, match="takes chat messages"):
        SwiftDialect().generate_body("", GenerationRequest(np.array([1], np.int32), 4), None, [], None)
    back = table_to_requests(requests_to_table([REQUEST, GenerationRequest(np.array([5], np.int32), 2)]))
    assert back[0].messages == CHAT and back[0].prompt_token_ids.tolist() == [7, 8, 9] and back[0].max_tokens == 4
    assert back[1].messages is None


def test_the_template_check_adopts_a_first_turns_rendering_and_ends_a_later_turn_that_differs():
    check = ServerTemplateCheck()
    conv = Conversation.start(0, np.array([7, 8, 9], np.int32))
    ours = GenerationRequest(conv.token_ids(), 4, CHAT)
    c = SwiftDialect().completion(answer(), ours, "r")
    assert check.add(conv, ours, c, 0, None)  # the server's rendering becomes the prompt
    assert conv.token_ids().tolist() == [1, 7, 8, 9] and not conv.model[0].any()
    conv.add(c.token_ids, 0, c.logprobs)
    later = GenerationRequest(conv.token_ids(), 4, CHAT)
    same = SwiftDialect().completion(answer(prompt_token_ids=[1, 7, 8, 9, 11, 12]), later, "r")
    assert check.add(conv, later, same, 1, None)
    other = SwiftDialect().completion(answer(prompt_token_ids=[1, 7, 8, 9, 11, 13, 14]), later, "r")
    assert not check.add(conv, later, other, 1, None) and conv.finish_reason == "context_differs"
    record = check.merge({"n_turns": 2, "n_differing": 1, "n_prompts": 2, "n_prompts_differing": 1, "n_cut": 0})
    assert (record["n_turns"], record["n_differing"], record["n_prompts"], record["n_prompts_differing"]) == (
        5,
        3,
        3,
        2,
    )
    assert record["n_cut"] == 1 and record["share_differing"] == 3 / 5
    first, cut = record["examples"]
    assert (first["turn"], first["first_difference_at"], first["ours"][:2], first["server"][:2]) == (
        0,
        0,
        [7, 8],
        [1, 7],
    )
    assert (cut["turn"], cut["first_difference_at"], cut["ours"], cut["server"]) == (1, 5, [12], [13, 14])


class _ScriptedRoutes:
    """A client whose GET/POST answers are given (orchestration only: what read_server does with them)."""

    def __init__(self, answers: dict):
        self.answers = answers

    def where(self, path: str) -> str:
        return "http://server" + path

    def get(self, path, params=None):
        return self.answers.get(("GET", path), (404, {"detail": "Not Found"}))

    def post(self, path, body, params=None, attempts=3):
        return self.answers.get(("POST", path), (404, {"detail": "Not Found"}))


def test_what_a_swift_server_exposes_is_read_and_what_it_cannot_do_is_refused():
    from mismatch_probe.config.spec import SyncSpec
    from mismatch_probe.engines.remote import check_sync

    engine_type = {"engine_type": "LLMEngine", "enable_multi_turn": False, "use_gym_env": False, "enable_lora": False}
    routes = {("GET", "/get_world_size/"): (200, {"world_size": 4}), ("POST", "/get_engine_type/"): (200, engine_type)}
    info = SwiftDialect().read_server(_ScriptedRoutes(routes), None)
    assert (
        info.software == "ms-swift" and info.settings["world_size"] == 4 and info.settings["engine_type"] == "LLMEngine"
    )
    assert "logprobs_mode" in info.unknown and "dtype" in info.unknown
    scheduler = {**routes, ("POST", "/get_engine_type/"): (200, {**engine_type, "enable_multi_turn": True})}
    with pytest.raises(ConfigError, match="its own multi-turn scheduler") as caught:
        SwiftDialect().read_server(_ScriptedRoutes(scheduler), None)
    assert "--multi_turn_scheduler" in caught.value.hint
    with pytest.raises(ConfigError, match="not ms-swift's swift rollout server"):
        SwiftDialect().read_server(_ScriptedRoutes({}), None)
    for transfer in ("disk", "tensor", "nccl"):
        with pytest.raises(ConfigError, match="NCCL broadcast from a trainer rank"):
            check_sync(SyncSpec(start_from="perturbed", transfer=transfer), "swift")

"""Multi-turn tool use: a hand-built conversation checked token by token, through the real pipeline."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DENSE, MULTI_TURN

from mismatch_probe.config.spec import ProbeSpec
from mismatch_probe.engines import NOTHING_OPTIONAL, Completion
from mismatch_probe.modeling.logprobs import LogprobSemantics
from mismatch_probe.pipeline import compare
from mismatch_probe.rollout.multiturn import ToolTurnTemplate


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DENSE))


class ScriptedAssistant:
    """Answers turn k with the k-th scripted text (tokenized here), log-prob -0.25 per token."""

    name = "scripted"
    capabilities = NOTHING_OPTIONAL

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.requests = tokenizer, turns, []

    def semantics(self, sampling):
        return LogprobSemantics("raw")

    def info(self):
        return {"engine": "scripted", "dtype": "float32", "routing": None}

    def generate(self, requests, sampling, *, stop_token_ids, seed, on_progress=None):
        out = []
        for r in requests:
            self.requests.append(r.prompt_token_ids.copy())
            starts = sum(1 for t in r.prompt_token_ids if t == self.tokenizer.convert_tokens_to_ids("<|im_start|>"))
            k = (starts - 3) // 2  # system, user, assistant; then a tool and an assistant header per turn
            ids = np.array(
                self.tokenizer.encode(self.turns[min(k, len(self.turns) - 1)], add_special_tokens=False), np.int32
            )
            out.append(
                Completion(ids, np.full(len(ids), -0.25, np.float32), "stop", prompt_token_ids=r.prompt_token_ids)
            )
        return out

    def close(self):
        pass


def test_the_chat_template_gives_the_tool_block(tokenizer):
    t = ToolTurnTemplate.from_tokenizer(tokenizer)
    assert (t.before, t.after) == ("\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")


def probe(tmp_path, max_turns):
    s = ProbeSpec(
        model=str(DENSE),
        prompts=str(MULTI_TURN),
        out=str(tmp_path / f"run{max_turns}"),
        max_prompts=1,
        max_turns=max_turns,
    )
    s.reference.dtype = "float32"
    return s


def test_every_token_has_its_turn_and_mask(tmp_path, tokenizer):
    import pyarrow.parquet as pq

    turns = [
        "Let me calculate that. <tool_call>calculator(18 * 10 - 85)</tool_call><|im_end|>",
        "<tool_call>calculator(95 / 0)</tool_call><|im_end|>",
        "The answer is 95.<|im_end|>",
    ]
    engine = ScriptedAssistant(tokenizer, turns)
    result = compare(probe(tmp_path, 4), engine=engine)

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)
    prompt = list(engine.requests[0])
    segments = [  # (ids, turn, is_model_token), as the conversation must be laid out
        (prompt, -1, False),
        (enc(turns[0]), 0, True),
        (enc("\n<|im_start|>tool\n95<|im_end|>\n<|im_start|>assistant\n"), -1, False),
        (enc(turns[1]), 1, True),
        (enc("\n<|im_start|>tool\nerror: division by zero<|im_end|>\n<|im_start|>assistant\n"), -1, False),
        (enc(turns[2]), 2, True),
    ]
    want_ids = np.concatenate([np.array(ids) for ids, _, _ in segments])
    want_turn = np.concatenate([np.full(len(ids), t) for ids, t, _ in segments])
    want_model = np.concatenate([np.full(len(ids), m) for ids, _, m in segments])

    table = pq.read_table(result.run_dir / "tokens.parquet")
    assert np.array_equal(table.column("token_id").to_numpy(), want_ids)
    assert np.array_equal(table.column("turn").to_numpy(), want_turn)
    assert np.array_equal(table.column("is_model_token").to_numpy(), want_model)
    logp = table.column("logp_infer").to_numpy(zero_copy_only=False)
    assert np.all(logp[want_model] == -0.25) and np.all(np.isnan(logp[~want_model]))
    # token in, token out: each turn's request is exactly everything before it
    ends = np.cumsum([len(ids) for ids, _, _ in segments])
    assert [len(r) for r in engine.requests] == [ends[0], ends[2], ends[4]]
    assert all(np.array_equal(r, want_ids[: len(r)]) for r in engine.requests)

    rec = result.record
    n_first, n_later = len(enc(turns[0])), len(enc(turns[1])) + len(enc(turns[2]))
    assert rec["metrics"]["n_model_tokens"] == n_first + n_later
    assert rec["metrics_by_turn"]["first"]["n_model_tokens"] == n_first
    assert rec["metrics_by_turn"]["later"]["n_model_tokens"] == n_later
    assert rec["metrics_by_turn"]["later"]["n_sequences"] == 2  # sample-turns
    by_index = rec["metrics_by_turn_index"]
    assert list(by_index) == ["0", "1", "2"]
    assert [by_index[k]["n_model_tokens"] for k in by_index] == [len(enc(t)) for t in turns]
    assert all(by_index[k]["n_sequences"] == 1 for k in by_index)
    assert "## By assistant turn" in (result.run_dir / "report.md").read_text()
    from mismatch_probe.report.data import load_run

    dist = load_run(result.run_dir).dist  # what the first-vs-later figure draws: one point per sample-turn
    assert len(dist["groups"]["first"]["log_ppl_infer"]) == 1 and len(dist["groups"]["later"]["log_ppl_infer"]) == 2
    assert dist["groups"]["later"]["n_tokens"] == n_later
    assert all((result.run_dir / f["path"]).read_bytes().startswith(b"<svg ") for f in rec["figures"])
    html = (result.run_dir / "report.html").read_text()
    assert 'id="turns"' in html and "tool output" in html
    assert rec["samples"]["finish_reasons"] == {"stop": 1}


def test_a_tool_call_in_the_last_allowed_turn_ends_with_max_turns(tmp_path, tokenizer):
    engine = ScriptedAssistant(tokenizer, ["<tool_call>calculator(1+1)</tool_call><|im_end|>"])
    rec = compare(probe(tmp_path, 2), engine=engine).record
    assert len(engine.requests) == 2
    assert rec["samples"]["finish_reasons"] == {"max_turns": 1}
    assert rec["metrics_by_turn"]["later"]["n_model_tokens"] > 0


def test_fixture_tool_use_with_the_hf_engine(tmp_path):
    s = ProbeSpec(model=str(DENSE), prompts=str(MULTI_TURN), out=str(tmp_path / "r"), max_prompts=8, max_turns=4)
    s.engine.dtype = "bfloat16"
    s.reference.dtype = "float32"
    s.sampling.max_tokens = 64
    rec = compare(s).record
    first, later = rec["metrics_by_turn"]["first"], rec["metrics_by_turn"]["later"]
    assert first["n_model_tokens"] > 0 and later["n_model_tokens"] > 0  # the fixture model calls its tool
    assert first["n_model_tokens"] + later["n_model_tokens"] == rec["metrics"]["n_model_tokens"]
    assert np.isfinite(later["k3_kl"]) and later["k3_kl"] > 0
    assert rec["decode_vs_prefill"]["n_model_tokens"] == rec["metrics"]["n_model_tokens"]


def test_a_recorded_conversation_is_replayed_with_fresh_assistant_turns(tmp_path, tokenizer):
    """Given tool outputs (and a user follow-up) are spliced in as recorded; every assistant turn is
    generated anew, whatever the recorded assistant said and whether or not it called a tool."""
    import json

    import pyarrow.parquet as pq

    record = {
        "id": "trace-1",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 18 * 30?"},
            {"role": "assistant", "content": "<tool_call>calculator(18 * 30)</tool_call>"},
            {"role": "tool", "content": "540"},
            {"role": "assistant", "content": "It is 540."},
            {"role": "user", "content": "And 2 + 2?"},
            {"role": "assistant", "content": "4."},
        ],
    }
    prompts = tmp_path / "trace.jsonl"
    prompts.write_text(json.dumps(record) + "\n")
    turns = ["I think it is 540.<|im_end|>", "The answer is 540.<|im_end|>", "It is 4.<|im_end|>"]
    engine = ScriptedAssistant(tokenizer, turns)
    s = ProbeSpec(model=str(DENSE), prompts=str(prompts), out=str(tmp_path / "r"))
    s.reference.dtype = "float32"
    result = compare(s, engine=engine)

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)
    prompt = enc(tokenizer.apply_chat_template(record["messages"][:2], tokenize=False, add_generation_prompt=True))
    segments = [
        (prompt, -1),
        (enc(turns[0]), 0),
        (enc("\n<|im_start|>tool\n540<|im_end|>\n<|im_start|>assistant\n"), -1),
        (enc(turns[1]), 1),
        (enc("\n<|im_start|>user\nAnd 2 + 2?<|im_end|>\n<|im_start|>assistant\n"), -1),
        (enc(turns[2]), 2),
    ]
    table = pq.read_table(result.run_dir / "tokens.parquet")
    assert table.column("token_id").to_pylist() == [t for ids, _ in segments for t in ids]
    assert table.column("turn").to_pylist() == [k for ids, k in segments for _ in ids]
    assert len(engine.requests) == 3
    assert list(result.record["metrics_by_turn_index"]) == ["0", "1", "2"]


def test_recorded_messages_are_split_at_assistant_turns():
    from mismatch_probe.errors import ConfigError
    from mismatch_probe.rollout.prompts import split_recorded

    u, a, t = {"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "1"}
    assert split_recorded([u]) == ([u], [])
    assert split_recorded([u, a]) == ([u], [])
    assert split_recorded([u, a, t]) == ([u], [[t]])
    assert split_recorded([u, a, t, t, a, u, a]) == ([u], [[t, t], [u]])
    with pytest.raises(ConfigError, match="two assistant messages in a row"):
        split_recorded([u, a, a, t])


class CharByChar(ScriptedAssistant):
    """Emits its text one character-token at a time: valid ids, but not what the tokenizer would produce."""

    def generate(self, requests, sampling, *, stop_token_ids, seed, on_progress=None):
        out = []
        for r in requests:
            self.requests.append(r.prompt_token_ids.copy())
            ids = [i for ch in "The answer is 95." for i in self.tokenizer.encode(ch, add_special_tokens=False)]
            ids = np.array(ids + [stop_token_ids[0]], np.int32)
            out.append(
                Completion(ids, np.full(len(ids), -0.25, np.float32), "stop", prompt_token_ids=r.prompt_token_ids)
            )
        return out


def test_retokenization_check_counts_what_a_trainer_would_see_differently(tmp_path, tokenizer):
    clean = compare(probe(tmp_path, 2), engine=ScriptedAssistant(tokenizer, ["The answer is 95.<|im_end|>"]))
    assert clean.record["tokenization_check"] == {"n_checked": 1, "n_differing": 0, "n_unchecked": 0, "examples": []}

    s = probe(tmp_path, 3)
    engine = CharByChar(tokenizer, [])
    rec = compare(s, engine=engine).record
    check = rec["tokenization_check"]
    assert check["n_checked"] == 1 and check["n_differing"] == 1
    n_prompt = len(engine.requests[0])
    assert check["examples"][0]["first_difference_at"] >= n_prompt  # the prompt itself round-trips
    assert check["examples"][0]["retokenized_tokens"] < check["examples"][0]["transcript_tokens"]

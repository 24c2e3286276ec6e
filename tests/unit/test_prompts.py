"""Prompt files: the one tokenization, and errors that name the offending line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import DENSE, MULTI_TURN, SINGLE_TURN

from mismatch_probe.errors import ConfigError
from mismatch_probe.modeling.loading import load_tokenizer
from mismatch_probe.rollout.prompts import tokenize_prompts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DENSE)


def write(tmp_path, lines):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def load(path, tok, **kw):
    return tokenize_prompts(
        path, tok, max_model_len=kw.pop("max_model_len", 1024), max_new_tokens=kw.pop("max_new", 16), **kw
    )


def test_chat_prompts_use_the_chat_template(tokenizer):
    prompts = load(SINGLE_TURN, tokenizer)
    first = json.loads(SINGLE_TURN.read_text().splitlines()[0])
    expected = tokenizer.apply_chat_template(first["messages"], tokenize=False, add_generation_prompt=True)
    assert prompts[0].id == first["id"]
    assert prompts[0].token_ids.dtype == np.int32
    assert tokenizer.decode(prompts[0].token_ids) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    assert len(load(MULTI_TURN, tokenizer)) == 32


def test_three_prompt_kinds_and_default_ids(tmp_path, tokenizer):
    p = write(
        tmp_path,
        [
            json.dumps({"prompt": "Hello"}),
            "",
            json.dumps({"id": 7, "prompt_token_ids": [1, 5, 9]}),
            json.dumps({"messages": [{"role": "user", "content": "Hi"}]}),
        ],
    )
    prompts = load(p, tokenizer)
    assert [x.id for x in prompts] == ["prompts-1", "7", "prompts-4"]
    assert prompts[1].token_ids.tolist() == [1, 5, 9]
    assert load(p, tokenizer, max_prompts=2)[-1].id == "7"


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"prompt": "a"', r"prompts.jsonl:2: malformed JSON"),
        ('["a"]', r":2: expected a JSON object"),
        ('{"text": "a"}', r":2: needs exactly one of"),
        ('{"messages": [{"role": "user"}]}', r":2: message 0 needs string 'role' and 'content'"),
        ('{"prompt_token_ids": [1, -2]}', r":2: 'prompt_token_ids' must be"),
        ('{"prompt_token_ids": [1, 99999]}', r":2: token id 99999 is outside"),
        ('{"id": "a", "prompt": "x"}', r"id 'a' appears more than once"),
    ],
)
def test_bad_lines_are_named(tmp_path, tokenizer, line, match):
    p = write(tmp_path, ['{"id": "a", "prompt": "ok"}', line])
    with pytest.raises(ConfigError, match=match):
        load(p, tokenizer)


def test_prompt_longer_than_the_context(tmp_path, tokenizer):
    p = write(tmp_path, [json.dumps({"prompt_token_ids": list(range(1, 101))})])
    with pytest.raises(
        ConfigError, match=r":1: prompt has 100 tokens; with max_tokens 16 it needs 116 positions.*context is 64"
    ):
        load(p, tokenizer, max_model_len=64)


def test_missing_and_empty_files(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "nope.jsonl", tokenizer)
    with pytest.raises(ConfigError, match="has no prompts"):
        load(write(tmp_path, [""]), tokenizer)

"""Prompts sampled from an RL framework's dataset (mismatch_probe/frameworks/datasets.py): each
framework's file layout read as it reads it, the length-stratified sample checked by hand, the
errors a user meets, and the file read back by the probe's own prompts parser."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch_probe.errors import ConfigError
from mismatch_probe.frameworks.datasets import (
    LAYOUTS,
    PROMPT_KEY_HINT,
    DatasetLayout,
    dataset_files,
    prompt_of,
    stratified_sample,
    write_dataset_prompts,
)
from mismatch_probe.rollout.prompts import read_prompt_records, tokenize_prompts

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "fixtures" / "models" / "tiny-qwen2"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def verl_parquet(path: Path, questions: list[str], row_group_size: int | None = None) -> Path:
    """verl's layout (examples/data_preprocess/gsm8k.py): ``prompt`` a list<struct<content, role>>,
    beside the columns the prompt does not need."""
    chat = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
    table = pa.table(
        {
            "data_source": pa.array(["openai/gsm8k"] * len(questions)),
            "prompt": pa.array([[{"content": q, "role": "user"}] for q in questions], type=chat),
            "ability": pa.array(["math"] * len(questions)),
            "reward_model": pa.array([{"ground_truth": "42", "style": "rule"}] * len(questions)),
            "extra_info": pa.array([{"index": i, "split": "train"} for i in range(len(questions))]),
        }
    )
    assert table.schema.field("prompt").type == chat
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_verl_parquet_chat_structs_become_messages_with_row_ids(tmp_path):
    data = verl_parquet(tmp_path / "train.parquet", [f"question {i}?" for i in range(10)], row_group_size=3)
    out = tmp_path / "prompts.jsonl"
    res = write_dataset_prompts(data, out, layout=LAYOUTS["verl"], n=4, seed=1, strata=2)
    rows = lines(out)
    assert res.written == 4 and res.rows == 10 and res.skipped == 0 and res.length_unit == "characters"
    for r in rows:
        k = int(r["id"].removeprefix("train-"))
        assert r["messages"] == [{"role": "user", "content": f"question {k}?"}]
    assert [r["id"] for r in rows] == sorted((r["id"] for r in rows), key=lambda i: int(i.split("-")[1]))
    assert len(read_prompt_records(out)) == 4
    assert res.record()["layout"]["prompt_key"] == "prompt" and Path(res.sources[0]).resolve() == data.resolve()


def test_pandas_numpy_arrays_of_message_dicts_are_chats():
    """pandas returns verl's struct lists as numpy object arrays of dicts."""
    import pandas as pd

    table = pa.table({"prompt": [[{"content": "hi", "role": "user"}]]})
    value = table.to_pandas()["prompt"][0]
    assert isinstance(value, np.ndarray) and isinstance(pd.Series([value])[0], np.ndarray)
    assert prompt_of(value, None, LAYOUTS["verl"]) == ("messages", [{"role": "user", "content": "hi"}])


def test_several_files_and_a_directory_as_verl_train_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    verl_parquet(tmp_path / "a" / "train.parquet", ["x"] * 3)
    verl_parquet(tmp_path / "b" / "train.parquet", ["yy"] * 3)
    (tmp_path / "b" / ".hidden.parquet").write_text("not parquet")
    assert [p.parent.name for p in dataset_files(tmp_path)] == ["a", "b"]
    out = tmp_path / "p.jsonl"
    res = write_dataset_prompts([tmp_path / "a" / "train.parquet", tmp_path / "b"], out, layout=LAYOUTS["verl"], n=100)
    # N >= the dataset: every row; two files of one stem keep distinct ids
    assert res.written == 6 and [r["id"] for r in lines(out)] == [f"train.{k}-{r}" for k in (0, 1) for r in range(3)]


def test_openrlhf_and_slime_text_layout_and_the_chat_template_variant(tmp_path):
    data = write_jsonl(
        tmp_path / "data.jsonl",
        [{"input": "What is 2+2?", "label": "4"}, {"input": "", "label": "0"}, {"label": "1"}, {"input": "Why?"}],
    )
    out = tmp_path / "p.jsonl"
    res = write_dataset_prompts(data, out, layout=LAYOUTS["openrlhf"], n=10)
    assert lines(out) == [{"id": "data-0", "prompt": "What is 2+2?"}, {"id": "data-3", "prompt": "Why?"}]
    assert res.skipped == 2 and res.first_skipped == "data row 1: 'input' is empty"
    assert "skipped 2 rows" in res.summary()
    # --apply-chat-template: one user message; --input_template / NeMo-RL's prompt_file around it
    chat = LAYOUTS["slime"].with_changes(shape="text-as-chat", input_template="Q: {} A:")
    write_dataset_prompts(data, out, layout=chat, n=10)
    assert lines(out)[0]["messages"] == [{"role": "user", "content": "Q: What is 2+2? A:"}]
    # a row that already holds a chat is taken as it is (OpenRLHF's preprocess_data, slime's _build_messages)
    assert prompt_of([{"role": "user", "content": "c"}], None, chat) == ("messages", [{"role": "user", "content": "c"}])


def test_trl_conversational_and_standard_rows(tmp_path):
    data = write_jsonl(
        tmp_path / "trl.jsonl",
        [{"prompt": [{"role": "user", "content": "What color is the sky?"}]}, {"prompt": "The sky is"}],
    )
    out = tmp_path / "p.jsonl"
    write_dataset_prompts(data, out, layout=LAYOUTS["trl"], n=2)
    got = lines(out)
    assert got[0]["messages"] == [{"role": "user", "content": "What color is the sky?"}]
    assert got[1]["prompt"] == "The sky is"


def test_json_array_and_system_prompts(tmp_path):
    data = tmp_path / "swift.json"
    data.write_text(
        json.dumps(
            [
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ref"}]},
                {"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}]},
                {"query": "no messages"},
            ]
        )
    )
    out = tmp_path / "p.jsonl"
    layout = LAYOUTS["ms-swift"].with_changes(system_prompt="Be brief.")
    res = write_dataset_prompts(data, out, layout=layout, n=5)
    got = lines(out)
    # ms-swift's remove_response drops the answer; the system prompt only where the chat has none
    assert got[0]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert got[1]["messages"][0] == {"role": "system", "content": "own"}
    assert res.skipped == 1 and res.first_skipped == "swift row 2: no 'messages'"
    # a per-row system column (ms-swift's query/system rows)
    rows = write_jsonl(tmp_path / "q.jsonl", [{"query": "q1", "system": "S"}, {"query": "q2"}])
    write_dataset_prompts(rows, out, layout=DatasetLayout("query", "text-as-chat", system_key="system"), n=2)
    assert [r["messages"][0]["role"] for r in lines(out)] == ["system", "user"]


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(
            [
                json.dumps({"prompt": [{"role": "user", "content": "ok"}]}),
                "{not json",
                json.dumps([1, 2]),
                json.dumps({"prompt": "a string"}),
                json.dumps({"prompt": [{"role": "user", "content": [{"type": "image"}]}]}),
                json.dumps({"prompt": [{"role": "assistant", "content": "x"}]}),
                "",
                json.dumps({"prompt": [{"role": "user", "content": "ok too"}]}),
            ]
        )
    )
    out = tmp_path / "p.jsonl"
    res = write_dataset_prompts(data, out, layout=LAYOUTS["verl"], n=10)
    assert res.rows == 7 and res.skipped == 5 and res.written == 2
    assert res.first_skipped == "d row 1: not JSON"
    assert [r["id"] for r in lines(out)] == ["d-0", "d-6"]  # a row is a non-blank line
    for value, why in [
        ("a string", "is a string, not a chat"),
        ([{"role": "user", "content": [{"type": "image"}]}], "multimodal"),
        ([], "an empty list"),
        ([{"role": "user", "content": "  "}], "every prompt message is empty"),
    ]:
        with pytest.raises(ValueError, match=why):
            prompt_of(value, None, LAYOUTS["verl"])


def test_a_missing_column_is_one_line_with_the_columns_and_the_fix(tmp_path):
    table = pa.table({"question": ["q"], "answer": ["a"]})
    pq.write_table(table, tmp_path / "data.parquet")
    with pytest.raises(ConfigError) as exc:
        write_dataset_prompts(tmp_path / "data.parquet", tmp_path / "p.jsonl", layout=LAYOUTS["verl"], n=2)
    assert (
        str(exc.value) == f"column 'prompt' not found in data.parquet (columns: question, answer) ({PROMPT_KEY_HINT})"
    )
    write_jsonl(tmp_path / "data.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ConfigError, match=r"column 'input' not found in data.jsonl \(columns: answer, question\)"):
        write_dataset_prompts(tmp_path / "data.jsonl", tmp_path / "p.jsonl", layout=LAYOUTS["slime"], n=2)
    # the key is there but no row is usable: the first row's reason
    write_jsonl(tmp_path / "empty.jsonl", [{"prompt": ""}, {"prompt": None}])
    with pytest.raises(ConfigError, match=r"no usable prompt in empty.jsonl: empty row 0: 'prompt' is empty"):
        write_dataset_prompts(tmp_path / "empty.jsonl", tmp_path / "p.jsonl", layout=LAYOUTS["trl"], n=2)
    assert not (tmp_path / "p.jsonl").exists()
    with pytest.raises(ConfigError, match="does not exist"):
        dataset_files(tmp_path / "nope.parquet")
    with pytest.raises(ConfigError, match="a system prompt needs a chat template"):
        DatasetLayout("input", "text", system_prompt="S")


def test_stratified_sample_by_hand():
    # 30 rows of known lengths, shuffled: strata of 10 are lengths 1-10, 11-20, 21-30
    lengths = np.random.default_rng(7).permutation(np.arange(1, 31))
    picked, strata = stratified_sample(lengths, 6, 3, seed=0)
    got = lengths[picked]
    assert [(s.lo, s.hi, s.rows, s.taken) for s in strata] == [(1, 10, 10, 2), (11, 20, 10, 2), (21, 30, 10, 2)]
    assert [int(((got >= lo) & (got <= lo + 9)).sum()) for lo in (1, 11, 21)] == [2, 2, 2]
    assert list(picked) == sorted(picked) and len(set(picked.tolist())) == 6
    again, _ = stratified_sample(lengths, 6, 3, seed=0)
    other, _ = stratified_sample(lengths, 6, 3, seed=1)
    assert list(again) == list(picked) and list(other) != list(picked)
    # 7 of 3 strata: 3, 2, 2 in some order (equal within one); all rows when N >= the rows
    _, strata = stratified_sample(lengths, 7, 3, seed=0)
    assert sorted(s.taken for s in strata) == [2, 2, 3]
    everything, strata = stratified_sample(lengths, 30, 3, seed=0)
    assert list(everything) == list(range(30)) and [s.taken for s in strata] == [10, 10, 10]


def test_the_file_is_stratified_and_records_its_strata(tmp_path):
    questions = ["x" * k for k in range(1, 31)]
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": q} for q in questions])
    out = tmp_path / "p.jsonl"
    res = write_dataset_prompts(data, out, layout=LAYOUTS["trl"], n=6, strata=3, seed=3)
    assert sorted(len(r["prompt"]) // 10 for r in lines(out)) in ([0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 3])
    assert res.strata_edges == [11, 21] and [s.taken for s in res.strata] == [2, 2, 2]
    assert json.loads(json.dumps(res.record()))["strata_edges"] == [11, 21]
    first = out.read_text()
    write_dataset_prompts(data, out, layout=LAYOUTS["trl"], n=6, strata=3, seed=3)
    assert out.read_text() == first


def test_token_lengths_through_the_fixture_models_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY))
    assert tok.chat_template and "add_generation_prompt" in tok.chat_template
    rows = [{"prompt": [{"role": "user", "content": "word " * k}]} for k in range(1, 13)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "p.jsonl"
    res = write_dataset_prompts(data, out, layout=LAYOUTS["verl"], n=4, strata=2, tokenizer=TINY)
    assert res.length_unit == "tokens" and res.written == 4
    # the lengths are the probe's own token counts for those prompts
    prompts = tokenize_prompts(out, tok, max_model_len=10_000, max_new_tokens=1)
    by_row = {int(p.id.split("-")[1]): len(p.token_ids) for p in prompts}
    all_rows = write_dataset_prompts(
        data, tmp_path / "all.jsonl", layout=LAYOUTS["verl"], n=12, strata=2, tokenizer=tok
    )
    counts = sorted(
        len(p.token_ids) for p in tokenize_prompts(tmp_path / "all.jsonl", tok, max_model_len=10_000, max_new_tokens=1)
    )
    assert all_rows.strata[0].lo == counts[0] and all_rows.strata[-1].hi == counts[-1]
    assert all_rows.strata[1].lo == counts[6]
    assert sum(n <= counts[5] for n in by_row.values()) == 2  # two from each half
    # raw text is tokenized as the probe does, special tokens included
    text = write_jsonl(tmp_path / "t.jsonl", [{"input": "hello world"}])
    res = write_dataset_prompts(text, out, layout=LAYOUTS["openrlhf"], n=1, tokenizer=tok)
    assert res.strata[0].lo == len(tok.encode("hello world"))


def test_a_tokenizer_without_a_chat_template_refuses_chats(tmp_path):
    class Plain:
        chat_template = None

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="no chat template"):
        write_dataset_prompts(data, tmp_path / "p.jsonl", layout=LAYOUTS["verl"], n=1, tokenizer=Plain())


def test_every_framework_layout_is_valid():
    assert set(LAYOUTS) == {"verl", "skyrl", "openrlhf", "slime", "trl", "ms-swift", "nemo-rl", "prime-rl"}
    assert LAYOUTS["verl"].prompt_key == "prompt" and LAYOUTS["openrlhf"].prompt_key == "input"

"""The readers' shared machinery: launch scripts, overrides and flags read as bash, Hydra and
argparse read them; each risk found in a configuration that has it and absent from one that does not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mismatch_probe.frameworks.base import Found, Origin, StackReading, Value
from mismatch_probe.frameworks.risks import ENGINE_FINDINGS, RISKS, find_risks, pinned_version
from mismatch_probe.frameworks.sources import flag_values, hydra_override, parse_scalar, shell_words

ROOT = Path(__file__).resolve().parents[2]


def test_shell_words_expand_arrays_variables_defaults_and_continuations(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "#!/bin/bash\n"
        "set -ex\n"
        "MODEL=/ckpt/qwen  # the model\n"
        'NAME=${NAME:-"default name"}\n'
        "ARGS=(\n"
        "   --rollout-top-p 0.9   # a comment\n"
        '   --tag "two words"\n'
        ")\n"
        "ARGS+=(--n 8)\n"
        "ONE=(--x 1)\n"
        "python3 train.py ${ARGS[@]} ${ONE[@]} --hf-checkpoint $MODEL \\\n"
        '   --name "$NAME" --flag\n'
    )
    words = shell_words(script)
    assert words[words.index("train.py") + 1 :] == [
        "--rollout-top-p", "0.9", "--tag", "two words", "--n", "8", "--x", "1",
        "--hf-checkpoint", "/ckpt/qwen", "--name", "default name", "--flag",
    ]  # fmt: skip
    assert flag_values(words) == {
        "--rollout-top-p": 0.9,
        "--tag": "two words",
        "--n": 8,
        "--x": 1,
        "--hf-checkpoint": "/ckpt/qwen",
        "--name": "default name",
        "--flag": True,
    }


def test_flag_values_store_true_and_last_wins():
    words = ["--use-x", "pos", "--a=1", "--a", "2", "--list", "1", "2", "3", "&&", "echo"]
    assert flag_values(words, frozenset({"--use-x"})) == {"--use-x": True, "--a": 2, "--list": [1, 2, 3]}


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("a.b=1", ("set", "a.b", 1)),
        ("+a.b=1e-6", ("set", "a.b", 1e-6)),
        ("++a.b=true", ("set", "a.b", True)),
        ("~a.b", ("delete", "a.b", None)),
        ("a.b=[x,y]", ("set", "a.b", ["x", "y"])),
        ("a.b='text'", ("set", "a.b", "text")),
        ("a.b=null", ("set", "a.b", None)),
        ("--flag", None),
        ("a.b", None),
    ],
)
def test_hydra_overrides(token, expected):
    assert hydra_override(token) == expected


def test_parse_scalar_reads_exponents_yaml_1_1_leaves_as_text():
    assert parse_scalar("1e-6") == 1e-6 and parse_scalar("5e3") == 5000.0 and parse_scalar("bf16") == "bf16"


def _stack(values: dict, facts: dict | None = None, engine_pin: str | None = None, model: str | None = None):
    origin = Origin("k", file="x")
    return StackReading(
        framework="verl",
        commit="0" * 40,
        files=[],
        values={k: Value(k, v, (origin,)) for k, v in values.items()},
        unmirrored=[],
        facts={k: Found(v, origin) for k, v in (facts or {}).items()},
        model=Found(model, origin) if model else None,
        engine_pin=engine_pin,
    )


BASE = {"engine.name": "sglang", "engine.dtype": "bfloat16", "reference.dtype": "float32", "sampling.n": 1}
# each general risk: a configuration that has it, and the nearest one that does not
CASES = {
    "logprobs-temperature": (
        {
            **BASE,
            "engine.name": "vllm",
            "engine.cascade_attn": False,
            "sampling.temperature": 0.7,
            "reference.logprobs": "temperature",
        },
        {
            **BASE,
            "engine.name": "vllm",
            "engine.cascade_attn": False,
            "sampling.temperature": 1.0,
            "reference.logprobs": "temperature",
        },
    ),
    "truncated-sampling": ({**BASE, "sampling.top_p": 0.95}, {**BASE, "sampling.top_p": 1.0}),
    "one-sided-fp32-head": (
        {**BASE, "engine.logits_fp32": True},
        {**BASE, "engine.logits_fp32": True, "reference.logits_fp32": True},
    ),
    "cascade-attention": (
        {**BASE, "engine.name": "vllm", "sampling.n": 8},
        {**BASE, "engine.name": "vllm", "sampling.n": 8, "engine.cascade_attn": False},
    ),
    "precision-differs": (
        {**BASE, "engine.dtype": "float16", "reference.dtype": "bfloat16"},
        {**BASE, "reference.dtype": "bfloat16"},
    ),
}


@pytest.mark.parametrize("risk", sorted(CASES))
def test_each_general_risk_is_found_where_the_config_has_it_only(risk):
    has, has_not = CASES[risk]
    assert risk in {r.id for r in find_risks(_stack(has))}
    assert risk not in {r.id for r in find_risks(_stack(has_not))}


def test_fact_driven_risks():
    fp32 = _stack(BASE, facts={"engine_lm_head_fp32": True})
    assert "one-sided-fp32-head" in {r.id for r in find_risks(fp32)}
    colocate = _stack(BASE, facts={"colocate_reload_weights": "reload_weights() after wake_up"})
    assert "colocate-reload" in {r.id for r in find_risks(colocate)}
    disagree = _stack({**BASE, "sampling.temperature": 1.0}, facts={"trainer_temperature": 0.9})
    assert "sampling-disagrees" in {r.id for r in find_risks(disagree)}
    assert {r.id for r in find_risks(_stack(BASE))} & {"colocate-reload", "sampling-disagrees"} == set()


def test_cascade_attention_is_not_a_risk_on_vllm_that_removed_it():
    has = {**BASE, "engine.name": "vllm", "sampling.n": 8}
    assert "cascade-attention" in {r.id for r in find_risks(_stack(has, engine_pin="vllm==0.24.0"))}
    assert "cascade-attention" not in {r.id for r in find_risks(_stack(has, engine_pin="vllm==0.32.0"))}
    assert pinned_version("vllm>=0.8.5,<=0.12.0 (setup.py:52)") == (0, 12, 0)


def test_engine_version_pins_outside_the_adapters_range():
    from mismatch_probe.frameworks.risks import pinned_releases

    assert pinned_releases("vllm", "vllm>=0.8.5,<=0.12.0 (setup.py:52)")[-1] == "0.12.0"
    assert pinned_releases("sglang", "slimerl/sglang:v0.5.15.post1-cu129") == ["0.5.15.post1"]
    vllm = {**BASE, "engine.name": "vllm", "engine.cascade_attn": False}
    ids = lambda pin, values=vllm: {r.id for r in find_risks(_stack(values, engine_pin=pin))}
    assert "engine-version" in ids("vllm>=0.8.5,<=0.12.0 (setup.py:52)")
    assert "engine-version" not in ids("vllm==0.26.0")
    assert "engine-version" in ids("sglang==0.5.2", BASE)  # no SGLANG_RETURN_ORIGINAL_LOGPROB, no sampling_seed
    assert "engine-version" not in ids("sglang==0.5.12.post1", BASE)
    detail = next(
        r.detail for r in find_risks(_stack(vllm, engine_pin="vllm>=0.8.5,<=0.12.0")) if r.id == "engine-version"
    )
    assert "only 0.12.0 runs" in detail and "flat_logprobs" in detail


def test_engine_findings_by_family_from_a_checkpoint_or_a_name(tmp_path):
    ids = lambda stack, **kw: {r.id for r in find_risks(stack, **kw)}
    moe = "engine-finding:sglang-qwen3-moe-untied-lm-head"
    assert moe in ids(_stack(BASE, model="Qwen/Qwen3-30B-A3B"))
    assert moe not in ids(
        _stack({**BASE, "engine.name": "vllm", "engine.cascade_attn": False}, model="Qwen/Qwen3-30B-A3B")
    )
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "tie_word_embeddings": false}')
    assert moe not in ids(_stack(BASE, model="x"), model_dir=tmp_path)  # an untied checkpoint loads its head
    mistral = "engine-finding:sglang-mistral-sliding-window"
    assert mistral in ids(_stack(BASE, model="mistralai/Mistral-7B-Instruct-v0.1"))
    # the CPU build's MLA bug is not a risk of a GPU stack
    assert not any(
        "deepseek" in i for i in ids(_stack({**BASE, "engine.name": "vllm"}, model="deepseek-ai/DeepSeek-V3"))
    )


def test_every_engine_finding_page_has_its_risk():
    pages = {p.stem for p in (ROOT / "docs" / "engine-findings").glob("*.md") if p.stem != "README"}
    assert {f.page for f in ENGINE_FINDINGS} == pages


def test_risk_ids_are_unique_and_evidence_names_a_source():
    ids = [r.id for r in RISKS] + [f.id for f in ENGINE_FINDINGS]
    assert len(ids) == len(set(ids))
    for r in RISKS:
        assert re.search(r"https?://|docs/|arXiv|\.py", r.evidence), r.id

"""The [sweep] table and its points (config.sweep_spec, config.sweep): what is checked, which points
a spec makes, which share an engine or tokens; and the CLI's exit 2 for a bad sweep spec."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.config.spec_reading import load_spec_file, spec_from_dict
from mismatch_probe.config.sweep import BASELINE, engine_key, point_name, sweep_points
from mismatch_probe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "fixtures" / "models" / "tiny-qwen2")
PROMPTS = str(ROOT / "fixtures" / "prompts" / "single_turn.jsonl")


def spec(axes, **sweep):
    return spec_from_dict(
        {
            "model": MODEL,
            "prompts": PROMPTS,
            "engine": {"name": "vllm", "dtype": "bfloat16"},
            "reference": {"dtype": "float32"},
            "sweep": {"axes": axes, **sweep},
        }
    )


def test_one_at_a_time_makes_one_point_per_value_other_than_the_baseline(tmp_path):
    plan = sweep_points(
        spec(
            [
                {"key": "engine.dtype", "values": ["bf16", "float32"]},  # bf16 is the baseline's bfloat16
                {"key": "reference.logits_fp32", "values": [False, True]},
                {"key": "engine.tensor_parallel_size", "values": [1, 2]},
            ]
        ),
        tmp_path,
    )
    assert plan.baseline.name == BASELINE and plan.baseline.settings == {}
    assert [p.name for p in plan.repeats] == ["baseline-repeat1", "baseline-repeat2"]
    assert [p.spec.sampling.seed for p in plan.repeats] == [1, 2]
    assert [p.name for p in plan.points] == [
        "engine.dtype=float32",
        "reference.logits_fp32=true",
        "engine.tensor_parallel_size=2",
    ]
    fp32 = plan.points[0].spec
    assert fp32.engine.dtype == "float32" and fp32.out == str(tmp_path / "points" / "engine.dtype=float32")
    assert fp32.sweep is None and plan.baseline.spec.sweep is None


def test_which_points_share_an_engine_and_which_share_tokens(tmp_path):
    plan = sweep_points(
        spec(
            [
                {"key": "engine.dtype", "values": ["float32"]},
                {"key": "reference.dtype", "values": ["bfloat16"]},
                {"key": "sampling.temperature", "values": [0.7]},
                {"key": "corrections.token_tis", "values": [3.0]},
            ]
        ),
        tmp_path,
    )
    base = plan.baseline.spec
    by_name = {p.name: p.spec for p in plan.runs}
    same_engine = {n for n, s in by_name.items() if engine_key(s) == engine_key(base)}
    assert same_engine == set(by_name) - {"engine.dtype=float32"}
    same_tokens = {n for n, s in by_name.items() if s.rollout_fingerprint() == base.rollout_fingerprint()}
    assert same_tokens == {BASELINE, "reference.dtype=bfloat16", "corrections.token_tis=3.0"}


def test_grid_is_every_combination_and_impossible_ones_are_refused(tmp_path):
    plan = sweep_points(
        spec(
            [
                {"key": "reference.packing", "values": [True, False]},
                {"key": "reference.sequence_parallel_size", "values": [1, 2]},
            ],
            mode="grid",
        ),
        tmp_path,
    )
    names = [p.name for p in plan.points]
    assert names == [
        "reference.sequence_parallel_size=2",
        "reference.packing=false",
        "reference.packing=false+reference.sequence_parallel_size=2",
    ]
    refused = plan.points[2]
    assert refused.spec is None and "packed row" in refused.refusal


def test_one_at_a_time_refuses_no_point_quietly_a_bad_value_is_bad_input(tmp_path):
    with pytest.raises(ConfigError, match=r"\[sweep\] engine.dtype = fp33: engine.dtype must be one of auto, float32"):
        sweep_points(spec([{"key": "engine.dtype", "values": ["fp33"]}]), tmp_path)
    with pytest.raises(ConfigError, match="must be an integer"):
        sweep_points(spec([{"key": "engine.tensor_parallel_size", "values": ["2"]}]), tmp_path)
    with pytest.raises(ConfigError, match="did you mean 'dtype'"):
        sweep_points(spec([{"key": "engine.dtyp", "values": ["float32"]}]), tmp_path)


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        ({"axes": []}, "at least 1"),
        ({"axes": [{"key": "dtype", "values": [1]}]}, "section.setting"),
        ({"axes": [{"key": "sampling.seed", "values": [1]}]}, "the repeats vary the seed"),
        ({"axes": [{"key": "engine.dtype", "values": ["a", "a"]}]}, "listed twice"),
        (
            {"axes": [{"key": "engine.dtype", "values": ["a"]}, {"key": "engine.dtype", "values": ["b"]}]},
            "on two sweep axes",
        ),
        (
            {"axes": [{"key": "engine.dtype", "values": ["a"]}, {"name": "r", "levels": {"x": {"engine.dtype": "b"}}}]},
            "engine.dtype is on two sweep axes",
        ),
        (
            {"axes": [{"name": "r", "levels": {"x": {k: "b"}}} for k in ("engine.dtype", "reference.dtype")]},
            "two sweep axes are called r",
        ),
        ({"axes": [{"name": "r", "key": "engine.dtype", "values": ["a"]}]}, "key = ... with values"),
        ({"axes": [{"key": "engine.dtype"}]}, "key = ... with values"),
        ({"axes": [{"name": "r"}]}, "needs \\[levels\\]"),
        ({"axes": [{"name": "r", "levels": {"x": {"dtype": "b"}}}]}, "section.setting"),
        ({"axes": [{"name": "r", "levels": {"x": {"sampling.seed": 1}}}]}, "the repeats vary the seed"),
        ({"axes": [{"name": "r", "levels": {"x": {"engine.python": "p"}}}]}, "where the engine runs from"),
        ({"mode": "random", "axes": [{"key": "engine.dtype", "values": ["a"]}]}, "one-at-a-time or grid"),
        ({"repeats": 0, "axes": [{"key": "engine.dtype", "values": ["a"]}]}, "repeats must be >= 1"),
        ({"colour": 1, "axes": [{"key": "engine.dtype", "values": ["a"]}]}, "unknown key 'colour'"),
    ],
)
def test_the_sweep_table_is_checked(sweep, message):
    with pytest.raises(ConfigError, match=message):
        spec_from_dict({"model": MODEL, "prompts": PROMPTS, "sweep": sweep})


def test_true_and_one_are_different_values():
    s = spec([{"key": "engine.prefix_caching", "values": [True, 1]}])
    assert [a.values for a in s.sweep.axes] == [[True, 1]]


def test_a_spec_without_sweep_fingerprints_as_before():
    plain = spec_from_dict({"model": MODEL, "prompts": PROMPTS})
    assert "sweep" not in plain.to_dict()


def test_point_names_are_safe_directory_names():
    assert point_name({"engine.kv_cache_dtype": "fp8 e4m3/x"}) == "engine.kv_cache_dtype=fp8-e4m3-x"
    assert point_name({"a.b": True, "c.d": 2}) == "a.b=true+c.d=2"


def test_compare_refuses_a_sweep_spec_and_sweep_refuses_a_bad_one(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(
        f'model = "{MODEL}"\nprompts = "{PROMPTS}"\n[engine]\nname = "hf"\n'
        '[sweep]\n[[sweep.axes]]\nkey = "engine.dtype"\nvalues = ["fp33"]\n'
    )
    runner = CliRunner()
    result = runner.invoke(app, ["compare", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "mismatch-probe sweep" in result.output
    result = runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "sweep")])
    assert (
        result.exit_code == 2
        and "engine.dtype must be one of auto, float32, bfloat16, float16, got 'fp33'" in result.output
    )
    assert not (tmp_path / "sweep").exists()  # checked before anything is written


def test_the_demo_spec_makes_the_points_its_comment_promises():
    plan = sweep_points(load_spec_file(ROOT / "probes" / "sweep-demo.toml"), "/tmp/unused")
    keys = {k for p in plan.points for k in p.settings}
    assert keys == {
        "engine.dtype",
        "reference.logits_fp32",
        "reference.dtype",
        "engine.tensor_parallel_size",
        "engine.prefix_caching",
        "engine.cascade_attn",
    }
    assert len(plan.repeats) == 2


LEVELS_SPEC = """
model = "../models/tiny-qwen2"
prompts = "../prompts/single_turn.jsonl"
[engine]
name = "vllm"
dtype = "bfloat16"
[reference]
dtype = "float32"
[sweep]
mode = "grid"
repeats = 2
[[sweep.axes]]
name = "rollout"
[sweep.axes.levels]
bf16 = {}
fp16 = { "engine.dtype" = "float16" }
"bf16 copy" = { "engine.checkpoint" = "../models/tiny-qwen2" }
"fp8 KV" = { "engine.kv_cache_dtype" = "fp8", "engine.dtype" = "bfloat16" }
[[sweep.axes]]
name = "trainer"
[sweep.axes.levels]
fp32 = { "reference.dtype" = "float32" }
bf16 = { "reference.dtype" = "bfloat16" }
"""


def test_named_levels_set_several_settings_and_a_grid_crosses_the_axes(tmp_path):
    # a level's path is relative to the spec file, as the file's own paths are
    fixtures = ROOT / "fixtures"
    file = tmp_path / "levels.toml"
    text = LEVELS_SPEC.replace("../prompts", str(fixtures / "prompts")).replace('"../models', f'"{fixtures}/models')
    file.write_text(text.replace(f'"{fixtures}/models/tiny-qwen2" }}', '"models-here/tiny-qwen2" }'))
    (tmp_path / "models-here").symlink_to(fixtures / "models")
    plan = sweep_points(load_spec_file(file), tmp_path / "out")
    # the baseline is bf16 x fp32 (its own settings), named by its levels
    assert plan.baseline.levels == {"rollout": "bf16", "trainer": "fp32"}
    assert [p.levels for p in plan.repeats] == [{"rollout": "bf16", "trainer": "fp32"}]
    names = [p.name for p in plan.points]
    assert names == [
        "trainer=bf16",
        "rollout=fp16",
        "rollout=fp16+trainer=bf16",
        "rollout=bf16-copy",
        "rollout=bf16-copy+trainer=bf16",
        "rollout=fp8-KV",
        "rollout=fp8-KV+trainer=bf16",
    ]
    by_name = {p.name: p for p in plan.points}
    # a level's settings are those that differ from the baseline (fp8 KV's bfloat16 is the baseline's)
    assert by_name["rollout=fp8-KV"].settings == {"engine.kv_cache_dtype": "fp8"}
    assert by_name["rollout=fp16+trainer=bf16"].settings == {"engine.dtype": "float16", "reference.dtype": "bfloat16"}
    assert by_name["rollout=fp16+trainer=bf16"].levels == {"rollout": "fp16", "trainer": "bf16"}
    copy = by_name["rollout=bf16-copy"].spec
    assert copy.engine.checkpoint == str((ROOT / "fixtures" / "models" / "tiny-qwen2").resolve())
    # run.json records the path as the spec file gives it
    assert copy.to_dict()["engine"]["checkpoint"] == "models-here/tiny-qwen2"
    # reference-only levels share the baseline's engine; each rollout level has its own
    keys = {engine_key(p.spec) for p in plan.points}
    assert len(keys) == 4 and engine_key(by_name["trainer=bf16"].spec) == engine_key(plan.baseline.spec)


def test_one_at_a_time_over_named_levels(tmp_path):
    plan = sweep_points(
        spec(
            [
                {"name": "rollout", "levels": {"bf16": {}, "fp16": {"engine.dtype": "float16"}}},
                {"key": "reference.dtype", "values": ["float32", "bfloat16"]},
            ]
        ),
        tmp_path,
    )
    assert [(p.name, p.levels) for p in plan.points] == [
        ("rollout=fp16", {"rollout": "fp16", "reference.dtype": "float32"}),
        ("reference.dtype=bfloat16", {"rollout": "bf16", "reference.dtype": "bfloat16"}),
    ]


def test_a_baseline_that_is_none_of_the_levels_has_no_level(tmp_path):
    plan = sweep_points(spec([{"name": "rollout", "levels": {"fp16": {"engine.dtype": "float16"}}}]), tmp_path)
    assert plan.baseline.levels == {"rollout": None}
    assert [p.name for p in plan.points] == ["rollout=fp16"]

"""A sweep split over machines (sweeps/units.py): the engine-configuration groups, which shard runs
which, the resources a Ray task asks for, and the state files each shard keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mismatch_probe.config.spec_reading import spec_from_dict
from mismatch_probe.config.sweep import STATE_JSON, sweep_points
from mismatch_probe.errors import ConfigError
from mismatch_probe.sweeps.ray_executor import resources
from mismatch_probe.sweeps.units import Group, Shard, SweepState, engine_groups, shard_groups

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "fixtures" / "models" / "tiny-qwen2")
PROMPTS = str(ROOT / "fixtures" / "prompts" / "single_turn.jsonl")

AXES = [
    {"key": "engine.dtype", "values": ["bfloat16", "float32"]},
    {"key": "engine.tensor_parallel_size", "values": [1, 2]},
    {"key": "reference.dtype", "values": ["bfloat16"]},
    {"key": "reference.sequence_parallel_size", "values": [1, 4]},
    {"key": "sampling.temperature", "values": [0.7]},
    {"key": "engine.enforce_eager", "values": [True]},
]


def plan(tmp_path, **sweep):
    spec = spec_from_dict(
        {
            "model": MODEL,
            "prompts": PROMPTS,
            "engine": {"name": "vllm", "dtype": "bfloat16"},
            "reference": {"dtype": "float32", "packing": True},
            "sweep": {"axes": AXES, "repeats": 2, **sweep},  # the baseline and one repeat
        }
    )
    return sweep_points(spec, tmp_path)


def test_groups_are_engine_configurations_with_their_rescorers(tmp_path):
    p = plan(tmp_path)
    groups = engine_groups([q for q in p.runs if q.spec is not None])
    names = [[m.name for m in g.members] for g in groups]
    # the baseline's engine serves its repeats and the sampling change; its tokens are re-scored by
    # the two reference points; each engine change is a group of its own
    assert names == [
        [
            "baseline",
            "baseline-repeat1",
            "reference.dtype=bfloat16",
            "reference.sequence_parallel_size=4",
            "sampling.temperature=0.7",
        ],
        ["engine.dtype=float32"],
        ["engine.tensor_parallel_size=2"],
        ["engine.enforce_eager=true"],
    ]
    assert {k: v.name for k, v in groups[0].source.items()} == {
        "reference.dtype=bfloat16": "baseline",
        "reference.sequence_parallel_size=4": "baseline",
    }
    assert groups[0].layout() == {"engine": 1, "reference": 4, "devices": 4}
    assert groups[2].layout() == {"engine": 2, "reference": 1, "devices": 2}
    assert resources(groups[0], cluster_gpus=8) == {"num_gpus": 4, "num_cpus": 1}
    assert resources(groups[2], cluster_gpus=0) == {"num_gpus": 0, "num_cpus": 2}


def test_shards_split_whole_groups_the_largest_first(tmp_path):
    p = plan(tmp_path)
    groups = engine_groups([q for q in p.runs if q.spec is not None])
    for count in (1, 2, 3, 4, 7):
        shares = [shard_groups(groups, Shard(i, count)) for i in range(1, count + 1)]
        keys = [g.key for share in shares for g in share]
        assert sorted(keys) == sorted(g.key for g in groups)  # every group once, in exactly one shard
        assert len(set(keys)) == len(keys)
        for share in shares:  # each shard keeps the plan's order
            assert [g.key for g in share] == [g.key for g in groups if g in share]
    # 2 shards: the baseline's group (5 points) alone; the three single-point groups together
    one, two = (shard_groups(groups, Shard(i, 2)) for i in (1, 2))
    assert [len(g.members) for g in one] == [5] and [len(g.members) for g in two] == [1, 1, 1]
    # more shards than groups: the last ones have nothing to run
    assert [len(shard_groups(groups, Shard(i, 6))) for i in range(1, 7)] == [1, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("text,expected", [("1/2", Shard(1, 2)), (" 3 / 4 ", Shard(3, 4)), ("1/1", Shard(1, 1))])
def test_shard_parse(text, expected):
    assert Shard.parse(text) == expected and Shard.parse(text).unit == f"shard-{expected.index}-of-{expected.count}"


@pytest.mark.parametrize("text", ["0/2", "3/2", "2", "a/b", "1/0", "-1/2", "1/2/3"])
def test_shard_parse_refuses(text):
    with pytest.raises(ConfigError, match="is not I/N"):
        Shard.parse(text)


def test_each_shard_writes_its_own_state_and_reads_everyones(tmp_path):
    (tmp_path / STATE_JSON).write_text(json.dumps({"fingerprint": "f", "refused": {"a": "old"}}))
    one, two = SweepState(tmp_path, "shard-1-of-2"), SweepState(tmp_path, "shard-2-of-2")
    for s in (one, two):
        s.begin()
    one.refuse("b", "no fp8")
    two.fail("c", "boom")
    one.add_invocation({"finished_at": "2026-01-02", "engine_starts": 1})
    two.add_invocation({"finished_at": "2026-01-01", "engine_starts": 2})
    # neither touched sweep-state.json nor the other's file
    assert json.loads((tmp_path / STATE_JSON).read_text()) == {"fingerprint": "f", "refused": {"a": "old"}}
    assert json.loads((tmp_path / "shards" / "shard-2-of-2.json").read_text())["failures"] == {"c": "boom"}
    reader = SweepState(tmp_path, None)
    assert reader.refused == {"a": "old", "b": "no fp8"}
    assert reader.failures == {"c": "boom"}
    assert [i["engine_starts"] for i in reader.invocations] == [2, 1]  # in the order they finished
    # a shard run again forgets its own earlier failures (the point is tried again), not its refusals
    again = SweepState(tmp_path, "shard-2-of-2")
    again.begin()
    again.save()
    assert SweepState(tmp_path, None).failures == {}


def test_a_group_unit_is_named_by_its_key():
    assert Group("abc", [], {}).unit == "group-abc"

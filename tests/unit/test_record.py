"""The typed run record: old records migrate, round-trip unchanged, and bad ones fail in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mismatch_probe.errors import ConfigError
from mismatch_probe.record import (
    SCHEMA_VERSION,
    RunRecord,
    find_record,
    json_safe,
    migrate,
    parse_record,
    read_record,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.parent for p in (ROOT / "reports").glob("*/run.json"))


@pytest.mark.parametrize("run_dir", EXAMPLES, ids=lambda p: p.name)
def test_committed_examples_load_and_round_trip_key_for_key(run_dir):
    stored = json.loads((run_dir / "run.json").read_text())
    record = read_record(run_dir)
    assert record.schema_version == SCHEMA_VERSION and record.is_complete
    # everything stored comes back as stored; the migrations add only the sequences key (None before
    # v3) and the schema whose rules computed the fingerprints (3 before v4)
    expected = json_safe(stored) | {"schema_version": SCHEMA_VERSION}
    if stored["schema_version"] < 3:
        expected["sequences"] = None
    if stored["schema_version"] < 4:
        expected["fingerprint_schema"] = 3
    assert json.loads(record.to_json()) == expected
    assert record.metric("k3_kl") == stored["metrics"]["k3_kl"]
    assert record.metric("n_sequences", "first") == stored["metrics_by_turn"]["first"]["n_sequences"]
    assert record.lookup("metrics_by_turn.first.k3_kl") == stored["metrics_by_turn"]["first"]["k3_kl"]
    assert record.lookup("metrics.no_such_metric") is None and record.lookup("inputs.model.deeper") is None


def minimal(**overrides) -> dict:
    data = {
        "schema_version": SCHEMA_VERSION,
        "status": "complete",
        "spec": {"engine": {"name": "hf"}},
        "metrics": {"k3_kl": 1e-4, "mult_prob_error": "inf", "n_sequences": 2},
        "metrics_by_turn": {"later": {"k3_kl": None, "abs_delta_max": "-inf"}},
    }
    return data | overrides


def test_infinities_are_floats_in_memory_and_strings_on_disk(tmp_path):
    record = parse_record(minimal())
    assert record.metric("mult_prob_error") == math.inf and record.metric("abs_delta_max", "later") == -math.inf
    assert record.metric("k3_kl", "later") is None and record.metric("k3_kl", "first") is None
    record.metrics["pearson_prob"] = float("nan")
    record.write(tmp_path)
    stored = json.loads((tmp_path / "run.json").read_text())
    assert stored["metrics"]["mult_prob_error"] == "inf" and stored["metrics"]["pearson_prob"] is None
    assert not list(tmp_path.glob(".*tmp"))  # written atomically through a temporary file


def test_absent_keys_stay_absent_and_unknown_keys_survive():
    record = parse_record(minimal(engine={"engine": "vllm", "a_new_engine_setting": 3}, future_section={"x": 1}))
    out = json.loads(record.to_json())
    assert out["engine"] == {"engine": "vllm", "a_new_engine_setting": 3}
    assert out["future_section"] == {"x": 1}
    assert "error" not in out and "reference" not in out  # not given, not written as null
    assert record.engine is not None and record.engine.settings()["a_new_engine_setting"] == 3


def test_set_sections_are_validated_and_written():
    record = parse_record(minimal())
    record.update_sections({"engine": {"engine": "hf", "routing": {"moe_layers": [1, 3], "top_k": 2}}})
    assert record.engine is not None and record.engine.routing is not None
    assert record.engine.routing.top_k == 2 and record.engine.routing.moe_layers == [1, 3]
    record.status = "failed"
    assert json.loads(record.to_json())["status"] == "failed"


def test_migration_from_every_earlier_schema():
    for version in (1, 2, 3):
        data = minimal(schema_version=version)
        migrated = migrate(data)
        assert migrated["schema_version"] == SCHEMA_VERSION and migrated["fingerprint_schema"] == 3
        assert ("sequences" in migrated) == (version < 3) and migrated.get("sequences") is None
        assert data["schema_version"] == version  # the caller's dict is not changed
    assert migrate({k: v for k, v in minimal().items() if k != "schema_version"})["sequences"] is None
    # a current record keeps the rules it states (absent: the current ones)
    assert parse_record(minimal()).fingerprint_schema == SCHEMA_VERSION
    assert parse_record(minimal(fingerprint_schema=3)).fingerprint_schema == 3


def test_a_newer_record_is_refused_with_what_to_do():
    with pytest.raises(ConfigError, match="schema_version 99, newer than") as err:
        parse_record(minimal(schema_version=99))
    assert "upgrade" in err.value.hint


@pytest.mark.parametrize(
    ("override", "where"),
    [
        ({"status": "done"}, "status"),
        ({"timings": {"setup_s": "slow"}}, "timings.setup_s"),
        ({"engine": {"routing": {"top_k": 2}}}, "engine.routing.moe_layers"),
    ],
)
def test_a_bad_value_names_its_key(override, where):
    with pytest.raises(ConfigError) as err:
        parse_record(minimal(**override), "x/run.json")
    assert str(err.value).startswith(f"x/run.json: {where}: ") and "\n" not in str(err.value)


def test_read_record_says_what_is_wrong_with_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="is not a run directory: it has no run.json"):
        read_record(tmp_path)
    assert find_record(tmp_path) is None
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        read_record(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(minimal(status="failed", error="engine died", metrics=None)))
    with pytest.raises(ConfigError, match="run .* is failed: engine died; it has no metrics"):
        read_record(tmp_path)
    assert read_record(tmp_path, require_complete=False).error == "engine died"
    assert isinstance(find_record(tmp_path), RunRecord)

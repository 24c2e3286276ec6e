"""The shipped JSON Schemas are the models' own, and every TOML file in the repo validates (models and schema)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema  # the test extra installs it
import pytest

from mismatch_probe.config import schema
from mismatch_probe.config.spec_reading import spec_from_dict
from mismatch_probe.config.thresholds import ThresholdsFile

ROOT = Path(__file__).resolve().parents[2]
TOMLS = sorted(p for d in ("probes", "examples") for p in (ROOT / d).rglob("*.toml") if p.name != "pyproject.toml")


def is_thresholds(path: Path) -> bool:
    return "checks" in tomllib.loads(path.read_text())


@pytest.mark.parametrize("name", sorted(schema.MODELS))
def test_shipped_schema_files_equal_the_generated_ones(name):
    shipped = (schema.HERE / name).read_text()
    assert shipped == schema.render(schema.schemas()[name]), "run: python -m mismatch_probe.config.schema"
    assert json.loads(shipped)["$schema"].startswith("https://json-schema.org/")


def test_the_regeneration_command_checks_and_writes(tmp_path, monkeypatch):
    assert schema.main(["--check"]) == 0
    monkeypatch.setattr(schema, "HERE", tmp_path)
    monkeypatch.setattr(schema, "SETTINGS_MD", tmp_path / "settings.md")
    assert schema.main(["--check"]) == 1  # nothing written there yet
    assert schema.main([]) == 0 and schema.main(["--check"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*schema.MODELS, "settings.md"])


def test_the_repo_has_spec_and_thresholds_files():
    kinds = {is_thresholds(p) for p in TOMLS}
    assert kinds == {True, False}, TOMLS


@pytest.mark.parametrize("path", TOMLS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_toml_file_in_the_repo_validates(path):
    data = tomllib.loads(path.read_text())
    if is_thresholds(path):
        ThresholdsFile.model_validate(data)
        name = "thresholds.schema.json"
    else:
        spec_from_dict(data, base_dir=path.parent, source=str(path), text=path.read_text())
        name = "probe-spec.schema.json"
    jsonschema.validate(data, json.loads((schema.HERE / name).read_text()))


@pytest.mark.parametrize(
    ("name", "document"),
    [
        ("probe-spec.schema.json", {"engine": {"dtyp": "bf16"}}),
        ("probe-spec.schema.json", {"sampling": {"n": 1.5}}),
        ("probe-spec.schema.json", {"variants": [{"name": "a/b"}, {"name": "c"}]}),
        ("thresholds.schema.json", {"checks": [{"metric": "k3_kl", "op": "=<", "threshold": 1}]}),
        ("thresholds.schema.json", {"checks": []}),
    ],
)
def test_the_schemas_reject_what_the_models_reject(name, document):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, json.loads((schema.HERE / name).read_text()))

"""Engines register through one public function, and installed plugins through the
``mismatch_probe.engines`` entry-point group (read from a distribution's metadata, as pip leaves it)."""

from __future__ import annotations

import sys

import pytest
from conftest import registered

from mismatch_probe import engines
from mismatch_probe.engines import EngineEntry, get_entry, register_engine, registered_engines, unregister_engine
from mismatch_probe.errors import ConfigError


def test_register_engine_checks_its_settings_and_refuses_a_name_taken():
    entry = EngineEntry("inhouse", "inhouse:Engine", (), "pip install inhouse", "test", settings=frozenset({"device"}))
    with registered(entry):
        assert get_entry("inhouse") is entry and "inhouse" in registered_engines()
        with pytest.raises(ConfigError, match="already registered"):
            register_engine(entry)
    assert "inhouse" not in registered_engines()
    with pytest.raises(ConfigError, match="declares settings the spec does not have: warp_speed"):
        register_engine(EngineEntry("x", "x:E", (), "", "", settings=frozenset({"warp_speed"})))
    with pytest.raises(ConfigError, match="built-in"):
        unregister_engine("vllm")


def write_distribution(site, name: str, entry_points: str, modules: dict[str, str]) -> None:
    """A distribution as pip installs it: its modules and a dist-info directory with entry_points.txt."""
    dist = site / f"{name}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[mismatch_probe.engines]\n{entry_points}\n")
    for module, text in modules.items():
        (site / f"{module}.py").write_text(text)


def test_plugins_are_found_by_their_entry_points_and_a_broken_one_is_listed_not_fatal(tmp_path, monkeypatch):
    write_distribution(
        tmp_path,
        "inhouse-engines",
        "declared = inhouse_declared:ENTRY\nbare = inhouse_bare:Engine\nbroken = inhouse_missing:ENTRY",
        {
            "inhouse_declared": (
                "from mismatch_probe.engines import EngineEntry\n"
                "ENTRY = EngineEntry('declared', 'inhouse_declared:Engine', (), 'pip install inhouse', 'in-house',"
                " settings=frozenset({'tensor_parallel_size'}))\n"
            ),
            "inhouse_bare": "class Engine:\n    name = 'bare'\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(engines, "_PLUGINS_LOADED", False)
    monkeypatch.setattr(engines, "_REGISTRY", dict(engines.BUILTIN_ENGINES))
    found = registered_engines()
    assert found["declared"].settings == {"tensor_parallel_size"} and found["declared"].missing() == []
    assert found["bare"].target == "inhouse_bare:Engine" and "tensor_parallel_size" in found["bare"].settings
    assert found["broken"].missing() and "inhouse_missing" in found["broken"].missing()[0]
    assert set(engines.BUILTIN_ENGINES) <= set(found)
    sys.modules.pop("inhouse_declared", None)

"""CI requires every optional component it installs (tests/required.py): .ci/run sets each
MISMATCH_PROBE_REQUIRE_* variable, and only tests/required.py reads them, with one rule."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT
from required import COMPONENTS, required, unavailable, variable

VARIABLE = re.compile(r"MISMATCH_PROBE_REQUIRE_([A-Z]+)")


def test_ci_requires_every_component_and_no_other():
    exported = set(
        re.findall(r"^export MISMATCH_PROBE_REQUIRE_([A-Z]+)=1$", (ROOT / ".ci/run").read_text(), re.MULTILINE)
    )
    assert exported == set(COMPONENTS)


def test_only_the_helper_reads_the_variables():
    for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "mismatch_probe").rglob("*.py")]:
        if path.name in ("required.py", "test_required.py"):
            continue
        text = path.read_text()
        assert not re.search(r"environ[^\n]*MISMATCH_PROBE_REQUIRE_", text), f"{path} reads a REQUIRE variable itself"
        for name in VARIABLE.findall(text):  # named in a docstring or a message: a component that exists
            assert name in COMPONENTS, f"{path}: MISMATCH_PROBE_REQUIRE_{name} is no component of tests/required.py"


@pytest.mark.parametrize(
    "value, is_required",
    [(None, False), ("", False), ("0", False), ("false", False), ("No", False), (" off ", False)]
    + [("1", True), ("true", True), ("yes", True), ("anything", True)],
)
def test_one_rule_for_every_variable(monkeypatch, value, is_required):
    for name in COMPONENTS:
        if value is None:
            monkeypatch.delenv(variable(name), raising=False)
        else:
            monkeypatch.setenv(variable(name), value)
        assert required(name) is is_required


def test_an_absent_required_component_fails_and_an_optional_one_skips(monkeypatch):
    monkeypatch.setenv(variable("VERL"), "1")
    with pytest.raises(pytest.fail.Exception, match="MISMATCH_PROBE_REQUIRE_VERL is set"):
        unavailable("VERL", "verl is not installed")
    monkeypatch.setenv(variable("VERL"), "0")
    with pytest.raises(pytest.skip.Exception, match="verl is not installed"):
        unavailable("VERL", "verl is not installed")
    with pytest.raises(KeyError):
        required("TYPO")

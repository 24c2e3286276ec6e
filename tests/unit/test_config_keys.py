"""The one did-you-mean and the TOML key-line scanner every config message uses."""

from __future__ import annotations

from mismatch_probe.config.keys import KeyLines, closest, did_you_mean, unknown_key


def test_did_you_mean_suggests_the_closest_or_lists_the_options():
    assert closest("dtyp", ["dtype", "device"]) == "dtype"
    assert did_you_mean("dtyp", {"dtype", "device"}) == "did you mean 'dtype'?"
    assert did_you_mean("zzz", ["b", "a"]) == "known keys: a, b"
    assert did_you_mean("zzz", ["a"], otherwise="see X") == "see X"
    assert closest("vlm", ["vllm", "hf"], cutoff=0.5) == "vllm"
    assert closest("k3_kll", ["k3_kl"], cutoff=0.99) is None


def test_unknown_key_is_one_config_error_line():
    err = unknown_key("treshold", ["threshold", "op"], "t.toml:4: check 1")
    assert str(err) == "t.toml:4: check 1: unknown key 'treshold' (did you mean 'threshold'?)"
    assert err.exit_code == 2


def test_every_config_did_you_mean_goes_through_one_helper():
    """No module of the package calls difflib but config/keys.py."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "mismatch_probe"
    users = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "difflib" in p.read_text())
    assert users == ["config/keys.py"]


TEXT = """\
name = "x"          # 1
[engine]            # 2
dtype = "bf16"      # 3
[engine.extra_args] # 4
max_logprobs = 5    # 5
[[variants]]        # 6
name = "a"          # 7
reference.tp = 2    # 8
[[variants]]        # 9
name = "b"          # 10
[variants.reference]  # 11
"packing" = false   # 12
[[checks]]          # 13
op = "<="           # 14
"""


def test_key_lines_follow_tables_arrays_and_dotted_keys():
    lines = KeyLines(TEXT)
    assert lines.line(("name",)) == 1
    assert lines.line(("engine",)) == 2
    assert lines.line(("engine", "dtype")) == 3
    assert lines.line(("engine", "extra_args", "max_logprobs")) == 5
    assert lines.line(("variants", 0)) == 6
    assert lines.line(("variants", 0, "reference", "tp")) == 8
    assert lines.line(("variants", 1, "name")) == 10
    assert lines.line(("variants", 1, "reference")) == 11
    assert lines.line(("variants", 1, "reference", "packing")) == 12
    assert lines.line(("checks", 0, "threshold")) == 13  # absent: its table's header
    assert lines.line(("nowhere",)) is None
    assert lines.headers("variants") == [6, 9] and lines.headers("checks") == [13] and lines.headers("x") == []

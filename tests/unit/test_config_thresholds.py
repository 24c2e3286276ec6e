"""The thresholds file's models: structure and types in config, with the line of each problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from mismatch_probe.config.thresholds import CheckSpec, ThresholdsFile, load_thresholds
from mismatch_probe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
OK = "[[checks]]\nmetric = 'k3_kl'\nop = '<='\nthreshold = 1e-3\n"


def error(tmp_path: Path, text: str) -> str:
    p = tmp_path / "t.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_thresholds(p)
    return str(exc.value).replace(str(tmp_path) + "/", "")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            OK + "\n[[checks]]\nmetric = 'x'\nop = '<'\ntreshold = 1\n",
            "t.toml:9: check 2: unknown key 'treshold' (did you mean 'threshold'?)",
        ),
        (OK.replace("1e-3", "'small'"), "t.toml:4: check 1: threshold must be a finite number, got 'small'"),
        (OK.replace("1e-3", "inf"), "t.toml:4: check 1: threshold must be a finite number, got inf"),
        (OK.replace("1e-3", "true"), "t.toml:4: check 1: threshold must be a finite number, got True"),
        (OK.replace("'<='", "'=<'"), "t.toml:3: check 1: op must be one of <, <=, >, >=, ==, got '=<'"),
        (OK.replace("op = '<='\n", ""), "t.toml:1: check 1: op is required: one of <, <=, >, >=, =="),
        (
            OK.replace("threshold = 1e-3", "baseline_factor = -1"),
            "t.toml:4: check 1: baseline_factor must be > 0, got -1",
        ),
        (OK + "severity = 'info'\n", "t.toml:5: check 1: severity must be one of fail, warn, got 'info'"),
        (OK.replace("'k3_kl'", "3"), "t.toml:2: check 1: metric must be a string, got 3"),
        (OK + "turns = 'all'\n", "t.toml:5: check 1: turns goes with sequence_metric, not metric"),
        (
            OK.replace("metric", "sequence_metric").replace("k3_kl", "nope"),
            "t.toml:2: check 1: unknown sequence_metric 'nope'",
        ),
        (
            "[[checks]]\nsequence_metric = 'max_mismatch'\nop = '<'\nthreshold = 1\n",
            "t.toml:1: check 1: statistic must be one of",
        ),
        (OK + "above = 0.5\n", "t.toml:5: check 1: above goes with sequence_metric"),
        ("checks = []\n", "t.toml: no checks"),
        ("", "t.toml: no checks"),
        ("checks = [1]\n", "t.toml:1: check 1: must be a table"),
        (OK + "[gate]\nx = 1\n", "t.toml:5: unknown top-level key 'gate'"),
    ],
)
def test_errors_name_the_check_and_the_line(tmp_path, text, message):
    assert error(tmp_path, text).startswith(message)


def test_a_valid_file_keeps_its_checks_and_their_lines(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text("# gate\n\n" + OK + "\n" + OK.replace("k3_kl", "pearson_prob"))
    t = load_thresholds(p)
    assert [c.metric for c in t.checks] == ["k3_kl", "pearson_prob"] and t.lines == [3, 8]
    assert t.checks[0].severity == "fail" and t.checks[0].turns == "all" and t.checks[0].threshold == 1e-3
    assert str(t.error(1, "bad", "metric")) == f"{p}:9: check 2: bad"


def test_the_check_model_is_frozen_and_strict():
    with pytest.raises(ValueError):
        CheckSpec(metric="k3_kl", op="<=", threshold="1")
    check = CheckSpec(metric="k3_kl", op="<=", threshold=1)
    with pytest.raises(ValueError):
        check.op = "<"


@pytest.mark.parametrize("name", ["gate-default.toml", "gate-regression.toml"])
def test_shipped_thresholds_files_validate(name):
    import tomllib

    parsed = ThresholdsFile.model_validate(tomllib.loads((ROOT / "probes" / name).read_text()))
    assert parsed.checks and all(c.source and c.description for c in parsed.checks)

"""The CI gate through the real CLI on a real run: every status and exit code, fail-closed values,
baseline-relative bounds, sequence statistics against NumPy, and JUnit XML read by junitparser."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import DENSE, ROOT, SINGLE_TURN, cli

from mismatch_probe.errors import ConfigError
from mismatch_probe.gate.checks import load_gate, sequence_statistic


def thresholds(tmp_path, body: str, name="t.toml"):
    path = tmp_path / name
    path.write_text(body)
    return path


def check(metric, op, bound, severity="fail", name=None, **extra) -> str:
    lines = (
        ["[[checks]]", f'metric = "{metric}"' if metric else "", f'op = "{op}"', f"{bound}", f'severity = "{severity}"']
        + ([f'name = "{name}"'] if name else [])
        + [f"{k} = {v}" for k, v in extra.items()]
    )
    return "\n".join(line for line in lines if line) + "\n\n"


def gate(run, path, *more):
    proc = cli("gate", str(run), "--thresholds", str(path), "--json", *more)
    return proc, (json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None)


def edited_copy(run, tmp_path, name, **metrics):
    """A copy of a run whose run.json metrics are edited (NaN written as a JSON NaN literal)."""
    out = tmp_path / name
    shutil.copytree(run, out)
    rec = json.loads((out / "run.json").read_text())
    rec["metrics"].update(metrics)
    (out / "run.json").write_text(json.dumps(rec, allow_nan=True))
    return out


def test_every_status_and_exit_code(bf16_run, tmp_path):
    k3 = json.loads((bf16_run / "run.json").read_text())["metrics"]["k3_kl"]
    passing = check("k3_kl", "<=", f"threshold = {k3 * 2}") + check("pearson_prob", ">=", "threshold = 0.99")
    proc, res = gate(bf16_run, thresholds(tmp_path, passing))
    assert proc.returncode == 0 and res["status"] == "PASS" and res["counts"]["PASS"] == 2, proc.stderr
    assert res["checks"][0]["value"] == pytest.approx(k3)

    warning = passing + check("k3_kl", "<=", f"threshold = {k3 / 2}", "warn", name="tight")
    proc, res = gate(bf16_run, thresholds(tmp_path, warning))
    assert proc.returncode == 0 and res["status"] == "WARN"  # warnings are allowed
    assert [c["status"] for c in res["checks"]] == ["PASS", "PASS", "WARN"]

    failing = warning + check("k3_kl", "<", f"threshold = {k3}", name="strict")  # equal is not < : fails
    proc, res = gate(bf16_run, thresholds(tmp_path, failing))
    assert proc.returncode == 1 and res["status"] == "FAIL" and res["checks"][-1]["status"] == "FAIL"
    assert "is not <" in res["checks"][-1]["message"]

    erroring = failing + check("k3_kl", "<=", "baseline_factor = 1.5", name="vs base")
    proc, res = gate(bf16_run, thresholds(tmp_path, erroring))
    assert proc.returncode == 2 and res["status"] == "ERROR"
    assert "no --baseline" in res["checks"][-1]["message"]

    proc = cli("gate", str(bf16_run), "--thresholds", str(thresholds(tmp_path, failing)))  # the table
    assert proc.returncode == 1 and "gate FAIL: 2 PASS, 1 WARN, 1 FAIL" in proc.stdout.replace("\n", " ")


def test_missing_nan_and_infinite_values_fail_closed(bf16_run, tmp_path):
    body = (
        check("k3_kl", "<=", "threshold = 1", "warn", name="k3")
        + check("metrics_by_turn.later.k3_kl", "<=", "threshold = 1", "warn", name="later")
        + check("chi2_token_sn", ">=", "threshold = 0", name="chi2")
    )  # >= 0 by construction
    path = thresholds(tmp_path, body)
    proc, res = gate(bf16_run, path)  # single-turn run: no later turns
    assert proc.returncode == 1
    assert [c["status"] for c in res["checks"]] == ["PASS", "FAIL", "PASS"]  # fails even at warn severity
    assert "missing" in res["checks"][1]["message"]
    for name, value in (("nan", float("nan")), ("inf", "inf"), ("null", None)):
        run = edited_copy(bf16_run, tmp_path, name, k3_kl=value, chi2_token_sn=value)
        proc, res = gate(run, path)
        assert proc.returncode == 1, name
        assert res["checks"][0]["status"] == "FAIL" and res["checks"][2]["status"] == "FAIL", name


def test_baseline_relative_bounds(bf16_run, tmp_path):
    rec = json.loads((bf16_run / "run.json").read_text())["metrics"]
    path = thresholds(
        tmp_path,
        check("k3_kl", "<=", "baseline_factor = 1.5", name="k3")
        + check("abs_delta_p99", "<=", "baseline_factor = 1.0", name="p99"),
    )
    proc, res = gate(bf16_run, path, "--baseline", str(bf16_run))  # against itself: equal passes <=
    assert proc.returncode == 0 and res["baseline"] == str(bf16_run)
    assert res["checks"][0]["threshold"] == pytest.approx(1.5 * rec["k3_kl"])
    assert res["checks"][1]["baseline_value"] == pytest.approx(rec["abs_delta_p99"])

    better = edited_copy(bf16_run, tmp_path, "better", k3_kl=rec["k3_kl"] / 2, abs_delta_p99=rec["abs_delta_p99"] / 2)
    proc, res = gate(bf16_run, path, "--baseline", str(better))  # now 2x the baseline: over 1.5x
    assert proc.returncode == 1 and [c["status"] for c in res["checks"]] == ["FAIL", "FAIL"]
    proc, res = gate(better, path, "--baseline", str(bf16_run))
    assert proc.returncode == 0

    broken = edited_copy(bf16_run, tmp_path, "broken", k3_kl="inf", abs_delta_p99=None)
    proc, res = gate(bf16_run, path, "--baseline", str(broken))
    assert proc.returncode == 1 and all("baseline's value" in c["message"] for c in res["checks"])


def per_sample(run):
    t = pq.read_table(run / "tokens.parquet").to_pandas() if False else pq.read_table(run / "tokens.parquet")
    model = t.column("is_model_token").to_numpy(zero_copy_only=False)
    sample = t.column("sample_id").to_numpy()[model]
    turn = t.column("turn").to_numpy()[model]
    gap = np.abs(
        np.exp(t.column("logp_train").to_numpy(zero_copy_only=False)[model].astype(np.float64))
        - np.exp(t.column("logp_infer").to_numpy(zero_copy_only=False)[model].astype(np.float64))
    )
    return {s: gap[sample == s].max() for s in np.unique(sample)}, turn


def test_sequence_statistics_match_numpy(bf16_run, tmp_path):
    worst, turn = per_sample(bf16_run)
    values = np.array(list(worst.values()))
    assert (turn == 0).all()  # single turn: "first" sequences are the samples
    stats = [
        ("p99", None, np.percentile(values, 99)),
        ("p50", None, np.median(values)),
        ("mean", None, values.mean()),
        ("max", None, values.max()),
        ("share_above", float(np.median(values)), (values > np.median(values)).mean()),
    ]
    body = ""
    for stat, above, _ in stats:
        body += (
            "[[checks]]\n"
            f'name = "{stat}"\n'
            'sequence_metric = "max_mismatch"\n'
            f'statistic = "{stat}"\n'
            + (f"above = {above!r}\n" if above is not None else "")
            + 'op = "<="\nthreshold = 1\n\n'
        )
    body += (
        '[[checks]]\nname = "first"\nsequence_metric = "max_mismatch"\nstatistic = "p99"\nturns = "first"\n'
        'op = "<="\nthreshold = 1\n'
    )
    proc, res = gate(bf16_run, thresholds(tmp_path, body))
    assert proc.returncode == 0, proc.stderr
    got = {c["name"]: c["value"] for c in res["checks"]}
    for stat, _, expected in stats:
        assert got[stat] == pytest.approx(expected, rel=1e-9, abs=1e-12), stat
    assert got["first"] == pytest.approx(got["p99"], rel=1e-12)
    assert 0.3 < got["share_above"] < 0.7

    no_table = tmp_path / "summary-only"
    no_table.mkdir()
    shutil.copy(bf16_run / "run.json", no_table / "run.json")
    proc, res = gate(no_table, thresholds(tmp_path, body))
    assert proc.returncode == 2 and all(c["status"] == "ERROR" for c in res["checks"])
    assert "no per-token table" in res["checks"][0]["message"]


def test_sequence_statistic_edge_cases():
    assert sequence_statistic([], "p99", None) is None  # no sequences: missing, so the check fails closed
    assert sequence_statistic([0.2], "p99", None) == 0.2
    assert sequence_statistic([0.1, 0.6, 0.7, 0.2], "share_above", 0.5) == 0.5
    assert sequence_statistic([1.0, 3.0], "p50", None) == 2.0


def test_junit_and_markdown_outputs(bf16_run, tmp_path):
    from junitparser import Error, Failure, JUnitXml

    k3 = json.loads((bf16_run / "run.json").read_text())["metrics"]["k3_kl"]
    body = (
        check("k3_kl", "<=", "threshold = 1", name="ok")
        + check("k3_kl", ">=", "threshold = 1", name="bad")
        + check("k3_kl", ">=", "threshold = 1", "warn", name="meh")
        + check("k3_kl", "<=", "baseline_factor = 2", name="<rel>")
    )
    junit, md = tmp_path / "out" / "gate.xml", tmp_path / "out" / "summary.md"
    proc = cli(
        "gate",
        str(bf16_run),
        "--thresholds",
        str(thresholds(tmp_path, body)),
        "--junit",
        str(junit),
        "--markdown",
        str(md),
    )
    assert proc.returncode == 2  # the baseline check cannot be evaluated
    xml = JUnitXml.fromfile(str(junit))
    cases = {case.name: case for suite in xml for case in suite}
    assert list(cases) == ["ok", "bad", "meh", "<rel>"]
    assert cases["ok"].is_passed and cases["meh"].is_passed  # JUnit has no warning: a WARN passes
    assert isinstance(cases["bad"].result[0], Failure) and isinstance(cases["<rel>"].result[0], Error)
    assert f"{k3:.4g}" in cases["bad"].result[0].message
    assert "WARN" in cases["meh"].system_out
    text = md.read_text()
    assert text.startswith("## ⛔ mismatch-probe gate: ERROR")
    assert "| ❌ FAIL | bad |" in text and "| ⚠️ WARN | meh |" in text
    assert "| \\<rel> |" in text  # a check's name is text, never markup


@pytest.mark.parametrize(
    "body, where, message",
    [
        (
            "[[checks]]\nmetric = 'k3_kl'\nop = '<='\nthreshold = 1e-3\n\n[[checks]]\nmetric = 'k3_kl'\nop = '<='\ntreshold = 1\n",
            ":9:",
            "unknown key 'treshold'.*did you mean 'threshold'",
        ),
        (
            "[[checks]]\nmetric = 'k3_kll'\nop = '<='\nthreshold = 1\n",
            ":2:",
            "unknown metric 'k3_kll'.*did you mean 'k3_kl'",
        ),
        ("[[checks]]\nmetric = 'k3_kl'\nop = '=<'\nthreshold = 1\n", ":3:", "op must be one of"),
        ("[[checks]]\nmetric = 'k3_kl'\nop = '<='\n", ":1:", "exactly one of threshold"),
        (
            "[[checks]]\nmetric = 'k3_kl'\nop = '<='\nthreshold = 1\nbaseline_factor = 2\n",
            ":1:",
            "exactly one of threshold",
        ),
        ("[[checks]]\nmetric = 'k3_kl'\nop = '<='\nthreshold = 'small'\n", ":4:", "threshold must be a finite number"),
        ("[[checks]]\nmetric = 'k3_kl'\nop = '<='\nthreshold = 1\nseverity = 'info'\n", ":5:", "severity must be"),
        (
            "[[checks]]\nsequence_metric = 'max_mismatch'\nstatistic = 'p95'\nop = '<='\nthreshold = 1\n",
            ":3:",
            "statistic must be one of",
        ),
        (
            "[[checks]]\nsequence_metric = 'max_mismatch'\nstatistic = 'share_above'\nop = '<='\nthreshold = 1\n",
            ":3:",
            "share_above needs above",
        ),
        (
            "[[checks]]\nmetric = 'k3_kl'\nstatistic = 'p99'\nop = '<='\nthreshold = 1\n",
            ":3:",
            "statistic goes with sequence_metric",
        ),
        (
            "[[checks]]\nmetric = 'k3_kl'\nop = '<='\nthreshold = 1\n[[checks]]\nmetric = 'k3_kl'\nop = '<='\nthreshold = 2\n",
            ":5:",
            "duplicate check name",
        ),
        ("[[checks]]\nmetric = 'k3_kl'\nop = '<='\nthreshold = = 1\n", "not valid TOML", "line 4"),
        ("checks = 3\n", "", "no checks"),
        ("[gate]\nx = 1\n", ":1:", "unknown top-level key 'gate'"),
    ],
)
def test_malformed_thresholds_name_the_line(tmp_path, body, where, message):
    path = thresholds(tmp_path, body)
    with pytest.raises(ConfigError, match=message) as exc:
        load_gate(path)
    assert where in str(exc.value)


def test_bad_thresholds_through_the_cli_exit_2(bf16_run, tmp_path):
    path = thresholds(tmp_path, "[[checks]]\nmetric = 'k3_kl'\nop = '<='\ntreshold = 1\n")
    proc = cli("gate", str(bf16_run), "--thresholds", str(path))
    assert proc.returncode == 2 and f"{path}:4: check 1: unknown key 'treshold'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = cli("gate", str(tmp_path / "nope"), "--thresholds", str(path))
    assert proc.returncode == 2


def test_shipped_threshold_sets_load_and_pass_the_fixture(bf16_run):
    for name in ("gate-default.toml", "gate-regression.toml"):
        checks = load_gate(ROOT / "probes" / name).checks
        assert checks and all(c.source and c.description for c in checks), name
    proc, res = gate(bf16_run, ROOT / "probes" / "gate-default.toml")
    assert proc.returncode == 0 and res["counts"]["FAIL"] == 0, res
    proc, res = gate(bf16_run, ROOT / "probes" / "gate-regression.toml", "--baseline", str(bf16_run))
    assert proc.returncode == 0 and res["status"] == "PASS"


def test_compare_with_gate_probes_and_gates_in_one_step(tmp_path):
    body = check("k3_kl", "<=", "threshold = 1e-30", name="impossible")
    out = tmp_path / "run"
    args = [
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(SINGLE_TURN),
        "--out",
        str(out),
        "--engine",
        "hf",
        "--engine-dtype",
        "bfloat16",
        "--train-dtype",
        "float32",
        "--max-tokens",
        "8",
        "--n",
        "1",
        "--max-prompts",
        "4",
    ]
    proc = cli(*args, "--gate", str(thresholds(tmp_path, body)))
    assert proc.returncode == 1 and "gate FAIL" in proc.stdout and "impossible" in proc.stdout
    assert json.loads((out / "run.json").read_text())["status"] == "complete"  # the run is kept
    bad = thresholds(tmp_path, "[[checks]]\nmetric = 'nope'\nop = '<='\nthreshold = 1\n", "bad.toml")
    proc = cli(*args[:6], str(tmp_path / "never"), *args[7:], "--gate", str(bad))
    assert proc.returncode == 2 and "unknown metric 'nope'" in proc.stderr
    assert not (tmp_path / "never").exists()  # checked before any work

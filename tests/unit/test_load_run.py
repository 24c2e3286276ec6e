"""mismatch_probe.load_run: the record, and the tables as pandas DataFrames on demand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mismatch_probe
from mismatch_probe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "reports" / "example"
pytestmark = pytest.mark.skipif(not (EXAMPLE / "tokens.parquet").is_dir(), reason="no committed example run")


def test_the_readme_notebook_example():
    pytest.importorskip("pandas")
    run = mismatch_probe.load_run(EXAMPLE)
    seqs = run.sequences()
    worst = seqs.nlargest(5, "max_mismatch")
    assert len(seqs) == run.record.metric("n_sequences") == 128
    assert list(worst["max_mismatch"]) == sorted(seqs["max_mismatch"], reverse=True)[:5]
    tokens = run.tokens(["sample_id", "logp_infer", "logp_train"], model_tokens_only=True)
    assert len(tokens) == run.record.metric("n_model_tokens") == seqs["n_tokens"].sum()
    assert set(run.sequences(None)["group"]) == {"all", "first"}  # single-turn: no later turns


def test_load_run_stays_lazy_and_light():
    # importing the package pulls no pyarrow/pydantic/torch; load_run reads no table
    code = "import sys, mismatch_probe; print(sorted(m for m in ('torch', 'pyarrow', 'pydantic') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"
    run = mismatch_probe.load_run(EXAMPLE)
    assert run._cache == {}


def test_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        mismatch_probe.load_run(tmp_path)


def test_every_figure_of_a_run_as_a_matplotlib_figure():
    from matplotlib.figure import Figure

    run = mismatch_probe.load_run(EXAMPLE)
    ids = run.figure_ids()
    assert ids == [f["id"] for f in run.record.to_dict()["figures"]]  # the report's own, in its order
    for figure_id in ids:
        fig = run.figure(figure_id)
        assert isinstance(fig, Figure) and fig.axes, figure_id
    with pytest.raises(ConfigError, match="no figure 'nope'") as err:
        run.figure("nope")
    assert all(i in err.value.hint for i in ids)

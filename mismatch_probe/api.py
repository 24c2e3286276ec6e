"""The library entry point for notebooks and scripts: a finished run as Python objects.

    import mismatch_probe
    run = mismatch_probe.load_run("reports/example")
    run.record.metric("k3_kl"), run.sequences().nlargest(5, "max_mismatch"), run.tokens()
    run.figure("prob_density")  # a matplotlib Figure, as the report draws it

``tokens()`` and ``sequences()`` read the run's Parquet files when called (never at load), and
return pandas DataFrames (pandas is the ``[pandas]`` extra); ``*_table()`` return the Arrow tables.
``figure(id)`` reads the run's distributions on its first call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe.errors import ConfigError
from mismatch_probe.record import RunRecord, read_record

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa
    from matplotlib.figure import Figure


@dataclass
class Run:
    """A run directory: its record, and its tables on demand."""

    path: Path
    record: RunRecord
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def tokens_table(self, columns: list[str] | None = None, *, model_tokens_only: bool = False) -> pa.Table:
        """The per-token table (every shard, in order); prompt and tool tokens are rows too unless
        ``model_tokens_only``."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from mismatch_probe.table.tokens import TOKENS_DIR, shard_paths

        paths = shard_paths(self.path, TOKENS_DIR)
        if not paths:
            raise ConfigError(f"{self.path} has no per-token table ({TOKENS_DIR}/)", hint="the run has not been scored")
        wanted = None if columns is None else list(dict.fromkeys([*columns, "is_model_token"]))
        table = pa.concat_tables([pq.read_table(p, columns=wanted) for p in paths])
        if model_tokens_only:
            table = table.filter(pc.field("is_model_token"))
        return table if columns is None else table.select(columns)

    def sequences_table(self) -> pa.Table:
        """Per-sequence terms (sequences.parquet; computed from the tokens for older runs)."""
        if "sequences" not in self._cache:
            from mismatch_probe.analysis.analyze import sequences_from_tokens
            from mismatch_probe.table.tokens import read_sequences

            table = read_sequences(self.path)
            self._cache["sequences"] = table if table is not None else sequences_from_tokens(self.path)
        return self._cache["sequences"]

    def tokens(self, columns: list[str] | None = None, *, model_tokens_only: bool = False) -> pd.DataFrame:
        """The per-token table as a pandas DataFrame (expert-id columns as lists)."""
        return _to_pandas(self.tokens_table(columns, model_tokens_only=model_tokens_only))

    def dashboard(self, framework: str) -> pd.DataFrame:
        """``framework``'s own mismatch metrics on this run, one row per metric as that framework logs
        it (``key``, ``value``, the probe's counterpart ``probe`` and ``probe_value``, ``formula``,
        ``source``, ``note``): the rows of the report's "Your dashboard" table
        (analysis/peer_metrics.py)."""
        import pyarrow as pa

        from mismatch_probe.analysis.peer_metrics import frameworks
        from mismatch_probe.report.run_view import dashboard_rows

        if framework not in frameworks():
            raise ConfigError(f"no dashboard for {framework!r}", hint=f"one of {', '.join(frameworks())}")
        if not (self.record.dashboard or {}).get(framework):
            raise ConfigError(
                f"{self.path}/run.json has no dashboard (analysed before it existed)",
                hint=f"mismatch-probe analyze {self.path}",
            )
        rows = dashboard_rows(self.record, framework)
        return _to_pandas(pa.Table.from_pylist(rows))

    def sequences(self, group: str | None = "all") -> pd.DataFrame:
        """One row per sequence: ``group`` "all" (samples), "first" or "later" (sample-turns), or None
        for every group."""
        import pyarrow.compute as pc

        table = self.sequences_table()
        if group is not None:
            table = table.filter(pc.equal(table.column("group"), group))
        return _to_pandas(table)

    def figure_ids(self) -> list[str]:
        """The ids of this run's figures, in report order (``figures/<id>.svg`` in the run directory)."""
        from mismatch_probe.report.figures import run_figure_list

        return [info.id for info, _ in run_figure_list(self.record)]

    def figure(self, figure_id: str) -> Figure:
        """One of the report's figures as a matplotlib ``Figure`` (``fig.savefig(...)``, or shown by
        a notebook); an unknown id is a ConfigError naming the ids."""
        from mismatch_probe.report.figures import check_figure_id, run_figure

        check_figure_id(figure_id)  # before reading anything
        if "dist" not in self._cache:
            from mismatch_probe.report.data import load_run as load_report_data

            self._cache["dist"] = load_report_data(self.path).dist
        return run_figure(self.record, self._cache["dist"], figure_id)


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    try:
        import pandas  # noqa: F401
    except ImportError:
        raise ConfigError(
            "pandas is not installed", hint="pip install 'mismatch-probe[pandas]', or use the *_table() methods"
        ) from None
    return table.to_pandas()


def load_run(path: str | Path, *, require_complete: bool = True) -> Run:
    """A run directory as a :class:`Run` (its record loaded and validated; tables read lazily)."""
    return Run(Path(path), read_record(path, require_complete=require_complete))

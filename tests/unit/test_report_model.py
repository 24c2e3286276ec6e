"""One view model, three renderings: report.html, report.md and the terminal summary show the
same metric table (header, rows, cells), parsed back from each output, for the committed runs
and for runs built here with the columns the committed ones lack (later turns, an imported
dump's trainer)."""

from __future__ import annotations

import dataclasses
import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
from html_tables import SectionTables
from report_runs import synthetic_run, synthetic_tokens
from rich.console import Console

from mismatch_probe.report import html, markdown, terminal
from mismatch_probe.report.data import load_run
from mismatch_probe.report.run_view import RunView, run_view

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = [
    ROOT / "reports" / name
    for name in ("example", "example-fp32", *(f"parallelism-tp2/learner-{k}" for k in ("tp2", "sp2", "tp1")))
]


def html_table(page: str, section: str) -> list[list[str]]:
    parser = SectionTables(section)
    parser.feed(page)
    return parser.tables[0]


def md_table(text: str, heading: str) -> list[list[str]]:
    lines = text[text.index(f"\n{heading}\n") :].splitlines()[1:]
    rows = []
    for line in lines[next(i for i, line in enumerate(lines) if line.startswith("|")) :]:
        if not line.startswith("|"):
            break
        if re.fullmatch(r"\|(-+:?\|)+", line):
            continue
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        rows.append([c.strip().replace("`", "").replace("\\|", "|").replace("\\\\", "\\") for c in cells])
    return rows


def terminal_tables(view: RunView) -> list[list[list[str]]]:
    console = Console(record=True, width=400, color_system=None, file=io.StringIO())
    terminal.print_run(console, view)
    tables: list[list[list[str]]] = []
    for line in console.export_text().splitlines():
        if line.startswith(("┏", "┡", "└")):
            if line.startswith("┏"):
                tables.append([])
            continue
        if line.startswith(("┃", "│")):
            tables[-1].append([c.strip() for c in re.split(r"[┃│]", line)[1:-1]])
    return tables


def rendered(view: RunView) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    """The metric table as report.html, report.md and the terminal show it."""
    view = dataclasses.replace(view, figures=[])  # the tables are what is compared; figures are test_figures'
    page = html.render_run(view, [])
    return html_table(page, "metrics"), md_table(markdown.render_run(view), "## Metrics"), terminal_tables(view)[0]


def assert_one_table(view: RunView) -> list[list[str]]:
    from_html, from_md, from_terminal = rendered(view)
    assert from_md == from_html
    short = [i for i, c in enumerate(view.metrics.columns) if c.kind != "long"]  # the terminal leaves out
    assert from_terminal == [[row[i] for i in short] for row in from_html]
    assert len(from_html) == 1 + len(view.metrics.rows)
    return from_html


@pytest.mark.parametrize("run", COMMITTED, ids=lambda p: p.relative_to(ROOT / "reports").as_posix())
def test_the_committed_runs_metric_table_is_the_same_in_every_rendering(run):
    if not (run / "run.json").is_file():
        pytest.skip("the committed example runs are absent")
    data = load_run(run)
    table = assert_one_table(run_view(data.record, data.path, data.dist))
    header = table[0]
    # one turn: its first turn is all of it, so no turn columns; decode vs prefill where measured
    prefill = bool((data.record.decode_vs_prefill or {}).get("n_model_tokens"))
    assert header[:-2] == ["metric", "engine vs reference"] + (["decode vs prefill"] if prefill else [])
    k3 = next(row for row in table if row[0].endswith(" k3_kl"))
    assert float(k3[1]) == pytest.approx(data.record.metrics["k3_kl"], rel=1e-3)


def test_a_multi_turn_run_of_an_imported_dump_shows_its_trainer_and_its_turns():
    record, dist = synthetic_run(5000, imported="verl")
    table = assert_one_table(run_view(record, Path("run"), dist))
    assert table[0][:-2] == ["metric", "engine vs your trainer (verl)", "first turn", "later turns"]
    # K3 of every token and of the later turn, from the synthetic log-probs directly
    _, _, turn, lt, li = synthetic_tokens(5000)
    delta = lt.astype(np.float64) - li
    k3 = np.exp(delta) - delta - 1
    row = next(row for row in table if row[0].endswith(" k3_kl"))
    assert float(row[1]) == pytest.approx(k3.mean(), rel=1e-3)
    assert float(row[3]) == pytest.approx(k3[turn >= 1].mean(), rel=1e-3)
    n = next(row for row in table if row[0].endswith(" n_model_tokens"))
    assert n[1:4] == [f"{5000:,}", f"{int((turn == 0).sum()):,}", f"{int((turn >= 1).sum()):,}"]


def test_a_rescored_dump_adds_decode_vs_prefill_and_the_trainers_columns():
    record, dist = synthetic_run(5000, imported="slime", rescored=True)
    table = assert_one_table(run_view(record, Path("run"), dist))
    assert table[0][:-2] == [
        "metric",
        "engine vs reference",
        "first turn",
        "later turns",
        "decode vs prefill",
        "engine vs your trainer",
        "your trainer vs reference",
    ]
    ppl = next(row for row in table if row[0].endswith(" log_ppl_train"))
    assert ppl[4] == "-" and not math.isnan(float(ppl[1]))  # the engine's prefill has no reference log-ppl


def test_report_json_is_the_view_model():
    import json

    record, dist = synthetic_run(2000)
    view = run_view(record, Path("run"), dist)
    data = json.loads(view.to_json())
    assert data["kind"] == "run" and data["metrics"]["rows"][0]["key"] == "k3_kl"
    assert [c["label"] for c in data["metrics"]["columns"]] == [c.label for c in view.metrics.columns]
    assert [f["id"] for f in data["figures"]][:1] == ["prob_density"]


def test_a_comparison_shows_the_same_metric_table_on_its_page_and_in_the_terminal():
    """compare.html and the terminal's table of a spec's [[variants]] render one comparison view."""
    from mismatch_probe.report.comparison_view import comparison_view, label_runs
    from mismatch_probe.report.data import RunData

    runs = label_runs(
        [RunData(Path(name), *synthetic_run(n, name=name)) for name, n in (("bf16", 5000), ("fp32", 3000))]
    )
    view = dataclasses.replace(comparison_view(runs, "variants"), figures=[])
    page = html.render_comparison(view, [])
    console = Console(record=True, width=400, color_system=None, file=io.StringIO())
    terminal.print_comparison(console, view)
    tables: list[list[list[str]]] = []
    for line in console.export_text().splitlines():
        if line.startswith("┏"):
            tables.append([])
        elif line.startswith(("┃", "│")):
            tables[-1].append([c.strip() for c in re.split(r"[┃│]", line)[1:-1]])
    from_html = html_table(page, "metrics")
    assert from_html[0] == ["metric", "CPU: EPYC", "meaning"] and from_html[1] == ["bf16", "fp32"]  # grouped header
    assert tables[1][0] == ["metric", "bf16", "fp32"]
    assert tables[1][1:] == [row[:3] for row in from_html[2:]]
    k3 = next(row for row in from_html if row[0].endswith(" k3_kl"))
    assert [float(v) for v in k3[1:3]] == pytest.approx([r.record.metrics["k3_kl"] for r in runs], rel=1e-3)


@pytest.mark.skipif(not (ROOT / "reports" / "sweep-demo" / "sweep.json").is_file(), reason="no committed sweep")
def test_a_sweeps_attribution_is_the_same_in_sweep_md_and_sweep_html():
    from mismatch_probe.report.sweep_view import sweep_view
    from mismatch_probe.sweep_record import read_sweep

    record = read_sweep(ROOT / "reports" / "sweep-demo")
    view = dataclasses.replace(sweep_view(record), figures=[])
    page, md = html.render_sweep(view, []), markdown.render_sweep(view)
    from_html, from_md = html_table(page, "attribution"), md_table(md, f"## {view.attribution.title}")
    assert len(from_html) == len(record.points)  # the header, then a row per point but the baseline

    def same(row: list[str]) -> list[str]:  # a link by its name; a refused point's note fills the row
        row = [re.sub(r"^\[(\w+)\]\(.*\)$", r"\1", c) for c in row]
        while row and row[-1] == "":
            row.pop()
        return row

    assert [same(r) for r in from_md] == [same(r) for r in from_html]
    ok = [p for p in record.points[1:] if p.status == "ok"]
    shown = {row[0]: row for row in from_html[1:]}
    for p in ok:
        est = p.delta_vs_baseline["k3_kl"]["ratio"][0]
        assert float(shown[p.name.replace("+", " + ")][1].split("x")[0]) == pytest.approx(est, rel=5e-3)


def test_an_moe_run_whose_engine_cannot_return_routing_says_why():
    from mismatch_probe.engines import vllm as vllm_adapter
    from mismatch_probe.record import EngineInfo, RunRecord
    from mismatch_probe.report.run_view import routing_tables

    engine = EngineInfo.model_validate({"engine": "vllm", "routing_unavailable": vllm_adapter.ROUTING_UNAVAILABLE_CPU})
    moe = RunRecord(engine=engine, architecture={"moe": {"routed_experts": 8, "top_k": 2}})
    lead, (table,) = routing_tables(moe)
    assert lead.startswith("not measured: vLLM's CPU build cannot return expert ids") and "Model Runner V2" in lead
    assert table.rows[0].cells == [lead]
    assert routing_tables(RunRecord(engine=engine, architecture={})) == ("", [])  # a dense model: no section


def test_the_model_card_says_whether_the_run_compared_the_routing():
    """The MoE row of the setup says what the run checked, not what MoE models usually allow: the
    routing compared (with its token count), or not, with the engine's reason; the claim older
    records carry in their quirks is dropped."""
    from mismatch_probe.engines import vllm as vllm_adapter
    from mismatch_probe.record import EngineInfo, RunRecord
    from mismatch_probe.report.labels import LEGACY_ROUTING_CLAIM, architecture_rows

    arch = {
        "moe": {"routed_experts": 8, "top_k": 2},
        "quirks": [f"MoE: top-2 of 8 routed experts{LEGACY_ROUTING_CLAIM}"],
    }
    unavailable = EngineInfo.model_validate(
        {"engine": "vllm", "routing_unavailable": vllm_adapter.ROUTING_UNAVAILABLE_CPU}
    )
    rows = dict(architecture_rows(RunRecord(engine=unavailable, architecture=arch)))
    assert rows["model quirks"] == "MoE: top-2 of 8 routed experts"
    assert rows["MoE routing"].startswith("not compared: vLLM's CPU build cannot return expert ids")
    measured = RunRecord(
        engine=EngineInfo.model_validate({"engine": "sglang"}), architecture=arch, routing={"n_tokens": 1234}
    )
    assert (
        dict(architecture_rows(measured))["MoE routing"] == "compared on 1,234 model tokens, engine against reference"
    )
    silent = RunRecord(engine=EngineInfo.model_validate({"engine": "x"}), architecture=arch)
    assert dict(architecture_rows(silent))["MoE routing"] == "not compared: the engine did not return its routing"
    assert "MoE routing" not in dict(architecture_rows(RunRecord(architecture={"quirks": []})))


def test_the_cpu_kind_is_part_of_the_hardware_and_the_setup_names_its_kernels():
    """Two CPU runs on machines of different kinds are different hardware (the comparison groups by
    it), and the setup lists the kernel-selecting instruction sets and the engine's kernels."""
    from mismatch_probe.record import EngineInfo, Environment, RunRecord
    from mismatch_probe.report.labels import gpu_type, setup_rows

    def run(kind, isa):
        env = Environment(cpu_model="EPYC", cpu_kind=kind, cpu_isa=isa, aten_cpu_capability="AVX512")
        kernels = {"library": "vllm._C", "amx": False, "attention": {"CPU_ATTN (vec)": 4}, "gemm": {"oneDNN": 18}}
        engine = EngineInfo.model_validate({"engine": "vllm", "platform": "cpu", "kernels": kernels})
        return RunRecord(environment=env, engine=engine)

    amx, avx = run("AMX", ["amx_tile", "amx_bf16", "avx512f"]), run("AVX-512 BF16", ["avx512f", "avx512_bf16"])
    assert gpu_type(amx) == "CPU: EPYC (AMX)" and gpu_type(avx) == "CPU: EPYC (AVX-512 BF16)"
    rows = dict(setup_rows(avx))
    assert rows["CPU kernels"] == "AVX-512 BF16: avx512f, avx512_bf16; ATen dispatch AVX512"
    assert rows["engine kernels"] == "library: vllm._C; amx: no; attention: CPU_ATTN (vec) x4; gemm: oneDNN x18"
    assert "kernels" not in rows["engine settings"]
    assert gpu_type(RunRecord(environment=Environment(cpu_model="EPYC"))) == "CPU: EPYC"  # recorded before kinds

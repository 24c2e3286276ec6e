"""The HTML report: structure, escaping and self-containment, best/worst marking and grouping in
comparisons, and the ``report`` command's errors. The browser test is test_report_browser.py."""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
from html.parser import HTMLParser

from conftest import cli

from mismatch_probe.analysis.distributions import load
from mismatch_probe.record import parse_record
from mismatch_probe.report.comparison_view import comparison_view, label_runs
from mismatch_probe.report.data import RunData, load_run
from mismatch_probe.report.figures import comparison_figures, run_figures
from mismatch_probe.report.html import render_comparison, render_run
from mismatch_probe.report.run_view import run_view


def page_of(run: RunData) -> str:
    """report.html of a run, as compare writes it."""
    return render_run(run_view(run.record, run.path, run.dist), run_figures(run.record, run.dist))


def comparison_of(runs: list[RunData]) -> str:
    runs = label_runs(runs)
    return render_comparison(comparison_view(runs), comparison_figures(runs))


PAYLOAD = "<script>alert(1)</script>"
ATTR_PAYLOAD = '"><img src=x onerror=alert(2)>'
SVG_URI = "data:image/svg+xml;base64,"


class Elements(HTMLParser):
    """Every start tag with its attributes, as a browser's parser would see them."""

    def __init__(self, html: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def assert_inert_and_self_contained(html: str) -> Elements:
    doc = Elements(html)
    tags = [t for t, _ in doc.tags]
    assert "script" not in tags and "iframe" not in tags and "object" not in tags and "link" not in tags
    for tag, attrs in doc.tags:
        assert not any(name.startswith("on") for name in attrs), (tag, attrs)
        for name in ("src", "href"):
            if name in attrs:  # embedded data or an anchor on the page, never a fetch
                assert attrs[name].startswith(("data:image/png;base64,", SVG_URI, "#")), (tag, attrs[name][:80])
                if attrs[name].startswith(SVG_URI):  # a figure: no script, nothing it could fetch
                    svg = base64.b64decode(attrs[name][len(SVG_URI) :]).decode()
                    assert (
                        "<script" not in svg and "<foreignObject" not in svg and not re.search(r"<[^>]*\son\w+=", svg)
                    )
                    assert set(re.findall(r'href="([a-z]+):', svg)) <= {"data"}
    assert "url(" not in html.split("</style>")[0]  # no fonts or images pulled in by the CSS
    csp = [a for t, a in doc.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in csp[0]["content"]
    return doc


def test_compare_writes_a_report_and_report_rebuilds_it_from_the_directory(bf16_run, tmp_path):
    html = (bf16_run / "report.html").read_text()
    doc = assert_inert_and_self_contained(html)
    for section in ("summary", "setup", "metrics", "figures", "corrections", "worst", "run"):
        assert f'id="{section}"' in html, section
    images = [a for t, a in doc.tags if t == "img"]
    assert len(images) == 7 and all(a["src"].startswith(SVG_URI) for a in images)
    rec = json.loads((bf16_run / "run.json").read_text())
    assert [f["path"] for f in rec["figures"]] == [f"figures/{f['id']}.svg" for f in rec["figures"]]
    text = " ".join(doc.text)
    assert rec["environment"]["cpu_model"] in text and "torch " + rec["environment"]["packages"]["torch"] in text
    assert "NeMo-RL" in text and "H20" in text  # published reference points
    dist = load(bf16_run)
    worst = dist["worst_sequences"]
    assert len(worst) == 12 and worst[0]["tokens"]["text"]  # tokens decoded at compare time
    assert html.count('class="seq"') == 12
    shown = [t for t, a in doc.tags if t == "span" and "title" in a and a["title"].startswith("p_infer")]
    assert len(shown) == sum(sum(w["tokens"]["is_model"]) for w in worst)

    out = tmp_path / "again.html"
    proc = cli("report", str(bf16_run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "report: " in proc.stdout and "MB" in proc.stdout
    strip = re.compile(r"generated [^·]*·")
    assert strip.sub("", out.read_text()) == strip.sub("", html)  # same page, from the directory alone


def test_a_run_without_distributions_is_reported_from_its_table(bf16_run, tmp_path):
    run = tmp_path / "old"
    shutil.copytree(bf16_run, run)
    stored = load_run(run).dist  # distributions.json joined with sequences.parquet
    (run / "distributions.json").unlink()
    (run / "sequences.parquet").unlink()
    recomputed = load_run(run).dist
    assert recomputed["groups"] == stored["groups"] and recomputed["sequences"] == stored["sequences"]
    assert recomputed["worst"] == stored["worst"]
    assert [w["tokens"]["text"] for w in recomputed["worst_sequences"]] == [
        w["tokens"]["text"] for w in stored["worst_sequences"]
    ]


def test_prompt_and_model_text_is_escaped_everywhere(bf16_run):
    run = load_run(bf16_run)
    rec, dist = copy.deepcopy(run.record.to_dict()), copy.deepcopy(run.dist)
    rec["spec"]["name"] = PAYLOAD
    rec["inputs"]["model"] = "/models/" + ATTR_PAYLOAD
    rec["engine"]["quantization"] = PAYLOAD
    rec["reference"]["attn_implementation"] = ATTR_PAYLOAD
    rec["environment"]["cpu_model"] = PAYLOAD
    seq = dist["worst_sequences"][0]
    seq["prompt_id"] = ATTR_PAYLOAD
    seq["tokens"]["text"][0] = PAYLOAD
    seq["tokens"]["text"][-1] = ATTR_PAYLOAD
    html = page_of(RunData(bf16_run, parse_record(rec), dist))
    doc = assert_inert_and_self_contained(html)
    assert PAYLOAD not in html and "<img src=x" not in html
    text = "".join(doc.text)
    assert PAYLOAD in text and ATTR_PAYLOAD in text  # shown as text, not parsed as markup
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 5
    # a run's name is drawn in the comparison's figures (their legends): text there too
    other = load_run(bf16_run)
    compared = comparison_of([RunData(bf16_run, parse_record(rec), dist), other])
    assert_inert_and_self_contained(compared)
    figures = [
        base64.b64decode(src[len(SVG_URI) :]) for src in re.findall(rf'src="({re.escape(SVG_URI)}[^"]+)"', compared)
    ]
    assert any(b"&lt;script&gt;alert(1)&lt;/script&gt;" in svg for svg in figures)


def _fake_gpu_run(run: RunData, name: str, gpu: str, k3: float, tag: str) -> RunData:
    rec = copy.deepcopy(run.record.to_dict())
    rec["spec"]["name"] = name
    rec["environment"]["gpus"] = [{"name": gpu, "memory_gib": 80}]
    rec["engine"]["platform"] = "cuda"
    rec["reference"]["device"] = "cuda"
    rec["engine"]["dtype"] = tag
    rec["metrics"]["k3_kl"] = k3
    return RunData(run.path, parse_record(rec), run.dist)


def test_comparison_groups_by_gpu_and_marks_best_and_worst(bf16_run):
    base = load_run(bf16_run)
    runs = [
        _fake_gpu_run(base, "h100-a", "NVIDIA H100", 2e-4, "bfloat16"),
        _fake_gpu_run(base, "a100", "NVIDIA A100", float("inf"), "bfloat16"),
        _fake_gpu_run(base, "h100-b", "NVIDIA H100", 1e-6, "float32"),
    ]
    runs[1].record.inputs.model = "/elsewhere/model"
    html = comparison_of(runs)
    doc = assert_inert_and_self_contained(html)
    heads = [(a.get("colspan"), t) for t, a in doc.tags if t == "th" and a.get("colspan") in ("1", "2")]
    assert heads == [("2", "th"), ("1", "th")]  # H100 (2 runs) first, as it came first, then A100
    assert re.search(r'colspan="2" class="num">NVIDIA H100<', html) and re.search(
        r'colspan="1" class="num">NVIDIA A100<', html
    )
    row = re.search(r"<code>k3_kl</code></td>(.*?)</tr>", html, re.DOTALL).group(1)
    cells = re.findall(r'<td class="num( best| worst)?">([^<]*)</td>', row)
    # columns are grouped: h100-a, h100-b, then a100
    assert [c[1] for c in cells] == ["2.000e-04", "1.000e-06", "inf"]
    assert [c[0].strip() for c in cells] == ["", "best", "worst"]
    assert "different model" in html
    diff = re.search(r'id="differences".*?</section>', html, re.DOTALL).group(0)
    assert "<code>hardware</code>" in diff and "<code>engine.dtype</code>" in diff and "<code>model</code>" in diff
    assert "<code>sampling.seed</code>" not in diff  # equal in all runs
    assert len([a for t, a in doc.tags if t == "img"]) == 4


def test_report_command_errors_say_what_to_do(bf16_run, tmp_path):
    proc = cli("report", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "not a run directory" in proc.stderr and "Traceback" not in proc.stderr
    unfinished = tmp_path / "unfinished"
    shutil.copytree(bf16_run, unfinished)
    rec = json.loads((unfinished / "run.json").read_text())
    rec.update(status="failed", error="engine worker died")
    (unfinished / "run.json").write_text(json.dumps(rec))
    proc = cli("report", str(unfinished))
    assert proc.returncode == 2 and "failed: engine worker died" in proc.stderr and "resumes" in proc.stderr
    proc = cli("report", str(bf16_run), str(bf16_run), "--out", str(tmp_path))
    assert proc.returncode == 2 and "is a directory" in proc.stderr
    (unfinished / "run.json").write_text("{")
    proc = cli("report", str(unfinished))
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr


def test_a_run_with_no_model_tokens_renders(tmp_path):
    """Every response empty: nothing to plot, nothing to rank, and the page still says so."""
    from mismatch_probe.analysis.distributions import DistributionAccumulator, with_sequences
    from mismatch_probe.analysis.metrics import MetricsAccumulator
    from mismatch_probe.analysis.sequences import SCHEMA

    empty = MetricsAccumulator()
    dist = with_sequences(DistributionAccumulator().finish(), SCHEMA.empty_table())
    dist["worst_sequences"] = []
    record = parse_record(
        {
            "status": "complete",
            "metrics": empty.metrics(),
            "metrics_by_turn": {"first": empty.metrics(), "later": empty.metrics()},
            "corrections": empty.corrections(),
            "breakdowns": empty.breakdowns(),
            "spec": {"name": "empty"},
            "environment": {"gpus": [], "cpu_model": "EPYC"},
        }
    )
    html = page_of(RunData(tmp_path, record, dist))
    assert_inert_and_self_contained(html)
    assert "No model tokens." in html and html.count(SVG_URI) == 7
    assert comparison_of([RunData(tmp_path, record, dist), RunData(tmp_path / "b", record, dist)])


def test_a_token_the_reference_gives_probability_zero_is_reported_not_crashed(bf16_run, tmp_path):
    """p_train = 0 makes K3 and |delta| infinite (run.json stores "inf"); every renderer must cope.
    The vLLM top-p test meets this for real; here one token of a real run is set to -inf and the
    run re-analyzed by resuming it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = tmp_path / "zero"
    shutil.copytree(bf16_run, run)
    shard = run / "tokens.parquet" / "part-00000.parquet"
    table = pq.read_table(shard)
    lt = table.column("logp_train").to_numpy(zero_copy_only=False).copy()
    first_model = int(np.flatnonzero(table.column("is_model_token").to_numpy(zero_copy_only=False))[3])
    lt[first_model] = -np.inf
    table = table.set_column(
        table.schema.get_field_index("logp_train"), "logp_train", pa.array(lt, pa.float32(), mask=np.isnan(lt))
    )
    pq.write_table(table, shard)
    spec = json.loads((run / "run.json").read_text())["spec"]
    proc = cli(
        "compare",
        "--model",
        spec["model"],
        "--prompts",
        spec["prompts"],
        "--out",
        str(run),
        "--engine-dtype",
        "bfloat16",
        "--train-dtype",
        "float32",
        "--max-tokens",
        "48",
        "--n",
        "2",
        "--max-prompts",
        "16",
        "--seed",
        "7",
    )
    assert proc.returncode == 0, proc.stderr
    rec = json.loads((run / "run.json").read_text())
    assert rec["metrics"]["k3_kl"] == "inf" and rec["metrics"]["n_zero_prob_train"] == 1
    html = (run / "report.html").read_text()
    assert "infinite: the reference gives some sampled token probability 0" in html
    assert load(run)["groups"]["first"]["log_ratio_hist"][0] == 1
    proc = cli("report", str(bf16_run), str(run), "--out", str(tmp_path / "c.html"))
    assert proc.returncode == 0, proc.stderr
    row = re.search(r"<code>k3_kl</code></td>(.*?)</tr>", (tmp_path / "c.html").read_text(), re.DOTALL).group(1)
    assert re.findall(r'<td class="num( best| worst)?">([^<]*)</td>', row)[1] == (" worst", "inf")

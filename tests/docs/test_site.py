"""The documentation site builds with ``mkdocs build --strict`` (a broken link or anchor, a page in no
nav, a missing snippet or an API object that does not exist fails it), its generated reference pages
are what the code generates, and README.md stays a page a newcomer reads in five minutes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from required import required, variable

sys.path.insert(0, str(ROOT / "scripts"))
import reference_pages

README = ROOT / "README.md"
HAS_MKDOCS = importlib.util.find_spec("mkdocs") is not None and importlib.util.find_spec("material") is not None
if not HAS_MKDOCS and required("DOCS"):
    raise RuntimeError(f"{variable('DOCS')} is set but mkdocs-material is not installed: pip install -e '.[docs]'")
needs_mkdocs = pytest.mark.skipif(not HAS_MKDOCS, reason="the docs extra is not installed: pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@needs_mkdocs
def test_the_site_builds_strictly_with_every_page(site):
    pages = {p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md")}
    for page in pages:
        name = "" if page.name in ("index", "README") else page.name
        assert (site / page.parent / name / "index.html").is_file(), page


@needs_mkdocs
def test_the_site_shows_every_metric_command_and_api_entry(site):
    from mismatch_probe.analysis.metric_docs import METRIC_DOCS
    from mismatch_probe.cli import app

    metrics = (site / "concepts" / "metrics" / "index.html").read_text()
    for doc in METRIC_DOCS:
        assert f'id="{doc.key}"' in metrics, doc.key
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        assert f"<code>{name}</code>" in cli, name
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("load_run", "sweep", "import_dump", "Monitor"):
        assert re.search(rf'id="mismatch_probe\.[\w.]*\b{name}"', api), name


@pytest.mark.parametrize("page", sorted(reference_pages.PAGES, key=str), ids=lambda p: p.name)
def test_a_generated_reference_page_is_what_the_code_generates(page):
    assert page.read_text() == reference_pages.PAGES[page](), (
        f"{page.relative_to(ROOT)} is out of date: run python scripts/reference_pages.py"
    )


def test_every_metric_of_the_registry_has_its_section_on_the_metrics_page():
    from mismatch_probe.analysis.metric_docs import CORRECTION_DOCS, METRIC_DOCS

    page = (ROOT / "docs" / "concepts" / "metrics.md").read_text()
    for doc in METRIC_DOCS:
        section = page.split(f"## `{doc.key}` {{#{doc.key}}}", 1)
        assert len(section) == 2, f"the metrics page has no section for {doc.key}"
        for field in ("**Formula**", "**Estimates**", "**Bias and sign**", "**Read against**"):
            assert field in section[1].split("\n## ", 1)[0], (doc.key, field)
    for key in CORRECTION_DOCS:
        assert f"| `{key}` |" in page, key


def test_readme_is_short_and_carries_both_fresh_machine_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for marker in ("Set up and run the demo probe", "<!-- ci:test-command -->"):
        after = text.split(marker, 1)[1]
        assert after.lstrip("\n:).").split("```bash\n", 1)[1].split("```", 1)[0].strip(), marker
    assert "mkdocs serve" in text


def test_every_relative_link_of_readme_and_architecture_resolves():
    broken = []
    for page in (README, ROOT / "ARCHITECTURE.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:|^#", target):
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken


def test_a_link_to_a_repository_file_is_checked_and_pointed_at_its_source(caplog):
    """scripts/mkdocs_hooks.py: a page's link out of docs/ to a file that exists becomes the path (or
    the source browser's URL); to a missing file or heading it is a warning, which --strict fails on."""
    import types

    import mkdocs_hooks

    page = types.SimpleNamespace(file=types.SimpleNamespace(src_uri="how-to/page.md"))
    config = {"docs_dir": str(ROOT / "docs"), "extra": {}}
    text = (
        "[the demo spec](../../probes/demo.toml), [gone](../../probes/nope.toml), "
        "[arch](../../ARCHITECTURE.md#stages), [no heading](../../ARCHITECTURE.md#nope), "
        "[a page](../settings.md), `[code](../../nope.py)`"
    )
    with caplog.at_level("WARNING"):
        out = mkdocs_hooks.on_page_markdown(text, page, config, None)
    assert out.startswith(
        "the demo spec (`probes/demo.toml`), [gone](../../probes/nope.toml), arch (`ARCHITECTURE.md`)"
    )
    assert "[a page](../settings.md)" in out and "`[code](../../nope.py)`" in out
    warned = sorted(r.getMessage() for r in caplog.records)
    assert len(warned) == 2 and "#nope does not exist" in warned[0] and "probes/nope.toml" in warned[1]
    config["extra"] = {"source_url": "https://example.org/tree/main/"}
    out = mkdocs_hooks.on_page_markdown(text, page, config, None)
    assert out.startswith("[the demo spec](https://example.org/tree/main/probes/demo.toml)")

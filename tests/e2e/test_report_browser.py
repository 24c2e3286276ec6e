"""The HTML report in a real headless Chromium: it loads with no console errors and no network
request, draws every figure, is not blank, and a prompt carrying markup shows as text and never
runs. Needs Debian's ``chromium`` (``.ci/run`` installs it) and playwright (the ``test`` extra).

Set ``MISMATCH_PROBE_SCREENSHOTS=DIR`` to keep the screenshots (README's and the docs' come from here:
``MISMATCH_PROBE_SCREENSHOTS=docs/images``).
Set ``MISMATCH_PROBE_REQUIRE_BROWSER=1`` (CI does) to fail instead of skipping without Chromium.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import DENSE, ROOT, cli
from required import unavailable

pytestmark = pytest.mark.browser

PAYLOAD = "<script>alert(1)</script>"
ID_PAYLOAD = "<img src=x onerror=alert(2)>"
CHROMIUM_ARGS = [  # as root in a sandbox with a closed network (see the machine notes)
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
EXAMPLES = ROOT / "reports" / "example", ROOT / "reports" / "example-fp32"
SWEEP = ROOT / "reports" / "sweep-demo" / "sweep.html"


def _unavailable(reason: str):
    unavailable("BROWSER", reason)


@pytest.fixture(scope="module")
def browser():
    chromium = (
        os.environ.get("MISMATCH_PROBE_CHROMIUM")
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
        or shutil.which("google-chrome")
    )
    if not chromium:
        _unavailable("Chromium is not installed (Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


class LoadedPage:
    def __init__(self, browser, path: Path, height: int = 1000):
        self.page = browser.new_page(viewport={"width": 1400, "height": height})
        self.problems: list[str] = []
        self.dialogs: list[str] = []
        self.page.on(
            "console",
            lambda m: self.problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None,
        )
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on(
            "request",
            lambda r: self.problems.append(f"request: {r.url}") if not r.url.startswith(("file:", "data:")) else None,
        )
        self.page.goto(path.as_uri(), wait_until="load")

    def check(self, n_figures: int) -> bytes:
        """Assert the page is healthy; return a full-page screenshot (PNG)."""
        assert self.problems == [] and self.dialogs == []
        assert self.page.evaluate("document.scripts.length") == 0
        drawn = self.page.evaluate("Array.from(document.images).filter(i => i.complete && i.naturalWidth > 300).length")
        assert drawn == n_figures
        png = self.page.screenshot(full_page=True)
        assert_not_blank(png)
        return png


def assert_not_blank(png: bytes) -> None:
    from PIL import Image, ImageStat

    image = Image.open(io.BytesIO(png)).convert("L")
    assert image.width >= 1000 and image.height >= 1000
    stat = ImageStat.Stat(image)
    assert stat.stddev[0] > 20  # text, tables and figures, not one flat colour
    dark = sum(image.histogram()[:128]) / (image.width * image.height)
    assert dark > 0.01  # some of it is ink


def keep(name: str, png: bytes) -> None:
    d = os.environ.get("MISMATCH_PROBE_SCREENSHOTS")
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / name).write_bytes(png)


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory) -> Path:
    """A real run whose prompts carry markup in their text and in their id."""
    tmp = tmp_path_factory.mktemp("hostile")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(p)
            for p in [
                {"id": ID_PAYLOAD, "messages": [{"role": "user", "content": f"{PAYLOAD} What is two plus two?"}]},
                {"id": "plain", "messages": [{"role": "user", "content": f"Say {PAYLOAD} back."}]},
            ]
        )
        + "\n"
    )
    out = tmp / "run"
    proc = cli(
        "compare",
        "--model",
        str(DENSE),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--engine",
        "hf",
        "--engine-dtype",
        "bfloat16",
        "--train-dtype",
        "float32",
        "--max-tokens",
        "24",
        "--n",
        "2",
        "--seed",
        "3",
    )
    assert proc.returncode == 0, proc.stderr
    return out


def test_report_loads_cleanly_and_markup_in_prompts_stays_text(browser, hostile_run):
    page = LoadedPage(browser, hostile_run / "report.html")
    keep("hostile-report.png", page.check(n_figures=7))
    worst = page.page.inner_text("#worst")
    assert PAYLOAD in worst and ID_PAYLOAD in worst
    assert page.page.evaluate("document.querySelectorAll('#worst img').length") == 0
    # hovering a generated token tells both probabilities
    title = page.page.get_attribute("#worst .tokens span.wt", "title")
    assert title.startswith("p_infer ") and " · p_train " in title


def test_comparison_loads_cleanly(browser, hostile_run, bf16_run, tmp_path):
    out = tmp_path / "compare.html"
    proc = cli("report", str(bf16_run), str(hostile_run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    page = LoadedPage(browser, out)
    page.check(n_figures=4)
    assert page.page.locator("td.best").count() > 0 and page.page.locator("td.worst").count() > 0
    assert "different prompts" in page.page.inner_text("#runs")


@pytest.mark.skipif(
    not all((p / "run.json").is_file() for p in EXAMPLES), reason="the committed example runs are absent"
)
def test_committed_examples_render(browser, tmp_path):
    """The committed vLLM runs (engine bf16 and fp32 against an fp32 reference) and the committed
    demo sweep's page; the screenshots of README and the docs are taken here."""
    report, comparison = tmp_path / "report.html", tmp_path / "compare.html"
    for args in (
        (str(EXAMPLES[0]), "--out", str(report)),
        (str(EXAMPLES[0]), str(EXAMPLES[1]), "--out", str(comparison)),
    ):
        proc = cli("report", *args)
        assert proc.returncode == 0, proc.stderr
    page = LoadedPage(browser, report, height=1500)
    page.check(n_figures=7)
    keep("example-report.png", page.page.screenshot())
    keep("example-figures.png", page.page.locator("#figures").screenshot())
    page = LoadedPage(browser, comparison, height=1500)
    page.check(n_figures=4)
    keep("example-compare.png", page.page.screenshot())
    page = LoadedPage(browser, SWEEP, height=1100)
    page.check(n_figures=3)  # the page as committed (the sweep tests render it anew)
    keep("sweep-demo.png", page.page.screenshot())

"""One page per RL framework (docs/frameworks/): each says which engine versions the framework pins and
maps its settings to probe keys, and every probe key and flag in that map exists."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT
from doc_blocks import cli_options

FRAMEWORKS = ("verl", "slime", "nemo-rl", "openrlhf", "trl", "ms-swift", "prime-rl", "skyrl")
SECTIONS = (
    "## Engine versions it pins",
    "## Its settings, as probe keys",
    "## Probe its rollout server",
    "## Import its dumps",
    "## The monitor in its training loop",
)


def section(text: str, heading: str) -> str:
    return text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]


@pytest.fixture(scope="module")
def probe_names() -> tuple[set[str], set[str]]:
    from mismatch_probe.config.spec import spec_settings

    return set(spec_settings()), cli_options()["compare"] - {"--help"}  # a flag the map could name


def test_every_framework_has_a_page_in_the_index_and_the_nav():
    index = (ROOT / "docs" / "frameworks" / "README.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in FRAMEWORKS:
        assert (ROOT / "docs" / "frameworks" / f"{name}.md").is_file(), name
        assert f"]({name}.md)" in index and f"frameworks/{name}.md" in nav, name


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_framework_page_pins_versions_and_maps_settings_to_keys_that_exist(name, probe_names):
    keys, flags = probe_names
    text = (ROOT / "docs" / "frameworks" / f"{name}.md").read_text()
    for heading in SECTIONS:
        assert heading + "\n" in text, f"{name}.md lacks {heading!r}"
    versions = section(text, SECTIONS[0])
    assert re.search(r"\| (vLLM|SGLang)[^|]* \|", versions) and re.search(r"\d+\.\d+", versions), name
    rows = [r for r in section(text, SECTIONS[1]).splitlines() if r.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split(" | ")]
    column = next(i for i, c in enumerate(header) if c.startswith("probe key"))
    mapped, broken = 0, []
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
        for token in re.findall(r"`([^`]+)`", cells[column] if column < len(cells) else ""):
            word = token.split()[0]
            if re.fullmatch(r"(engine|sampling|reference|corrections|sync)\.[a-z0-9_]+", word):
                mapped += 1
                if word not in keys:
                    broken.append(f"no setting {word}")
            elif word.startswith("--"):
                broken += [f"compare has no {flag}" for flag in word.split("/") if flag not in flags]
    assert mapped >= 10, f"{name}.md maps only {mapped} settings"
    assert not broken, f"{name}.md: {broken}"


INIT_EXAMPLE = re.compile(r"<!-- init-example: (\S+) -->.*?The risks it finds in that example: (.*?)\. The", re.DOTALL)


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_framework_page_shows_init_on_its_example_with_the_risks_init_finds(name):
    """The page's `init` example names one of the framework's own configs under tests/frameworks/configs,
    and the risks the page says init finds in it are the ones it finds."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "frameworks"))
    from framework_checks import read

    from mismatch_probe.frameworks.risks import find_risks

    text = (ROOT / "docs" / "frameworks" / f"{name}.md").read_text()
    m = INIT_EXAMPLE.search(section(text, SECTIONS[2]))
    assert m, f"{name}.md: no init example in {SECTIONS[2]!r}"
    assert f"mismatch-probe init {name} " in m[0]
    titles = "; ".join(r.title for r in find_risks(read(name, m[1]))) or "none known"
    assert m[2] == titles, f"{name}.md says {m[2]!r}; init finds {titles!r}"

"""Text that points at code points at code that exists: every ``path.py: name`` in ARCHITECTURE.md,
README.md, docs/ and the package's own comments and docstrings names a function, class or constant
defined in that file, so a rename cannot leave the map behind."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

REFERENCE = re.compile(r"([a-z_][a-z0-9_/]*\.py): ([A-Za-z_][A-Za-z0-9_]*)")
CODE_DIRS = ("mismatch_probe", "tests", "scripts", "benchmarks", "examples")
# the top directories of the engines' sources (sglang's as ``srt/...`` too), ms-swift's and TRL's: not this repository's
ENGINE_SOURCES = ("vllm", "sglang", "srt", "swift", "trl")


def defined_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_path_and_name_reference_resolves():
    sources = {p: defined_names(p) for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")}
    texts = [ROOT / "ARCHITECTURE.md", ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    texts += list((ROOT / "mismatch_probe").rglob("*.py"))
    checked, broken = 0, []
    for text in texts:
        for path, name in REFERENCE.findall(text.read_text()):
            if path.split("/")[0] in ENGINE_SOURCES:
                continue  # a file of an engine's own sources, cited where its behaviour is relied on
            files = [p for p in sources if p.as_posix().endswith("/" + path)]
            checked += 1
            if not files:
                broken.append(f"{text.relative_to(ROOT)}: {path} is no file")
            elif not any(name in sources[p] for p in files):
                broken.append(f"{text.relative_to(ROOT)}: {path} defines no {name}")
    assert checked > 20  # the scan sees the references
    assert not broken, "\n".join(broken)

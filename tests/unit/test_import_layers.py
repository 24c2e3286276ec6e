"""The import rule of ARCHITECTURE.md: a module imports only from its own layer's package or lower layers.

Read from the source with ``ast`` (no imports executed), so it also sees imports inside functions
(the lazy ones that keep ``import mismatch_probe`` light). A lower layer importing a higher one fails
here, naming the file, the line and both layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mismatch_probe"

# Lowest first. A unit is a top-level module or subpackage of mismatch_probe; units in the same layer
# may not import each other (report and gate are siblings, as are rollout and reference).
LAYERS: list[set[str]] = [
    {"errors", "numbers", "text", "version"},
    {"files", "ray_cluster"},
    {"config", "record", "environment"},
    {"modeling", "table", "sweep_record", "timeline_record"},
    {"engines"},
    {"rollout", "reference", "dumps"},
    {"analysis", "frameworks"},
    {"report", "gate"},
    {"pipeline", "api"},
    {"sweeps", "importing"},
    {"timeline"},
    {"cli", "__init__"},
    {"__main__"},
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_units(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "mismatch_probe":
                continue
            if len(parts) > 1:
                found.append((node.lineno, parts[1]))
            else:  # from mismatch_probe import X: X is a unit, or a name defined in __init__
                found.extend((node.lineno, a.name if a.name in LAYER_OF else "__init__") for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"line {node.lineno}: relative import; the layer test reads absolute imports only")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "mismatch_probe" and len(parts) > 1:
                    found.append((node.lineno, parts[1]))
    return found


def violations(path: Path, tree: ast.AST) -> list[str]:
    unit = unit_of(path)
    if unit not in LAYER_OF:
        return [f"{path.relative_to(PACKAGE.parent)}: {unit!r} is in no layer; add it to LAYERS and ARCHITECTURE.md"]
    bad = []
    for line, target in imported_units(tree):
        if target == unit or (target == "__init__" and unit != "__init__"):
            continue  # own package; __version__ from the package root is allowed everywhere
        if target not in LAYER_OF:
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports unknown unit {target!r}")
        elif LAYER_OF[target] >= LAYER_OF[unit]:
            bad.append(
                f"{path.relative_to(PACKAGE.parent)}:{line}: {unit} (layer {LAYER_OF[unit]}) imports "
                f"{target} (layer {LAYER_OF[target]}); a module may import only lower layers"
            )
    return bad


def test_no_module_imports_a_higher_or_sibling_layer():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        problems += violations(path, ast.parse(path.read_text(), str(path)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("where", "source", "expected"),
    [
        (
            "analysis/metrics.py",
            "from mismatch_probe.report.html import render_run",
            "analysis (layer 6) imports report",
        ),
        (
            "config/spec.py",
            "def f():\n    from mismatch_probe.engines import get_entry",
            "config (layer 2) imports engines",
        ),
        ("report/html.py", "from mismatch_probe.gate.checks import evaluate", "report (layer 7) imports gate"),
        ("analysis/metrics.py", "import mismatch_probe.pipeline", "analysis (layer 6) imports pipeline"),
        ("rollout/prompts.py", "from mismatch_probe import reference", "rollout (layer 5) imports reference"),
    ],
)
def test_the_rule_fails_when_a_lower_layer_imports_a_higher_one(where, source, expected):
    found = violations(PACKAGE / where, ast.parse(source))
    assert len(found) == 1 and expected in found[0], found


def test_the_rule_allows_lower_layers_and_the_own_package():
    source = "from mismatch_probe.errors import ConfigError\nfrom mismatch_probe.analysis.metrics import x\n"
    assert violations(PACKAGE / "analysis" / "distributions.py", ast.parse(source)) == []


def module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports (lazy ones too): a name
    imported from a package is the submodule of that name when there is one, else the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mismatch_probe":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in modules}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_anywhere_in_the_package():
    graph = module_graph()
    assert len(graph) > 50 and "mismatch_probe.pipeline.stages" in graph["mismatch_probe.pipeline.commands"]
    assert cycles(graph) == []


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

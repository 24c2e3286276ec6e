"""Survey the engine API of every vLLM and SGLang release in RELEASES into mismatch_probe/engines/api_surface/.

    python scripts/engine_api_surface.py                      # download what is not cached, write both files
    python scripts/engine_api_surface.py --cache-dir DIR      # where the releases' sources are kept
    python scripts/engine_api_surface.py --engine sglang      # one engine
    python scripts/engine_api_surface.py --docs               # only the table of docs/concepts/engines.md, from the committed files

Each release is downloaded once with pip, without its dependencies (the wheel: vLLM's sdist needs
its build dependencies just to be downloaded), and only its own ``.py`` files are kept in the
cache; they are read with ``ast``, never imported. The surface keeps, per kind of name
(``mismatch_probe/engines/api_uses.py: KINDS``), each name with the releases that have it, as
spans of the survey's releases (``"0.10.2..0.32.0"``). Kinds read from a fixed place (``EngineArgs``
fields, ``Engine`` methods, ...) keep every name; the others (imported names, environment
variables, ``meta_info`` keys) keep the names the adapters use. Not run in CI (it needs the
network); tests/unit/test_engine_api_surface.py reads the committed files.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mismatch_probe.engines.api_uses import (
    DOCS_BEGIN,
    DOCS_END,
    KINDS,
    SURFACE_DIR,
    uses,
    version_key,
)

PAGE = ROOT / "docs" / "concepts" / "engines.md"  # its "Supported engine versions" table

# The releases surveyed: every release an RL framework pins (docs/frameworks/*.md, "Engine versions
# it pins"), the last of every other minor release in between, and the ones mismatch-probe runs.
# vLLM 0.21.0 is left out: PyPI has no x86-64 wheel of it.
RELEASES = {
    "vllm": [
        "0.8.5",
        "0.9.2",
        "0.10.0",
        "0.10.1",
        "0.10.1.1",
        "0.10.2",
        "0.11.0",
        "0.11.2",
        "0.12.0",
        "0.13.0",
        "0.14.1",
        "0.15.1",
        "0.16.0",
        "0.17.0",
        "0.17.1",
        "0.18.1",
        "0.19.1",
        "0.20.2",
        "0.22.1",
        "0.23.0",
        "0.24.0",
        "0.25.1",
        "0.26.0",
        "0.27.1",
        "0.28.0",
        "0.29.0",
        "0.30.0",
        "0.31.0",
        "0.32.0",
        "0.33.0",
    ],
    "sglang": [
        "0.5.2",
        "0.5.3",
        "0.5.3.post3",
        "0.5.4.post3",
        "0.5.5.post3",
        "0.5.6",
        "0.5.6.post2",
        "0.5.7",
        "0.5.8.post1",
        "0.5.9",
        "0.5.10.post1",
        "0.5.11",
        "0.5.12",
        "0.5.12.post1",
        "0.5.13.post1",
        "0.5.14",
        "0.5.15",
        "0.5.15.post1",
        "0.5.16",
        "0.5.17",
        "0.5.18",
        "0.5.19",
        "0.5.20",
        "0.5.21",
        "0.5.22",
        "0.5.23",
    ],
}
# the wheels of a Linux x86-64 machine with CPython 3.12, whatever machine runs the survey
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def fetch(package: str, version: str, cache: Path) -> Path:
    """The release's own .py files, downloaded once into ``cache/<package>-<version>/``."""
    dest = cache / f"{package}-{version}"
    if (dest / ".complete").exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"{package}=={version}", "--no-deps", "--no-cache-dir"]
        cmd += ["--only-binary", ":all:", "--python-version", "3.12", "-d", tmp, "-q"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        shutil.rmtree(dest, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(dest, [n for n in z.namelist() if n.startswith(f"{package}/") and n.endswith(".py")])
    (dest / ".complete").write_text(f"{wheel.name}\n")  # the marker goes last: a killed fetch starts again
    return dest


# ---- reading a release ------------------------------------------------------------------------------


def parse(root: Path, *candidates: str) -> ast.Module | None:
    for rel in candidates:
        if (root / rel).exists():
            return ast.parse((root / rel).read_text(errors="replace"))
    return None


def find_class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def fields(cls: ast.ClassDef | None) -> set[str]:
    """A dataclass's (or struct's) annotated fields."""
    body = cls.body if cls else []
    return {n.target.id for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def members(cls: ast.ClassDef | None) -> set[str]:
    """Methods, annotated fields and what ``__init__`` assigns to ``self``."""
    out = fields(cls)
    for node in cls.body if cls else []:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out.add(node.name)
            if node.name == "__init__":
                for sub in ast.walk(node):
                    target = sub.target if isinstance(sub, ast.AnnAssign) else None
                    targets = sub.targets if isinstance(sub, ast.Assign) else [target] if target else []
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            out.add(t.attr)
    return {n for n in out if not n.startswith("_")}


def parameters(func: ast.FunctionDef | None) -> set[str]:
    if func is None:
        return set()
    a = func.args
    return {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs] if p.arg != "self"}


def method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    return next((n for n in (cls.body if cls else []) if isinstance(n, ast.FunctionDef) and n.name == name), None)


def strings(node: ast.AST | None) -> set[str]:
    return (
        {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)} if node else set()
    )


def module_names(root: Path, module: str) -> set[str] | None:
    """The names a module defines or imports at its top level (None: no such module)."""
    rel = module.replace(".", "/")
    tree = parse(root, f"{rel}.py", f"{rel}/__init__.py")
    if tree is None:
        return None
    is_package = not (root / f"{rel}.py").exists()
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.ImportFrom) and [a.name for a in node.names] == ["*"]:
            # a package that re-exports a module whole (sglang/srt/utils/__init__.py: from .common import *)
            base = module.split(".") if is_package else module.split(".")[:-1]
            source = ".".join([*base[: len(base) - node.level + 1], *([node.module] if node.module else [])])
            out |= module_names(root, source if node.level else node.module or "") or set()
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING blocks and optional imports
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    out.update(a.asname or a.name for a in sub.names)
    if "__getattr__" in out:  # a lazy package (vllm/__init__.py): the names it maps
        out |= strings(tree)
    return out


def sources(root: Path, package: str) -> Iterator[str]:
    for path in sorted((root / package).rglob("*.py")):
        yield path.read_text(errors="replace")


def declared(engine: str, kind: str) -> set[str]:
    return {u.name for u in uses(engine) if u.kind == kind}


def symbols(engine: str, root: Path) -> set[str]:
    out = set()
    for name in declared(engine, "symbols"):
        module, _, attr = name.partition(":")
        if attr in (module_names(root, module) or ()):
            out.add(name)
    return out


def literals(engine: str, kind: str, root: Path, package: str) -> set[str]:
    """The declared names of ``kind`` that appear as string literals in the release's sources."""
    wanted = declared(engine, kind)
    found = set()
    for text in sources(root, package):
        found |= {w for w in wanted - found if f'"{w}"' in text or f"'{w}'" in text}
    return found


def vllm_release(root: Path) -> dict[str, set[str]]:
    outputs = parse(root, "vllm/outputs.py")
    worker = find_class(parse(root, "vllm/v1/worker/gpu_worker.py"), "Worker")
    runner = find_class(parse(root, "vllm/v1/worker/gpu_model_runner.py"), "GPUModelRunner")
    # the worker forwards reload_weights to its model runner
    reload_params = parameters(method(worker, "reload_weights")) | parameters(method(runner, "reload_weights"))
    modes: set[str] = set()
    for path in [root / "vllm/config.py", *sorted((root / "vllm/config").glob("*.py"))]:
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "LogprobsMode":
                modes |= {s for s in strings(node) if s.endswith(("logprobs", "logits"))}
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "LogprobsMode" for t in targets):
                    modes |= strings(node.value)
    return {
        "engine_args": fields(find_class(parse(root, "vllm/engine/arg_utils.py"), "EngineArgs")),
        "sampling_params": fields(find_class(parse(root, "vllm/sampling_params.py"), "SamplingParams")),
        "llm": members(find_class(parse(root, "vllm/entrypoints/llm.py"), "LLM")),
        "request_output": members(find_class(outputs, "RequestOutput")),
        "completion_output": members(find_class(outputs, "CompletionOutput")),
        "logprobs_modes": modes,
        # reload_weights only where it takes a checkpoint's path (the adapter passes one)
        "worker": {m for m in members(worker) if m != "reload_weights" or "weights_path" in reload_params},
        # read by vllm/envs.py or, for some (VLLM_BATCH_INVARIANT before 0.19), by the module that acts on it
        "envs": literals("vllm", "envs", root, "vllm"),
        "symbols": symbols("vllm", root),
    }


def sglang_release(root: Path) -> dict[str, set[str]]:
    server_args = find_class(parse(root, "sglang/srt/server_args.py"), "ServerArgs")
    engine = find_class(parse(root, "sglang/srt/entrypoints/engine.py"), "Engine")
    sampling = find_class(parse(root, "sglang/srt/sampling/sampling_params.py"), "SamplingParams")
    http = parse(root, "sglang/srt/entrypoints/http_server.py")
    routes = set()
    for node in ast.walk(http) if http else ():
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for deco in node.decorator_list:
                route = isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                if route and deco.func.attr in ("get", "post", "put", "delete", "api_route"):
                    routes |= {s for s in strings(deco) if s.startswith("/")}
    server_fields = fields(server_args)
    # from 0.5.20 ServerArgs is assembled from namespaces, one class per file of arg_groups/fields/
    for path in sorted((root / "sglang/srt/arg_groups/fields").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                server_fields |= fields(node)
    return {
        "server_args": server_fields,
        "engine": members(engine),
        "generate_args": parameters(method(engine, "generate")),
        # __init__'s parameters; from 0.5.15 a msgspec struct's fields
        "sampling_params": parameters(method(sampling, "__init__")) | fields(sampling),
        "meta_info": literals("sglang", "meta_info", root, "sglang/srt"),
        "envs": literals("sglang", "envs", root, "sglang"),
        "routes": routes,
        "symbols": symbols("sglang", root),
    }


READERS = {"vllm": vllm_release, "sglang": sglang_release}


def spans(present: list[str], releases: list[str]) -> str:
    """``present`` (a subset of ``releases``, in order) as ``first..last`` spans of consecutive releases."""
    out, run = [], []
    for r in releases:
        if r in present:
            run.append(r)
        elif run:
            out.append(run)
            run = []
    if run:
        out.append(run)
    return ",".join(f"{r[0]}..{r[-1]}" if len(r) > 1 else r[0] for r in out)


def survey(engine: str, cache: Path) -> dict:
    releases = sorted(RELEASES[engine], key=version_key)
    per_release = {r: READERS[engine](fetch(engine, r, cache)) for r in releases}
    kinds: dict[str, dict[str, str]] = {}
    for kind in KINDS[engine]:
        names = sorted(set().union(*(per_release[r].get(kind, set()) for r in releases)))
        kinds[kind] = {n: spans([r for r in releases if n in per_release[r][kind]], releases) for n in names}
    return {
        "generated_by": "scripts/engine_api_surface.py",
        "engine": engine,
        "kinds_read": KINDS[engine],
        "releases": releases,
        "kinds": kinds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "mismatch-probe-engine-api")
    parser.add_argument("--engine", choices=sorted(RELEASES), action="append")
    parser.add_argument("--docs", action="store_true", help="only rewrite the docs table")
    args = parser.parse_args()
    SURFACE_DIR.mkdir(parents=True, exist_ok=True)
    for engine in [] if args.docs else args.engine or sorted(RELEASES):
        out = SURFACE_DIR / f"{engine}.json"
        out.write_text(json.dumps(survey(engine, args.cache_dir), indent=1) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
    write_docs()


def write_docs() -> None:
    """The table of docs/concepts/engines.md between its markers, from the committed surface files
    (a fresh process: the files just written are read, not a cached copy)."""
    code = "from mismatch_probe.engines.api_uses import versions_section; print(versions_section(), end='')"
    block = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    text = PAGE.read_text()
    head, _, rest = text.partition(DOCS_BEGIN)
    _, _, tail = rest.partition(DOCS_END)
    PAGE.write_text(head + block + tail)
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

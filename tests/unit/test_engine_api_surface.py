"""The engine API the adapters use (engines/api_uses.py) against the releases' surface
(engines/api_surface/*.json, scripts/engine_api_surface.py) and against the adapters' own code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch_probe.engines import api_uses
from mismatch_probe.engines.api_uses import SUPPORTED, uses, version_key, version_warning

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ROOT / "mismatch_probe" / "engines"
# each in-process adapter's modules, and the package it imports
ADAPTER_MODULES = {
    "vllm": ("vllm.py", "vllm_args.py", "vllm_sync.py", "vllm_plugin.py"),
    "sglang": ("sglang.py", "sglang_args.py", "sglang_sync.py", "sglang_logprobs.py"),
}
ARG_KIND = {"vllm": "engine_args", "sglang": "server_args"}
# the names the adapters build their engine's arguments in
ARG_HOLDERS = {"args", "defaults", "requested"}


def declared(engine: str, kind: str) -> set[str]:
    return {u.name for u in uses(engine) if u.kind == kind}


def inside(engine: str, release: str) -> bool:
    lo, hi = SUPPORTED[engine]
    return version_key(lo) <= version_key(release) <= version_key(hi)


@pytest.mark.parametrize("engine", sorted(SUPPORTED))
def test_the_declared_range_is_the_derived_one(engine):
    assert SUPPORTED[engine] == api_uses.derive_supported(engine)


@pytest.mark.parametrize("engine", sorted(SUPPORTED))
def test_no_release_in_the_range_lacks_an_ungated_name(engine):
    releases = api_uses.surface(engine)["releases"]
    lacking = {r: [f"{u.kind}:{u.name}" for u in api_uses.missing(engine, r)] for r in releases if inside(engine, r)}
    assert not {r: names for r, names in lacking.items() if names}, (
        "an adapter uses these names ungated in supported releases that lack them: gate them (needed_for, "
        "fallback, since) or narrow SUPPORTED"
    )


@pytest.mark.parametrize("engine", sorted(SUPPORTED))
def test_every_declared_name_was_surveyed(engine):
    """A name no surveyed release has is a new use the surface has not caught up with (or a typo)."""
    kinds = api_uses.surface(engine)["kinds"]
    unknown = [f"{u.kind}:{u.name}" for u in uses(engine) if u.name not in kinds.get(u.kind, {})]
    assert not unknown, "re-run python scripts/engine_api_surface.py (or fix the name)"
    assert {u.kind for u in uses(engine)} <= set(api_uses.KINDS[engine])


def test_the_survey_covers_the_pinned_releases():
    releases = {e: set(api_uses.surface(e)["releases"]) for e in SUPPORTED}
    # docs/frameworks/*.md, "Engine versions it pins"
    pinned_vllm = "0.8.5 0.9.2 0.10.0 0.10.1 0.10.2 0.11.0 0.12.0 0.17.0 0.23.0 0.24.0 0.25.1 0.26.0 0.27.1 0.32.0"
    assert set(pinned_vllm.split()) <= releases["vllm"]
    assert {"0.5.2", "0.5.6", "0.5.6.post2", "0.5.12", "0.5.12.post1", "0.5.15.post1", "0.5.23"} <= releases["sglang"]


def test_version_order():
    assert version_key("0.5.6.post2") > version_key("0.5.6") > version_key("0.5.5.post3")
    assert version_key("0.10.1.1") > version_key("0.10.1")
    assert version_key("0.32.0+cpu") == version_key("0.32.0") == version_key("0.32")
    assert version_key("0.33.0rc1") == version_key("0.33.0")


def test_a_release_outside_the_range_is_named_with_what_it_lacks():
    line = version_warning("vllm", "0.9.2")
    assert line is not None and "\n" not in line
    assert line.startswith("vLLM 0.9.2 is outside the versions mismatch-probe's vllm adapter supports (")
    assert "missing" in line and "flat_logprobs" in line and "logprobs_mode" in line
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in (version_warning("sglang", "0.5.2") or "")


def test_a_release_inside_the_range_has_no_warning():
    lo, hi = SUPPORTED["vllm"]
    for version in (lo, hi, "0.32.0+cpu", "0.32.0"):
        assert version_warning("vllm", version) is None
    assert version_warning("hf", "5.0") is None and version_warning("vllm", "") is None


def test_a_release_never_surveyed_says_so():
    line = version_warning("vllm", "0.7.3")
    assert line is not None and "not surveyed" in line and SUPPORTED["vllm"][0] in line
    assert "not surveyed" in (version_warning("sglang", "0.99.0") or "")


def test_the_docs_table_is_the_surface():
    page = (ROOT / "docs" / "concepts" / "engines.md").read_text()
    start, end = page.index(api_uses.DOCS_BEGIN), page.index(api_uses.DOCS_END) + len(api_uses.DOCS_END)
    assert page[start:end] == api_uses.versions_section(), "run python scripts/engine_api_surface.py --docs"


def test_engines_command_prints_the_ranges():
    from mismatch_probe.cli import app

    result = CliRunner().invoke(app, ["engines"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for engine, (lo, hi) in SUPPORTED.items():
        assert f"{api_uses.ENGINE_NAMES[engine]} {lo}–{hi}" in result.output


# ---- the declaration against the adapters' code --------------------------------------------------


def _dict_keys(node: ast.AST) -> set[str]:
    return {
        k.value
        for d in ast.walk(node)
        if isinstance(d, ast.Dict)
        for k in d.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }


def _holder(node: ast.AST) -> str | None:
    """``args`` for ``args``, ``requested`` for ``self.requested``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _literal_key(node: ast.Subscript) -> str | None:
    return node.slice.value if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str) else None


def used_in_code(engine: str) -> dict[str, set[str]]:
    """What the adapter's modules pass to, call on and import from the engine, by kind."""
    found: dict[str, set[str]] = {}

    def add(kind: str, *names: str) -> None:
        found.setdefault(kind, set()).update(names)

    handle = {"vllm": "llm", "sglang": "engine"}[engine]
    for module in ADAPTER_MODULES[engine]:
        tree = ast.parse((ENGINES / module).read_text())
        for func in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            local = {  # name -> value, for the ** of a call
                t.id: n.value
                for n in ast.walk(func)
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            for n in ast.walk(func):
                if isinstance(n, ast.Return) and func.name in ("engine_args", "server_args") and n.value:
                    add(ARG_KIND[engine], *_dict_keys(n.value))
                if not isinstance(n, ast.Call):
                    continue
                f = n.func
                spread = {k for kw in n.keywords if kw.arg is None for k in _dict_keys(kw.value)}
                spread |= {
                    k
                    for kw in n.keywords
                    if kw.arg is None and isinstance(kw.value, ast.Name) and kw.value.id in local
                    for k in _dict_keys(local[kw.value.id])
                }
                if isinstance(f, ast.Name) and f.id == "SamplingParams":
                    add("sampling_params", *(kw.arg for kw in n.keywords if kw.arg), *spread)
                if (
                    isinstance(f, ast.Attribute)
                    and _holder(f.value) in (handle, "engine")
                    and not f.attr.startswith("_")
                ):
                    if engine == "sglang" or _holder(f.value) == handle:
                        add("llm" if engine == "vllm" else "engine", f.attr)
                    if engine == "sglang" and f.attr == "generate":
                        add("generate_args", *(kw.arg for kw in n.keywords if kw.arg), *spread)
                        for kw in n.keywords:
                            if kw.arg == "sampling_params":
                                add("sampling_params", *_dict_keys(kw.value))
                if isinstance(f, ast.Attribute) and f.attr == "collective_rpc" and n.args:
                    rpc = n.args[0]
                    if isinstance(rpc, ast.Constant) and not str(rpc.value).startswith("probe_"):
                        add("worker", rpc.value)
                if isinstance(f, ast.Attribute) and f.attr == "get" and n.args and isinstance(n.args[0], ast.Constant):
                    owner = f.value
                    is_meta = (isinstance(owner, ast.Name) and owner.id == "meta") or (
                        isinstance(owner, ast.Subscript) and _literal_key(owner) == "meta_info"
                    )
                    if engine == "sglang" and is_meta:
                        add("meta_info", n.args[0].value)
            if engine == "sglang" and func.name == "generate" and "params" in local:
                add("sampling_params", *_dict_keys(local["params"]))
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == engine:
                add("symbols", *(f"{n.module}:{a.name}" for a in n.names))
            attribute = isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == engine
            if attribute and not n.attr.startswith("_"):
                add("symbols", f"{engine}:{n.attr}")
            if isinstance(n, ast.Assign | ast.AnnAssign):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if isinstance(t, ast.Subscript) and (key := _literal_key(t)) is not None:
                        holder = _holder(t.value)
                        if holder in ARG_HOLDERS:
                            add(ARG_KIND[engine], key)
                        elif isinstance(t.value, ast.Attribute) and t.value.attr == "environ":
                            add("envs", key)
                    elif _holder(t) in ("args", "defaults") and n.value is not None:
                        add(ARG_KIND[engine], *_dict_keys(n.value))
            meta = isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "meta"
            if meta and engine == "sglang" and (key := _literal_key(n)) is not None:
                add("meta_info", key)
    return found


@pytest.mark.parametrize("engine", sorted(SUPPORTED))
def test_the_code_uses_nothing_undeclared(engine):
    found = used_in_code(engine)
    # sanity: the scan sees what it scans for
    assert {ARG_KIND[engine], "sampling_params", "symbols", "envs"} <= set(found)
    undeclared = {kind: sorted(names - declared(engine, kind)) for kind, names in found.items()}
    undeclared = {k: v for k, v in undeclared.items() if v}
    assert not undeclared, (
        f"the {engine} adapter uses names engines/api_uses.py does not declare; declare them there "
        "(then python scripts/engine_api_surface.py)"
    )


def test_the_scan_finds_what_the_adapters_really_pass():
    vllm, sglang = used_in_code("vllm"), used_in_code("sglang")
    assert {"flat_logprobs", "routed_experts_prompt_start", "prompt_logprobs"} <= vllm["sampling_params"]
    assert {"logprobs_mode", "seed", "worker_extension_cls", "enable_sleep_mode"} <= vllm["engine_args"]
    assert {"generate", "collective_rpc", "reset_prefix_cache", "sleep"} <= vllm["llm"]
    assert vllm["worker"] == {"reload_weights"}
    assert "VLLM_BATCH_INVARIANT" in vllm["envs"]
    assert {"sampling_seed", "max_new_tokens"} <= sglang["sampling_params"]
    assert {"return_routed_experts", "logprob_start_len"} <= sglang["generate_args"]
    assert {"update_weights_from_tensor", "begin_weight_update", "shutdown"} <= sglang["engine"]
    assert {"output_token_logprobs", "input_token_logprobs", "routed_experts"} <= sglang["meta_info"]
    assert {"random_seed", "skip_tokenizer_init", "custom_weight_loader"} <= sglang["server_args"]


def test_the_warning_is_a_row_of_the_report_not_a_setting():
    from mismatch_probe.record import EngineInfo, RunRecord
    from mismatch_probe.report.labels import setup_rows

    line = version_warning("vllm", "0.9.2")
    record = RunRecord(engine=EngineInfo.model_validate({"engine": "vllm", "version_warning": line}))
    rows = dict(setup_rows(record))
    assert rows["engine version"] == line and "version_warning" not in rows["engine settings"]
    assert "engine version" not in dict(setup_rows(RunRecord(engine=EngineInfo.model_validate({"engine": "vllm"}))))

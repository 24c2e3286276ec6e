"""Every setting is declared once (config/spec.py) and everything else is derived from it: the
commands' flags, the engines' settings lists, the patch models, the JSON Schema and docs/settings.md.
These tests read the derived things themselves (the CLI's click commands, the shipped schema file),
never the source text, except to find the flags error messages name."""

from __future__ import annotations

import ast
import json
import re

import jsonschema  # the test extra installs it
import pytest
import typer.main
from conftest import ROOT
from typer.testing import CliRunner

from mismatch_probe.cli import app
from mismatch_probe.config import schema
from mismatch_probe.config.spec import (
    COMMON_ENGINE_SETTINGS,
    SECTIONS,
    CorrectionsPatch,
    EngineSpec,
    ProbeSpec,
    ReferencePatch,
    spec_settings,
)
from mismatch_probe.engines import BUILTIN_ENGINES

COMMAND = typer.main.get_command(app)
SPEC_COMMANDS = ("compare", "sample", "sweep")
# each command's options that are not spec settings
OWN_OPTIONS = {
    "compare": {"--overwrite", "--no-overwrite", "--rollouts-from", "--gate", "--json"},
    "sample": {"--set", "--overwrite", "--no-overwrite"},
    "sweep": {"--gate", "--resume", "--no-resume", "--json", "--shard", "--summarize", "--executor", "--ray-address"},
}


def options(command: str) -> dict[str, list[str]]:
    """The click options of a command: each option's name -> its flags (on and off spellings)."""
    cmd = COMMAND.commands[command]
    return {p.name: [*p.opts, *p.secondary_opts] for p in cmd.params if p.param_type_name == "option"}


@pytest.mark.parametrize("command", SPEC_COMMANDS)
def test_every_setting_has_exactly_one_flag_and_every_flag_one_setting(command):
    flags_of = options(command)
    by_flag: dict[str, str] = {}
    for name, flags in flags_of.items():
        for flag in flags:
            assert flag not in by_flag, f"{flag} is the flag of {by_flag[flag]} and {name}"
            by_flag[flag] = name
    for s in spec_settings().values():
        owners = {by_flag.get(flag) for flag in s.info.flags}
        assert len(owners) == 1 and None not in owners, f"{s.key}: flags {s.info.flags} -> {owners}"
    declared = {flag for s in spec_settings().values() for flag in s.info.flags}
    assert set(by_flag) - declared == OWN_OPTIONS[command]


def test_every_setting_of_every_table_is_declared_with_its_metadata():
    assert set(spec_settings()) == {
        *(name for name in ProbeSpec.model_fields if name not in (*SECTIONS, "variants", "sweep", "stack")),
        *(f"{section}.{name}" for section, model in SECTIONS.items() for name in model.model_fields),
    }
    for s in spec_settings().values():
        assert s.help and s.info.flag.startswith("--"), s.key
        assert (s.info.engines is not None) <= (s.section == "engine"), f"{s.key}: only [engine] settings name engines"


def test_the_engines_settings_are_the_declared_ones():
    names = {name for s in spec_settings().values() if s.info.engines for name in s.info.engines}
    assert names <= set(BUILTIN_ENGINES), names - set(BUILTIN_ENGINES)
    for name, entry in BUILTIN_ENGINES.items():
        declared = {s.name for s in spec_settings().values() if s.info.engines and name in s.info.engines}
        assert entry.settings == declared, name
    assert COMMON_ENGINE_SETTINGS == {"name", "python", "dtype", "logprobs_mode", "record_routing", "prefill_check"}
    assert set(EngineSpec.model_fields) == COMMON_ENGINE_SETTINGS | {
        s for e in BUILTIN_ENGINES.values() for s in e.settings
    }


def test_the_variant_patches_are_their_sections():
    for patch, section in ((ReferencePatch, SECTIONS["reference"]), (CorrectionsPatch, SECTIONS["corrections"])):
        assert set(patch.model_fields) == set(section.model_fields)


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")  # ms-swift's flags have underscores
# flags of other programs that messages tell people to pass: the program each belongs to
FOREIGN_FLAGS = {
    "--use_vllm": "swift rlhf (mismatch-probe init ms-swift reads its flags)",
    "--vllm_mode": "swift rlhf (mismatch-probe init ms-swift reads its flags)",
    "--headless": "vllm serve",
    "--master-addr": "vllm serve",
    "--master-port": "vllm serve",
    "--tensor-parallel-size": "vllm serve",
    "--pipeline-parallel-size": "vllm serve",
    "--max-logprobs": "vllm serve",
    "--return-tokens-as-token-ids": "vllm serve",
    "--enable-sleep-mode": "vllm serve",
    "--model-path": "sglang.launch_server",
    "--enable-memory-saver": "sglang.launch_server",
    "--enable-weights-cpu-backup": "sglang.launch_server",
    "--tp-size": "sglang.launch_server",
    "--pp-size": "sglang.launch_server",
    "--dp-size": "sglang.launch_server",
    "--head": "ray start",
    "--address": "ray start",
    "--nproc-per-node": "torchrun",
    "--save-debug-rollout-data": "slime",
    "--dump-details": "slime",
    "--multi_turn_scheduler": "swift rollout",
    "--use_gym_env": "swift rollout",
    "--vllm": "swift rollout (its --vllm_* arguments)",
    "--torch_dtype": "swift rollout",
    "--template": "swift rollout",
}


def message_flags() -> dict[str, list[str]]:
    """The flags named in the message and hint of every error the package raises (a call to a
    ``...Error`` or ``rule_error``), by flag -> where."""
    found: dict[str, list[str]] = {}
    package = ROOT / "mismatch_probe"
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if not (name.endswith("Error") or name == "rule_error"):
                continue
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                for part in ast.walk(arg):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        for flag in FLAG.findall(part.value):
                            found.setdefault(flag, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_error_message_names_a_flag_that_exists():
    ours = {flag for command in COMMAND.commands for flags in options(command).values() for flag in flags}
    ours |= {flag for p in COMMAND.params for flag in p.opts} | {"--help"}  # --debug, and every command's --help
    named = message_flags()
    assert len(named) > 30  # the scan sees the messages
    unknown = {flag: where for flag, where in named.items() if flag not in ours and flag not in FOREIGN_FLAGS}
    assert not unknown, f"messages name flags that no command has: {unknown}"


def test_a_bad_value_given_as_a_flag_is_refused_naming_that_flag(tmp_path):
    result = CliRunner().invoke(app, ["compare", "--top-p", "2", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --top-p must be <= 1, got 2.0"
    assert not (tmp_path / "run").exists()
    result = CliRunner().invoke(app, ["sample", "--engine-arg", "max_logprobs", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "--engine-arg 'max_logprobs' is not KEY=VALUE" in result.output


def test_the_shipped_schema_refuses_what_the_spec_refuses():
    shipped = json.loads((schema.HERE / "probe-spec.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(shipped)
    ok = {"model": "m", "sampling": {"top_p": 0.9, "top_k": -1}, "engine": {"dtype": "bf16", "name": "vllm"}}
    assert list(validator.iter_errors(ok)) == []
    for bad, what in [
        ({"sampling": {"top_p": 2}}, "maximum"),
        ({"sampling": {"top_p": 0}}, "exclusiveMinimum"),
        ({"engine": {"dtype": "fp8"}}, "enum"),
        ({"engine": {"tensor_parallel_size": 0}}, "minimum"),
        ({"reference": {"logprobs": "sampled"}}, "enum"),
        ({"corrections": {"token_tis": 0.5}}, "exclusiveMinimum"),
        ({"variants": [{"name": "a", "reference": {"micro_batch_size": 0}}]}, "minimum"),
        ({"engine": {"nope": 1}}, "additionalProperties"),
    ]:
        errors = list(validator.iter_errors({"model": "m", **bad}))
        assert len(errors) == 1, (bad, [e.message for e in errors])
        # a setting that may be unset (null) fails each branch of its anyOf: its value's branch says why
        found, pending = set(), [errors[0]]
        while pending:
            e = pending.pop()
            found.add(e.validator)
            pending += e.context or []
        assert what in found, (bad, found, errors[0].message)


def test_docs_settings_md_is_the_generated_reference():
    shipped = (ROOT / "docs" / "settings.md").read_text()
    assert shipped == schema.settings_markdown(), "run: python -m mismatch_probe.config.schema"
    for s in spec_settings().values():
        assert f"`{s.key}`" in shipped and s.info.flag in shipped


def test_an_engines_memory_hint_names_its_own_flags_with_their_values():
    assert BUILTIN_ENGINES["vllm"].memory_hint == (
        "size the KV cache with --kv-cache-memory-bytes N (engine.kv_cache_memory_bytes) or "
        "--gpu-memory-utilization F (engine.gpu_memory_utilization), or shorten it with --max-model-len N "
        "(engine.max_model_len)"
    )

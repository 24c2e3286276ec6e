"""The engine contract's capabilities (engines/base.py: EngineCapabilities): each built-in adapter
declares them, the worker's start reply carries them intact, and check_sync refuses by them; each
engine's argument names come from the setting declarations alone."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from mismatch_probe.config.spec import SyncSpec, default_logprobs_mode, engine_arguments
from mismatch_probe.engines import BUILTIN_ENGINES, EngineCapabilities
from mismatch_probe.engines.base import check_sync
from mismatch_probe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def adapter_class(name: str):
    module, _, cls = BUILTIN_ENGINES[name].target.partition(":")
    return getattr(importlib.import_module(module), cls)


@pytest.mark.parametrize("name", sorted(BUILTIN_ENGINES))
def test_every_builtin_adapter_declares_its_capabilities(name):
    declared = adapter_class(name).capabilities
    assert isinstance(declared, EngineCapabilities)
    if name != "remote":  # a remote engine's default is its API's (its instance's capabilities)
        assert declared.logprobs_mode == default_logprobs_mode(name)


def test_capabilities_travel_through_the_start_reply_intact():
    from mismatch_probe.engines import sglang, vllm

    for declared in (sglang.CAPABILITIES, sglang.SERVER_CAPABILITIES, vllm.CAPABILITIES, EngineCapabilities()):
        assert EngineCapabilities.from_header(json.loads(json.dumps(declared.to_header()))) == declared


def test_check_sync_refuses_by_what_the_engine_declares():
    from mismatch_probe.engines import sglang, vllm

    def refusal(sync, capabilities, **kw) -> ConfigError:
        with pytest.raises(ConfigError) as caught:
            check_sync(SyncSpec(start_from="perturbed", **sync), capabilities, engine="E 1.0", **kw)
        return caught.value

    nccl = refusal({"transfer": "nccl"}, vllm.CAPABILITIES, on_cpu=True)
    assert "needs a trainer process in the engine's NCCL group, and NCCL needs GPUs" in nccl.message
    assert nccl.hint == "--sync-transfer tensor or disk"
    server = refusal({"transfer": "nccl"}, sglang.SERVER_CAPABILITIES, on_cpu=None)
    assert "/init_weights_update_group" in server.message and "the server's NCCL group" in server.message
    assert "NCCL needs GPUs" not in server.message
    assert "sleep mode is not supported on CPU" in refusal({"sleep_level": 1}, vllm.CAPABILITIES, on_cpu=True).message
    check_sync(SyncSpec(start_from="perturbed", sleep_level=1), vllm.CAPABILITIES, engine="E", on_cpu=False)
    # SGLang's self-flushes: the engine's after a disk update and a sleep, a server's after a sleep only
    disk = {"transfer": "disk", "reset_prefix_cache": False}
    assert sglang.DISK_FLUSH_BY in refusal(disk, sglang.CAPABILITIES, on_cpu=False).message
    check_sync(SyncSpec(start_from="perturbed", **disk), sglang.SERVER_CAPABILITIES, engine="E", on_cpu=None)
    slept = refusal({"sleep_level": 2, "reset_prefix_cache": False}, sglang.SERVER_CAPABILITIES, on_cpu=None)
    assert "flushes its radix cache by itself when it releases" in slept.message
    # one data-parallel replica: the engine's every transfer (its digest goes through tensors), a server's tensors
    assert (
        "data-parallel"
        in refusal({"transfer": "disk"}, sglang.CAPABILITIES, on_cpu=False, data_parallel_size=2).message
    )
    check_sync(
        SyncSpec(start_from="perturbed", transfer="disk"),
        sglang.SERVER_CAPABILITIES,
        engine="E",
        on_cpu=None,
        data_parallel_size=2,
    )
    none = refusal({}, EngineCapabilities(), on_cpu=False)
    assert "no weight-update path" in none.message and "sglang" in none.hint


def test_each_engine_builds_its_arguments_from_the_declarations():
    from mismatch_probe.engines import sglang_args, vllm_args

    assert vllm_args.ARGS == {k: v[0] for k, v in engine_arguments("vllm").items() if len(v) == 1}
    assert set(vllm_args.CONFIG_SECTIONS) == set(vllm_args.ARGS)  # each argument read back from the config
    assert vllm_args.ADDRESS_ARGS == ("master_addr", "master_port")
    assert sglang_args.ARGS == {k: v[0] for k, v in engine_arguments("sglang").items()}
    assert set(sglang_args.ARGS.values()) <= set(sglang_args.RECORDED)  # each read back from get_server_info()
    assert sglang_args.settings_by_argument()["max_running_requests"] == "max_num_seqs"
    assert "disable_radix_cache" not in sglang_args.settings_by_argument()  # negated: not the setting's value


def test_nothing_probes_an_engine_for_methods():
    probe = re.compile(r"\b(getattr|hasattr)\((engine|fresh|cls|self\.engine)\b")
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for package in ("engines", "pipeline")
        for path in sorted((ROOT / "mismatch_probe" / package).glob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert not found, found

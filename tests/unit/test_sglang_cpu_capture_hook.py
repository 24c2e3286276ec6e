"""tests/sglang-cpu's routed-experts capture hook (mismatch_probe_sglang_cpu.py) against a stand-in of
the two SGLang 0.5.23 modules it and the adapter read (state_capturer/base.py, pool_host/common.py),
so it runs without SGLang; tests/engines/test_sglang_engine.py runs it against the real one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

SUPPORT = ROOT / "tests" / "sglang-cpu" / "site-packages"

# what the hook and the adapter rely on, as SGLang 0.5.23 has it
COMMON = """
from collections import defaultdict

def alloc_with_host_register(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return {"dims": dims, "device": device, "registered": pin_memory, "allocator": allocator}

def alloc_with_pin_memory(dims, dtype, device, pin_memory, allocator):
    return {"pinned": pin_memory}

ALLOC_MEMORY_FUNCS = defaultdict(lambda: alloc_with_host_register, {"npu": alloc_with_pin_memory})
"""
BASE = """
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

def host_cache(device):
    return ALLOC_MEMORY_FUNCS[device]((4, 2, 2), dtype="int32", device="cpu", pin_memory=True, allocator="host")
"""


def stand_in(root: Path) -> Path:
    for package in ("sglang", "sglang/srt", "sglang/srt/state_capturer", "sglang/srt/mem_cache"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / "sglang/srt/mem_cache/pool_host").mkdir()
    (root / "sglang/srt/mem_cache/pool_host/__init__.py").write_text("")
    (root / "sglang/srt/mem_cache/pool_host/common.py").write_text(COMMON)
    (root / "sglang/srt/state_capturer/base.py").write_text(BASE)
    return root


def run(root: Path, *, install: bool) -> dict:
    code = f"""
import json, sys
sys.path[:0] = [{str(root)!r}, {str(SUPPORT)!r}]
import mismatch_probe_sglang_cpu as hook
if {install}:
    hook.install()
from mismatch_probe.engines.sglang import cpu_capture_allocator
found = cpu_capture_allocator()
from sglang.srt.state_capturer import base
from sglang.srt.mem_cache.pool_host import common
cpu = base.host_cache("cpu")
print(json.dumps({{
    "found": found,
    "cpu": cpu,
    "cuda": base.host_cache("cuda"),
    "npu": base.host_cache("npu"),
    "common_untouched": "cpu" not in common.ALLOC_MEMORY_FUNCS and common.ALLOC_MEMORY_FUNCS["x"] is common.alloc_with_host_register,
    "hook_left": any(isinstance(f, hook._AfterCapturer) for f in sys.meta_path),
}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_hook_allocates_the_capture_buffer_unpinned_on_cpu_only(tmp_path):
    got = run(stand_in(tmp_path), install=True)
    assert got["found"] == "unpinned" and not got["hook_left"]
    # SGLang's own allocation for "cpu", with pin_memory=False: no cudaHostRegister
    assert got["cpu"] == {"dims": [4, 2, 2], "device": "cpu", "registered": False, "allocator": "host"}
    # every other device, and the table the host KV pools import from common.py, as SGLang has them
    assert got["cuda"]["registered"] is True and got["npu"] == {"pinned": True}
    assert got["common_untouched"]


def test_without_the_hook_the_adapter_sees_the_host_registering_allocator(tmp_path):
    got = run(stand_in(tmp_path), install=False)
    assert got["found"] == "host_register" and got["cpu"]["registered"] is True

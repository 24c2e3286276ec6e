"""The CPU test support for SGLang (tests/sglang-cpu/): the stand-in sgl_kernel helpers against
plain loops, its loud failures, and the torchvision op-schema hook. Runs without SGLang."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT

SUPPORT = ROOT / "tests" / "sglang-cpu" / "site-packages"


@pytest.fixture(scope="module")
def sgl_kernel():
    spec = importlib.util.spec_from_file_location("sgl_kernel_stand_in", SUPPORT / "sgl_kernel" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_assign_req_to_token_pool_writes_each_run_into_its_row(sgl_kernel):
    pool = torch.full((5, 10), -1, dtype=torch.int32)
    rows, starts, ends = torch.tensor([3, 0, 4]), torch.tensor([2, 0, 7]), torch.tensor([5, 4, 7])  # last: empty
    locs = torch.arange(100, 107, dtype=torch.int64)
    want = pool.clone()
    offset = 0
    for r, a, b in zip(rows.tolist(), starts.tolist(), ends.tolist()):
        for col in range(a, b):
            want[r, col] = int(locs[offset])
            offset += 1
    sgl_kernel.assign_req_to_token_pool_cpu(rows, pool, starts, ends, locs, pool.shape[1])
    assert torch.equal(pool, want)
    with pytest.raises(ValueError, match="pool_len"):
        sgl_kernel.assign_req_to_token_pool_cpu(rows, pool, starts, ends, locs, 11)


def test_copy_all_layer_kv_cache_moves_rows_of_every_buffer_reading_sources_first(sgl_kernel):
    k = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    v = torch.arange(6 * 2, dtype=torch.bfloat16).reshape(6, 2) * -1
    before = [k.clone(), v.clone()]
    src, tgt = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 4])  # overlapping: row 1 is read and written
    ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([k.stride(0) * k.element_size(), v.stride(0) * v.element_size()], dtype=torch.int64)
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for buf, old in zip((k, v), before):
        want = old.clone()
        want[tgt] = old[src]
        assert torch.equal(buf, want)


def test_anything_else_fails_loudly(sgl_kernel):
    with pytest.raises(ImportError, match="CPU test stand-in.*real sgl-kernel"):
        sgl_kernel.silu_and_mul  # noqa: B018
    kernel = sgl_kernel.verify_tree_greedy_cpu  # imported by SGLang's CPU modules, never called here
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu was called"):
        kernel(np.zeros(1))


def test_torchvision_hook_defines_the_two_op_schemas_only_when_torchvision_is_imported():
    code = f"""
import sys, torch
sys.path.insert(0, {str(SUPPORT)!r})
import mismatch_probe_sglang_cpu as hook
hook.install()
assert "torch" in sys.modules and hook._library is None  # nothing defined until torchvision is imported
try:
    import torchvision  # noqa: F401  (absent here: the hook still runs first)
except ImportError:
    pass
print(torch.ops.torchvision.nms.default._schema, torch.ops.torchvision.qnms.default._schema, sep="\\n")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == [
        "torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "torchvision::qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    ]

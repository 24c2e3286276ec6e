"""mismatch-probe's vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml).

vLLM loads it in each of its processes (API server, engine core, every worker), so it also reaches a
``vllm serve`` started from the venv mismatch-probe is installed in. It does one thing, on vLLM's CPU
platform only: it asks Linux for the AMX tile state before the first forward.

Why: vLLM's CPU build (0.32) runs its AMX attention kernels whenever the CPU has AMX tiles
(``vllm/v1/attention/backends/cpu_attn.py: _get_attn_isa``), but never asks for the tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, which Linux requires per process before
the first tile instruction). A process gets it only as a side effect of oneDNN running an AMX GEMM
first. Models whose linear weights are under 1 MiB are routed to the SGL GEMM kernel instead
(``vllm/model_executor/layers/utils.py: check_cpu_sgl_kernel``), whose small-batch path does not use AMX;
so when an eager engine's first step holds a few tokens (one short request arriving alone, as on a
loaded server), the attention's first tile instruction kills the worker with SIGILL.
``torch.cpu._init_amx()`` makes the same request oneDNN would; it changes no kernel choice.
"""

from __future__ import annotations


def request_cpu_amx() -> None:
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        torch.cpu._init_amx()

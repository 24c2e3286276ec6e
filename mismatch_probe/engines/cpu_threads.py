"""CPU thread binding for engines that run tensor-parallel ranks on CPU cores."""

from __future__ import annotations

import os

from mismatch_probe.errors import ConfigError


def cpu_thread_binding(tensor_parallel_size: int, variable: str) -> str:
    """A thread binding (``VLLM_CPU_OMP_THREADS_BIND``, ``SGLANG_CPU_OMP_THREADS_BIND``) giving each
    TP rank its own contiguous block of this process's cores, e.g. ``0-7|8-15``.

    The CPU builds of vLLM and SGLang bind ranks to NUMA nodes by default, which fails when TP
    exceeds the NUMA node count (a 2-core VM has one node but can run TP=2 with one core per rank).
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < tensor_parallel_size:
        raise ConfigError(
            f"tensor_parallel_size={tensor_parallel_size} needs at least one CPU core per rank; "
            f"this process may use {len(cores)}",
            hint=f"lower --tp, or set {variable} yourself",
        )
    per = len(cores) // tensor_parallel_size
    groups = [cores[i * per : (i + 1) * per] for i in range(tensor_parallel_size)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)

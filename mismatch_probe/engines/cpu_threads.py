"""CPU thread binding for engines that run several ranks (tensor, pipeline or data parallel) on CPU cores."""

from __future__ import annotations

import os

from mismatch_probe.errors import ConfigError


def cpu_thread_binding(ranks: int, variable: str, *, layout: str | None = None) -> str:
    """A thread binding (``VLLM_CPU_OMP_THREADS_BIND``, ``SGLANG_CPU_OMP_THREADS_BIND``) giving each
    of this node's ``ranks`` its own contiguous block of this process's cores, e.g. ``0-7|8-15``.

    The CPU builds of vLLM and SGLang bind ranks to NUMA nodes by default, which fails when the
    ranks outnumber the NUMA nodes (a 2-core VM has one node but can run TP=2 or PP=2 with one core
    per rank). ``layout`` names the settings that make the ranks, for the message.
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < ranks:
        raise ConfigError(
            f"{layout or f'tensor_parallel_size={ranks}'} needs at least one CPU core per rank ({ranks} ranks); "
            f"this process may use {len(cores)}",
            hint=f"use fewer ranks (--tp, engine.pipeline_parallel_size, engine.data_parallel_size), or set {variable} "
            "yourself",
        )
    per = len(cores) // ranks
    groups = [cores[i * per : (i + 1) * per] for i in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)

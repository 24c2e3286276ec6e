"""The environment's CPU fields (environment.py): the kernel-selecting instruction sets read from
/proc/cpuinfo and the CPU's kind, for the CPUs the project meets and a few it may."""

from __future__ import annotations

import pytest

from mismatch_probe.environment import cpu_features, cpu_isa, cpu_kind

SAPPHIRE_RAPIDS = "fpu sse avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"
EPYC_GENOA = "fpu sse avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512vbmi"
SKYLAKE = "fpu sse avx2 fma avx512f avx512bw avx512cd"
HASWELL = "fpu sse avx avx2 fma"


def cpuinfo(flags: str, key: str = "flags") -> str:
    return f"processor\t: 0\nmodel name\t: some CPU\n{key}\t\t: {flags}\n\nprocessor\t: 1\n{key}\t\t: {flags}\n"


@pytest.mark.parametrize(
    "flags, isa, kind",
    [
        (
            SAPPHIRE_RAPIDS,
            ["amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx2", "fma"],
            "AMX",
        ),
        (EPYC_GENOA, ["avx512f", "avx512_bf16", "avx512_vnni", "avx2", "fma"], "AVX-512 BF16"),
        (SKYLAKE, ["avx512f", "avx2", "fma"], "AVX-512"),
        (HASWELL, ["avx2", "fma"], "AVX2"),
        ("fpu sse sse2", [], "x86_64"),
        # AMX tiles without AMX-BF16 take none of the engines' AMX paths
        ("avx2 avx512f avx512_bf16 amx_tile", ["amx_tile", "avx512f", "avx512_bf16", "avx2"], "AVX-512 BF16"),
    ],
    ids=["sapphire-rapids", "epyc-genoa", "skylake", "haswell", "old", "tiles-only"],
)
def test_x86_instruction_sets_and_kind(flags, isa, kind):
    assert cpu_isa(cpuinfo(flags), "x86_64") == isa
    assert cpu_kind(isa, "x86_64") == kind
    assert cpu_isa(cpuinfo(flags), "AMD64") == isa  # Windows' name for the architecture


def test_arm_features_and_kind():
    isa = cpu_isa(cpuinfo("fp asimd evtstrm aes sve sve2 i8mm bf16", key="Features"), "aarch64")
    assert isa == ["asimd", "sve", "sve2", "bf16", "i8mm"] and cpu_kind(isa, "aarch64") == "Arm SVE"
    assert cpu_kind(["asimd"], "arm64") == "Arm NEON"


def test_unknown_cpuinfo_and_architecture():
    assert cpu_isa("", "x86_64") == [] and cpu_kind([], "riscv64") == "riscv64"


def test_this_machine_is_recorded_consistently():
    got = cpu_features()
    assert got["cpu_kind"] == cpu_kind(got["cpu_isa"])
    assert got.get("aten_cpu_capability")  # torch is installed in every venv the tests run in

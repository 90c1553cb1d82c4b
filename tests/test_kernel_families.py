"""The privacy-bound and float64-reference tests (marked ``kernels``) again, under other CPU kernel
families, so that a kernel difference shows on a developer's machine, not first on a user's.

The default suite already runs them with the default kernels. Here each family caps, at process
start, oneDNN's instruction set (``ONEDNN_MAX_CPU_ISA``: convolutions, some matmuls), ATen's own
vectorised kernels (``ATEN_CPU_CAPABILITY``: sums, norms, elementwise) and MKL's BLAS
(``MKL_ENABLE_INSTRUCTIONS``). An Intel AVX-512/AMX machine failed two bound tests that passed on
AVX-512 AMD; an AVX2 machine two float32-reference tests: all are in these runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# family -> (oneDNN ISA cap, ATen capability, MKL instructions)
FAMILIES = {
    "avx2": ("AVX2", "avx2", "AVX2"),
    "sse41": ("SSE41", "default", "SSE4_2"),
    "avx512-core": ("AVX512_CORE", "avx512", "AVX512"),  # below AMX's bf16 tiles
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {
        flag
        for line in text.splitlines()
        if line.startswith("flags")
        for flag in line.split(":", 1)[1].split()
    }


# SSE4.1 (no x86 machine of this decade is capped there) in the slow suite: the default suite is near
# its 8-minute budget, and AVX2, the family that once failed a fresh clone, stays in it
@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=pytest.mark.slow) if f == "sse41" else f for f in sorted(FAMILIES)],
)
def test_bound_and_reference_tests_pass_under_capped_kernels(family):
    flags = _cpu_flags()
    if "avx2" not in flags:
        pytest.skip("not an x86 CPU with AVX2 (no /proc/cpuinfo flags to cap from)")
    if family == "avx512-core" and not {"amx_tile", "amx_bf16"} & flags:
        pytest.skip(
            "no AMX here: AVX512_CORE is this CPU's default family, run by the suite itself"
        )
    if family == "avx2" and "avx512f" not in flags:
        pytest.skip("no AVX-512 here: AVX2 is this CPU's default family, run by the suite itself")
    onednn, aten, mkl = FAMILIES[family]
    env = {
        **os.environ,
        "ONEDNN_MAX_CPU_ISA": onednn,
        "DNNL_MAX_CPU_ISA": onednn,
        "ATEN_CPU_CAPABILITY": aten,
        "MKL_ENABLE_INSTRUCTIONS": mkl,
        "PYTHONPATH": str(ROOT / "src"),
    }
    # `make test`'s workers run one OpenMP thread each: these reruns take the default thread count,
    # so the marked tests also see the multi-threaded kernels' reduction orders
    env.pop("OMP_NUM_THREADS", None)
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    capability = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert capability.stdout.strip().lower() == ("default" if aten == "default" else aten), (
        capability.stdout
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-p",
        "no:cacheprovider",
        "-m",
        "kernels and not slow",
        "tests",
    ]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (
        f"under {family} kernels:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    )
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]

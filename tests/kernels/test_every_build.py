"""The kernel tests again on every other build of the library this host can run (issue 36: "the native tests
run for each ISA the host can execute, so that an AVX2 bug shows on an AVX-512 machine too").

`make test` runs tests/kernels on the host's own build (`native`: VNNI, 512-bit VNNI and AMX tiles where the
CPU has them). Here the same test files run in a subprocess (a process loads one build) for:
- `avx2`: the AVX2 + FMA + F16C build, where the host's build uses more than that (VNNI, AVX-512, AMX);
- `portable`: the scalar build every host runs (no int8 activations: those tests skip there).
The files are the ones that compare the library with model/ (every configuration, weight and KV format), the
linear kernels, the draws and speculation; each build must pass them as the host's build does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyloop.kernels import build, lib

HERE = Path(__file__).parent
FILES = ["test_native.py", "test_native_linear.py", "test_sample.py", "test_native_speculation.py",
         "test_batch_invariance.py"]


def other_builds() -> list[str]:
    if build.compiler() is None:
        return []
    try:
        native = lib.load().tl_isa().decode()
    except Exception:   # (no library on this host: nothing to compare)
        return []
    wider = any(w in native for w in ("vnni", "avx512", "amx"))   # the host's build goes beyond AVX2
    simd = "avx2" in native
    return (["avx2"] if wider else []) + (["portable"] if simd else [])


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("isa", other_builds() or [pytest.param("none", marks=pytest.mark.skip(
    reason="no other build of the library runs on this host"))])
def test_kernel_tests_pass_on_every_build(isa):
    env = {**os.environ, "TINYLOOP_NATIVE_ISA": isa}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *[str(HERE / f) for f in FILES]], cwd=HERE.parent.parent, env=env,
                         capture_output=True, text=True, timeout=1800)
    tail = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, f"the {isa} build fails the kernel tests:\n{tail}"
    assert " passed" in tail
    print(f"{isa}: {tail.strip().splitlines()[-1]}")

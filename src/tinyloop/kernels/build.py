"""Build the native executor's shared library for this host, once, and cache it.

Toolchain: the system C++ compiler (`$CXX`, else g++ or c++) called directly, and the library loaded with
ctypes. Why not torch's cpp_extension, nanobind or scikit-build-core: the kernels use no torch or Python
headers (functions over raw pointers, one call per decode step, so ctypes' ~2 us a call does not
matter), so a plain `g++ -O3 -march=native -shared` compiles the four files in a few seconds instead of
the ~40 s a torch extension takes, and the library does not depend on the torch version or the Python ABI.

`-march=native` tunes the build to the host CPU as llama.cpp's native build does (AVX2/FMA/F16C here; the
vector code is chosen at compile time in `csrc/vec.h`); `isa="portable"` builds the scalar fallback
without it (tests run both). The cache key hashes the sources, the flags, the compiler's version and the
CPU's feature flags, so a changed source, compiler or machine rebuilds. The library is written to a
temporary name and renamed into place: concurrent builds (two servers starting) never see half a file.

Cache: `$TINYLOOP_KERNEL_CACHE`, else `$TINYLOOP_HOME/kernels`, else `~/.cache/tinyloop/kernels`.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# every .cpp of csrc/ is one library (a family's native math, csrc/<family>.cpp, is built without a line here)
SOURCES = tuple(sorted(p.name for p in CSRC.glob("*.cpp")))
ISAS = ("native", "avx2", "portable")


class NativeBuildError(RuntimeError):
    """The native library cannot be built or loaded here (no compiler, a compile error)."""


def cache_dir() -> Path:
    if os.environ.get("TINYLOOP_KERNEL_CACHE"):
        return Path(os.environ["TINYLOOP_KERNEL_CACHE"])
    home = os.environ.get("TINYLOOP_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "tinyloop") / "kernels"


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def flags(isa: str) -> list[str]:
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    # avx2: the host's build without AVX-512 (every AVX-512 subset goes with F), the VNNI integer dot products
    # and the AMX tiles: the code an AVX2-only host (the EPYC) runs, compiled and tested on any x86 host with
    # AVX2 (tests compare it with native, bit for bit)
    arch = ["-march=native"] if isa == "native" else \
        ["-march=native", "-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile",
         "-mno-amx-int8", "-mno-amx-bf16"] if isa == "avx2" else []
    return ["-std=c++20", "-O3", *arch, "-fPIC", "-shared", "-pthread"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _key(cxx: str, isa: str) -> str:
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = cxx
    h.update(" ".join(flags(isa)).encode() + version.encode() + platform.machine().encode())
    if isa in ("native", "avx2"):
        h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def library_path(isa: str = "native", *, build: bool = True) -> Path:
    """The cached library for `isa`, built first if needed (NativeBuildError when it cannot be, or when it
    is not built and `build` is False)."""
    cxx = compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")
    out = cache_dir() / f"libtinyloop-{isa}-{_key(cxx, isa)}.so"
    if out.exists():
        return out
    if not build:
        raise NativeBuildError(f"{out} is not built")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *flags(isa), "-o", tmp, *(str(CSRC / s) for s in SOURCES)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise NativeBuildError(f"compiling the native executor failed:\n{' '.join(cmd)}\n{res.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


if __name__ == "__main__":  # `python -m tinyloop.kernels.build`: what `make install` runs
    import sys
    import time

    t0 = time.perf_counter()
    try:
        p = library_path("native")
    except NativeBuildError as exc:
        print(f"tinyloop: native executor not built ({exc}); the PyTorch path will serve", file=sys.stderr)
        sys.exit(0)
    print(f"tinyloop: native executor {p} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)

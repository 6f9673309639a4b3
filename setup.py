"""Build fastattn's compiled kernels.

The fused kernel (src/_kernel_impl.pxi + src/fa_*.h) is compiled once per instruction set,
RapidFuzz-style: each src/_kernel_<isa>.pyx only includes the shared source, and its
extension gets that ISA's flags.  fastattn/_dispatch.py checks the running CPU and imports
the best variant that loads, falling back to the portable baseline.  Nothing here reads the
build host's CPU: no -march=native, so a wheel runs on any x86-64 (or other) machine.

Threads: the kernels run on fastattn's own pool of POSIX threads (src/fa_pool.h); OpenMP
is the fallback where there are no POSIX threads (MSVC) and supplies the default thread
count (OMP_NUM_THREADS) where it is available.

Environment switches:
  FASTATTN_NO_OPENMP=1   build without OpenMP (POSIX: still the thread pool; MSVC: one thread).
  FASTATTN_NO_THREADS=1  build single-threaded kernels (no pool, no OpenMP).
  FASTATTN_ISAS=base,avx2  build only these variants (default: all the compiler targets).
"""
import glob
import os
import platform
import sys
import tempfile
import textwrap

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

X86 = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}

# Per-ISA compile flags for GCC/Clang and for MSVC (clang-cl understands the GCC ones).
ISA_FLAGS = {
    "base": {"unix": [], "msvc": []},
    "avx2": {"unix": ["-mavx2", "-mfma"], "msvc": ["/arch:AVX2"]},
    "avx512": {"unix": ["-mavx512f", "-mavx2", "-mfma"], "msvc": ["/arch:AVX512"]},
}


def wanted_isas():
    isas = ["base", "avx2", "avx512"] if X86 else ["base"]
    only = os.environ.get("FASTATTN_ISAS")
    if only:
        isas = [i for i in isas if i in only.split(",")]
    return isas


def _compiles(compiler, flags, code):
    """Try-compile-and-link a snippet with the given flags."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "check.c")
        with open(src, "w") as f:
            f.write(textwrap.dedent(code))
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=flags)
            compiler.link_executable(objs, os.path.join(tmp, "check"), extra_postargs=flags)
        except Exception:
            return False
    return True


OPENMP_CHECK = """
#include <omp.h>
int main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }
"""


class BuildExt(build_ext):
    """Adds OpenMP and optimisation flags according to the compiler actually used."""

    def openmp_flags(self):
        if os.environ.get("FASTATTN_NO_OPENMP") or os.environ.get("FASTATTN_NO_THREADS"):
            return [], []
        ctype = self.compiler.compiler_type
        if ctype == "msvc":
            return ["/openmp"], []
        candidates = [(["-fopenmp"], ["-fopenmp"])]
        if sys.platform == "darwin":
            # Apple clang has no -fopenmp driver flag; libomp comes from Homebrew/conda.
            candidates.insert(0, (["-Xpreprocessor", "-fopenmp"], ["-lomp"]))
        for cflags, ldflags in candidates:
            if _compiles(self.compiler, cflags + ldflags, OPENMP_CHECK):
                return cflags, ldflags
        self.warn("OpenMP not available: fastattn will be built single-threaded")
        return [], []

    def build_extensions(self):
        ctype = self.compiler.compiler_type
        omp_c, omp_l = self.openmp_flags()
        # -Wno-psabi: the vector helpers are always inlined, so no vector crosses an ABI boundary.
        opt = ["/O2"] if ctype == "msvc" else ["-O3", "-fno-math-errno", "-Wno-psabi"]
        for ext in self.extensions:
            isa = ext.name.rsplit("_", 1)[-1]
            isa_flags = ISA_FLAGS[isa]["msvc" if ctype == "msvc" else "unix"]
            threads = [] if ctype == "msvc" else ["-pthread"]
            ext.extra_compile_args = opt + omp_c + isa_flags + threads
            ext.extra_link_args = omp_l + (omp_c if ctype != "msvc" else []) + threads
            if os.environ.get("FASTATTN_NO_THREADS"):
                ext.define_macros.append(("FA_POOL_SERIAL", "1"))
        super().build_extensions()


def extensions():
    return [
        Extension(
            f"fastattn._kernel_{isa}",
            [f"src/_kernel_{isa}.pyx"],
            include_dirs=["src", np.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_25_API_VERSION")],
            # The C headers are included by the generated .c: without this, an in-place
            # rebuild after editing only a header silently keeps the old module.
            depends=sorted(glob.glob("src/*.h")) + ["src/_kernel_impl.pxi"],
        )
        for isa in wanted_isas()
    ]


setup(
    ext_modules=cythonize(
        extensions(),
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "nonecheck": False,
        },
    ),
    cmdclass={"build_ext": BuildExt},
)

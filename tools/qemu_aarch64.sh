#!/usr/bin/env bash
# Cross-build fastattn for aarch64 and run its tests under QEMU user mode, on an x86-64
# Debian host (run as root: it apt-get installs what it lacks), from Debian packages and
# PyPI wheels only.  Not part of .ci/run: emulation makes the suite many times slower.
#
#   bash tools/qemu_aarch64.sh                 # every stage, then the default test subset
#   bash tools/qemu_aarch64.sh root            # only make the arm64 root (cached)
#   bash tools/qemu_aarch64.sh build           # only cross-build the extension
#   bash tools/qemu_aarch64.sh test [ARGS...]  # pytest ARGS (default: DEFAULT_TESTS below)
#   bash tools/qemu_aarch64.sh python [ARGS]   # the arm64 Python, for debugging
#
# Stages:
#   root   apt-get install of the host tools (qemu-user-static, debootstrap, the aarch64
#          cross GCC) when missing; a Debian bookworm arm64 file tree made by
#          `debootstrap --foreign` (download and unpack) plus an unpack of the remaining
#          downloaded packages (python3, python3-dev, libgomp1 and their dependencies).  No
#          package's scripts run, so no arm64 binary has to run to make the root:
#          binfmt_misc and a chroot are not needed, which is what lets this work in a
#          container.  NumPy, pytest and hypothesis go into the root's dist-packages from
#          their aarch64 wheels, installed by the host's pip.  The root is cached in
#          $FASTATTN_ARM64_ROOT (default /var/tmp/fastattn-arm64); each step leaves a marker
#          there and is skipped on the next run.  Delete the directory to start afresh.
#   build  copies the worktree's files (tracked and untracked, not ignored) to
#          ROOT/src/fastattn and builds the extension there with the host's Python (in a
#          venv, ROOT/.build-venv, holding pyproject.toml's build requirements) and
#          aarch64-linux-gnu-gcc, against the root's Python and NumPy headers;
#          the root's sysconfig data gives the compiler, flags and extension suffix.  On
#          aarch64 setup.py builds only the "base" kernel variant.
#   test   runs pytest with the root's Python under `qemu-aarch64-static -L ROOT`, in
#          ROOT/src/fastattn.  The interpreter's name there (sys.executable) is
#          ROOT/usr/bin/python3-qemu, a host shell script that starts QEMU again, so the
#          tests that run sys.executable in a subprocess work without binfmt_misc.
#
# QEMU's -L looks a path up in ROOT first and falls back to the host's file system, so the
# root keeps no /proc, /dev, /sys or /tmp of its own: QEMU's emulated /proc/self and the
# host's /dev and /tmp are used.
#
# QEMU emulates its "max" CPU unless QEMU_CPU names another (e.g. QEMU_CPU=neoverse-n1 for
# one without SVE and SME).  On "max", NumPy's OpenBLAS takes its SME kernels, whose
# float32 matmul raises spurious floating-point flags: NumPy then warns "divide by zero
# encountered in matmul" (as on Apple M4), in NumPy and in fastattn.attention_weights alike.
#
# The default test subset: the kernel suites against the float64 reference, the
# reproducibility (bit-identity) rules, the compiled-variant checks, the exp accuracy
# bounds, the argument rules (not their hypothesis fuzzing), the layers and positions:
# 1,100 tests, about 5 minutes on two busy cores.
# Left out:
# - the hardening tests: 2**31-key scans, an 8k x 8k peak-memory test, leak and thread
#   stress, 7.5 minutes under QEMU; their sparse memory maps of ~68 GB apparent size fail
#   there with ENOMEM (QEMU's user mode maps 16 GiB but not 32 GiB; natively both work);
# - the CLI tests: `info` passes, `bench --quick` measures the machine's peak rates and
#   times every library, and did not finish in 9 minutes;
# - the property tests and the bad-input fuzzing: hypothesis cases over the same kernels;
#   they pass, in another 3.5 minutes, with
#   `test tests/test_properties.py tests/test_arguments.py`;
# - the demo, README, docstring and typing tests: text and stubs, not the kernel.
# `test tests` runs everything.
set -euo pipefail

ROOT=${FASTATTN_ARM64_ROOT:-/var/tmp/fastattn-arm64}
MIRROR=${FASTATTN_ARM64_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEFAULT_TESTS=(tests/test_attention.py tests/test_reference.py tests/test_reproducibility.py
               tests/test_dispatch.py tests/test_exp.py tests/test_arguments.py
               tests/test_layers.py tests/test_positions.py
               -k "not malformed_calls and not softmax_bad_inputs")
HOST_PY=${PYTHON:-python3}
PYQEMU=$ROOT/usr/bin/python3-qemu
case $ROOT in
    /?*) ;;
    *) echo "FASTATTN_ARM64_ROOT must be an absolute path other than /" >&2; exit 2 ;;
esac

log() { printf '\n== %s\n' "$*" >&2; }

host_tools() {
    local need=()
    command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
    command -v debootstrap >/dev/null || need+=(debootstrap)
    command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
    if ((${#need[@]})); then
        log "installing host tools: ${need[*]}"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}"
    fi
}

stage_root() {
    host_tools
    if [ ! -e "$ROOT/.unpacked" ]; then
        log "debootstrap (download and unpack) into $ROOT"
        # Start afresh, but never delete a directory this script did not make.
        if [ -n "$(ls -A "$ROOT" 2>/dev/null)" ] && [ ! -e "$ROOT/.fastattn-arm64-root" ]; then
            echo "$ROOT is not empty and not made by $0: set FASTATTN_ARM64_ROOT" >&2
            exit 1
        fi
        rm -rf "${ROOT:?}"
        mkdir -p "$ROOT"
        touch "$ROOT/.fastattn-arm64-root"
        # python3-dev: the headers the cross build compiles against; libgomp1: OpenMP.
        debootstrap --foreign --arch=arm64 --variant=minbase \
            --include=python3,python3-dev,libgomp1 "$SUITE" "$ROOT" "$MIRROR"
        log "unpacking the packages that the second stage would install"
        local deb
        for deb in "$ROOT"/var/cache/apt/archives/*.deb; do
            dpkg-deb --fsys-tarfile "$deb" | tar -x --keep-directory-symlink -C "$ROOT"
        done
        rm -rf "${ROOT:?}/proc" "${ROOT:?}/dev" "${ROOT:?}/sys" "${ROOT:?}/tmp"
        touch "$ROOT/.unpacked"
    fi
    if [ ! -e "$ROOT/.wheels" ]; then
        log "NumPy, pytest and hypothesis (aarch64 wheels) into the root's dist-packages"
        local pyver
        pyver=$(basename "$(ls -d "$ROOT"/usr/lib/python3.[0-9]*/ | tail -n1)")
        pyver=${pyver#python}
        "$HOST_PY" -m pip install -q --upgrade --target "$ROOT/usr/lib/python3/dist-packages" \
            --only-binary=:all: --platform manylinux2014_aarch64 \
            --platform manylinux_2_28_aarch64 --python-version "$pyver" \
            --implementation cp --abi "cp${pyver/./}" "numpy>=2" "pytest>=7" "hypothesis>=6"
        touch "$ROOT/.wheels"
    fi
    printf '%s\n' '#!/bin/sh' \
        '# The arm64 Python under QEMU, named by this script'"'"'s own path so that sys.executable' \
        '# is a file the host can execute.  Written by tools/qemu_aarch64.sh.' \
        "exec qemu-aarch64-static -L \"$ROOT\" -0 \"\$0\" \"$ROOT/usr/bin/python3\" \"\$@\"" \
        > "$PYQEMU"
    chmod +x "$PYQEMU"
    "$PYQEMU" -c 'import platform, sys, numpy
print("arm64 root:", platform.machine(), "Python", sys.version.split()[0],
      "NumPy", numpy.__version__)'
}

stage_build() {
    [ -x "$PYQEMU" ] || { echo "no arm64 root yet: run '$0 root' first" >&2; exit 1; }
    host_tools
    local src="$ROOT/src/fastattn"
    log "copying $REPO to $src"
    rm -rf "$src"
    mkdir -p "$src"
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf -) | tar -xf - -C "$src"

    # The root's sysconfig data names the compiler (aarch64-linux-gnu-gcc), its flags and
    # the extension suffix, and makes setup.py see an aarch64 target.  Its include paths are
    # the root's own /usr/include, so the headers go in CFLAGS, which come before the
    # extension's -I options on the command line: the root's NumPy headers win over those
    # of the host's NumPy that setup.py adds.  Debian's pyconfig.h includes
    # <aarch64-linux-gnu/python3.X/pyconfig.h>: the root's /usr/include is searched for it
    # only after the cross compiler's own headers.
    local sysconfigdata pydir npinc
    sysconfigdata=$(ls "$ROOT"/usr/lib/python3.*/_sysconfigdata__aarch64-linux-gnu.py | tail -n1)
    pydir=$(basename "$(dirname "$sysconfigdata")")
    npinc=$("$PYQEMU" -c 'import numpy; print(numpy.get_include())')
    # The build requirements of pyproject.toml in a venv of their own: the host's python3
    # may have an older setuptools (Debian 12's 66 cannot read project.license).
    local venv="$ROOT/.build-venv"
    if ! "$venv/bin/python" -c 'import Cython, numpy, setuptools' 2>/dev/null; then
        log "build requirements into $venv"
        rm -rf "$venv"
        "$HOST_PY" -m venv "$venv"
        "$venv/bin/python" -m pip install -q "setuptools>=77" "Cython>=3.1" "numpy>=2.0"
    fi
    log "cross-building with $(aarch64-linux-gnu-gcc --version | head -n1)"
    (cd "$src" &&
        PYTHONPATH="$(dirname "$sysconfigdata")" \
        _PYTHON_SYSCONFIGDATA_NAME="$(basename "$sysconfigdata" .py)" \
        _PYTHON_HOST_PLATFORM=linux-aarch64 \
        CFLAGS="-I$ROOT/usr/include/$pydir -I$npinc -idirafter $ROOT/usr/include" \
        "$venv/bin/python" setup.py build_ext --inplace -q)
    ls -l "$src"/fastattn/_kernel_*.so
}

stage_test() {
    [ -n "$(ls "$ROOT"/src/fastattn/fastattn/_kernel_base*.so 2>/dev/null)" ] \
        || { echo "no aarch64 build yet: run '$0 build' first" >&2; exit 1; }
    local args=("$@")
    ((${#args[@]})) || args=("${DEFAULT_TESTS[@]}")
    cd "$ROOT/src/fastattn"
    "$PYQEMU" -c 'import platform, fastattn, fastattn._machine.isa as d
print(platform.machine(), fastattn.__file__, "variant", d.ISA, d.available_variants())'
    "$PYQEMU" -m pytest -p no:cacheprovider -q -rs "${args[@]}"
}

cmd=${1:-all}
[ $# -gt 0 ] && shift
case $cmd in
    root) stage_root ;;
    build) stage_build ;;
    test) stage_test "$@" ;;
    python) cd "$ROOT/src/fastattn" && exec "$PYQEMU" "$@" ;;
    all) stage_root; stage_build; stage_test ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac

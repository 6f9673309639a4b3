#!/usr/bin/env bash
# Wheels of the build requirements the device machine may lack (its setuptools or Cython
# can be older than pyproject.toml asks), for its Python 3.12, into .whl/ (git ignores
# *.whl).  Run here, where the package registries are reachable, then name .whl in the
# device run's carry: tools/amx_device_check.sh installs what it finds there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "setuptools>=77" "Cython>=3.1"
ls .whl

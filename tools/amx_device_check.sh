#!/usr/bin/env bash
# One run on a machine whose CPU has AMX-BF16 (the device machine's Xeon): build, the
# tile tests on the hardware, and thread scaling against torch.  Everything it finds
# goes to $OUT (default /tmp/amx-check): machine.txt, build.log, info.txt, tests.log,
# bench.md, bench.json.  About 5 minutes on 16 cores.
#
#     bash tools/amx_device_check.sh
#
# It needs python3 with NumPy, Cython, setuptools, pytest, torch and ml_dtypes, and a C
# compiler; it installs only the wheels tools/amx_device_wheels.sh put in .whl/ (carry
# .whl), and only under /tmp.  FASTATTN_AMX=1 holds the tile path on for every test and
# the bench (it is the default where the CPU has AMX; the variable makes that explicit).
set -u -o pipefail
OUT=${OUT:-/tmp/amx-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# the in-place build is the fastattn every step imports, tools/amx_bench.py too
export PYTHONUNBUFFERED=1 FASTATTN_AMX=1 OMP_WAIT_POLICY=passive
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# newer build requirements, where tools/amx_device_wheels.sh left them in .whl/
if ls .whl/*.whl > /dev/null 2>&1; then
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/amx-site .whl/*.whl; then
        export PYTHONPATH="$PYTHONPATH:/tmp/amx-site"
    else
        echo "(the carried wheels do not install here: building with what is there)"
    fi
fi

{ lscpu; echo; grep -o -w 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u; echo
  $PY -c "import sys, numpy, torch; print(sys.version); print('numpy', numpy.__version__, 'torch', torch.__version__)"
} > "$OUT/machine.txt" 2>&1
grep -E "Model name|^CPU\(s\)|amx" "$OUT/machine.txt"

echo "== build"
FASTATTN_ISAS=base,avx512 timeout 240 $PY setup.py build_ext --inplace --parallel 2 \
    > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
$PY -m fastattn info | tee "$OUT/info.txt"

echo "== tests on the hardware"
timeout 240 $PY -m pytest -q -p no:cacheprovider -p no:faulthandler -rs tests/test_amx.py \
    tests/test_bf16_products.py tests/test_flash_rule_bf16.py tests/test_kvcache.py \
    2>&1 | tee "$OUT/tests.log" | tail -25

echo "== thread scaling"
timeout 300 $PY tools/amx_bench.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.md"

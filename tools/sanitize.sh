#!/usr/bin/env bash
# Build fastattn with AddressSanitizer + UndefinedBehaviorSanitizer in a scratch clone and
# run a test subset under it; then a valgrind memcheck pass over a few small calls.
#
#   tools/sanitize.sh [--no-valgrind] [--keep] [pytest args...]
#
# Works from a clean clone of the repository's committed HEAD (uncommitted changes are not
# seen: commit first), never touches the work tree's build. Needs gcc (libasan/libubsan)
# and, for the second pass, valgrind. Exit status: 0 clean, 1 a sanitizer or valgrind
# finding or a failing test.
#
# Why the settings:
#   -fno-sanitize-recover=all   any UB report aborts the process (pytest then fails
#                                loudly) instead of printing a line that nobody reads.
#   LD_PRELOAD=libasan.so        CPython itself is not instrumented; ASan must come first.
#   detect_leaks=0               CPython keeps interned objects alive on purpose at exit;
#                                leaks are checked by tools/leakcheck.py instead.
#   FASTATTN_ISAS=base,avx2[,avx512]  the portable kernel, the one most machines run and,
#                                where this CPU has AVX-512 (F/BW/DQ/VL), the server CPUs' one;
#                                FASTATTN_ISA forces each in turn.  valgrind emulates no
#                                AVX-512 (its CPUID hides it), so its pass covers base, avx2.
#   PYTHONMALLOC=malloc          (valgrind) pymalloc's arenas hide heap errors from it.
#   default test subset          the kernel and front-end tests; not the timing, peak-memory
#                                and RSS-leak tests (ASan's quarantine and shadow memory
#                                change RSS by design) nor the per-ISA subprocess test.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
valgrind=1
keep=0
pytest_args=()
for a in "$@"; do
    case "$a" in
        --no-valgrind) valgrind=0 ;;
        --keep) keep=1 ;;
        *) pytest_args+=("$a") ;;
    esac
done
if [ ${#pytest_args[@]} -eq 0 ]; then
    pytest_args=(tests/test_attention.py tests/test_arguments.py
                 tests/test_properties.py tests/test_reproducibility.py
                 tests/test_score_modifiers.py tests/test_hardening.py tests/test_half.py
                 tests/test_backward.py
                 tests/test_bf16_products.py tests/test_kvcache.py tests/test_plan.py
                 tests/test_cache_formats.py tests/test_amx.py tests/test_paths_fuzz.py
                 tests/test_int8_dot.py
                 -k "not every_isa_variant and not peak_memory and not two_threads_overlap and not no_leak and not no_float32_copy and not memory_is_not_quadratic and not flash_attn_kvcache_cases and not read_in_place")
fi

work="$(mktemp -d /tmp/fastattn-san.XXXXXX)"
cleanup() { if [ "$keep" = 0 ]; then rm -rf "$work"; else echo "kept $work"; fi; }
trap cleanup EXIT

# The real interpreter, not a pyenv/asdf shim script (LD_PRELOAD must reach Python).
py="$(python -c 'import sys; print(sys.executable)')"
# The build requirements of pyproject.toml, in this interpreter (the in-place builds below
# do not get pip's isolated build environment), and ml_dtypes, whose float8 and bfloat16
# arrays the fp8 caches' and 16-bit tests need (they skip without it); a no-op when they
# are already there.
"$py" -m pip install -q --disable-pip-version-check "setuptools>=77" "Cython>=3.1" "numpy>=2.0" \
    "ml_dtypes>=0.5" || { echo "cannot install the build requirements"; exit 1; }
isas=(avx2 base)
if grep -qw avx512f /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo \
        && grep -qw avx512dq /proc/cpuinfo && grep -qw avx512vl /proc/cpuinfo; then
    isas=(avx512 avx2 base)
else
    echo "== this CPU has no AVX-512 (F/BW/DQ/VL): the avx512 kernel is not sanitized here"
fi
build_isas="$(IFS=,; echo "${isas[*]}")"
t0=$(date +%s)
git clone -q "$here" "$work/src"
cd "$work/src"
echo "== building with -fsanitize=address,undefined in $work/src ($(git log --oneline -1))"
san="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
CFLAGS="$san" LDFLAGS="$san" FASTATTN_ISAS="$build_isas" \
    "$py" setup.py build_ext --inplace -j 2 > "$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log"; echo "sanitizer build failed"; exit 1; }
t1=$(date +%s)
echo "   built in $((t1 - t0)) s"
# Guard against a silently uninstrumented build (e.g. CFLAGS not reaching the compiler).
# Whole outputs first: under pipefail, `ldd "$so" | grep -q libasan` fails when grep exits
# at its first match while ldd is still writing (SIGPIPE) -- 39 times in 300 with both cores
# busy, on a build linked with libasan; a CI run stopped here that way.
for so in fastattn/_kernel_*.so; do
    libs="$(ldd "$so")" || { echo "ldd $so failed"; exit 1; }
    syms="$(nm -D "$so")" || { echo "nm -D $so failed"; exit 1; }
    grep -q libasan <<< "$libs" || { echo "$so is not linked with libasan"; exit 1; }
    grep -q __ubsan_handle <<< "$syms" || { echo "$so has no UBSan checks"; exit 1; }
done

status=0
libasan="$(gcc -print-file-name=libasan.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_string_checks=1:check_initialization_order=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
for isa in "${isas[@]}"; do
    if [ "$isa" = avx2 ] && ! grep -q avx2 /proc/cpuinfo; then continue; fi
    echo "== pytest under ASan+UBSan, FASTATTN_ISA=$isa: ${pytest_args[*]}"
    rc=0
    # --capture=sys: a sanitizer writes its report to fd 2 and aborts; with pytest's
    # default fd capture that report would die with the test's capture file.
    # The differential fuzzer's budget is smaller here: each case runs ~10x slower.
    FASTATTN_FUZZ_CASES=${FASTATTN_FUZZ_CASES:-300} \
    FASTATTN_ISA=$isa LD_PRELOAD="$libasan" "$py" -m pytest -q -x -p no:cacheprovider --capture=sys \
        "${pytest_args[@]}" > "$work/pytest-$isa.log" 2>&1 || rc=$?
    tail -5 "$work/pytest-$isa.log"
    if [ "$rc" != 0 ] || grep -qE "ERROR: AddressSanitizer|runtime error:" "$work/pytest-$isa.log"; then
        echo "-- FAILED (pytest exit $rc); sanitizer reports:"
        grep -E -A30 "ERROR: AddressSanitizer|runtime error:" "$work/pytest-$isa.log" | head -80 || true
        status=1
    fi
done
t2=$(date +%s)
echo "   sanitizer tests took $((t2 - t1)) s"

if [ "$valgrind" = 1 ]; then
    if ! command -v valgrind > /dev/null; then
        echo "valgrind not installed: memcheck pass skipped"
    else
        # A plain (uninstrumented) build: valgrind and ASan do not mix.
        git clean -qfdx fastattn build src
        git checkout -q -- .
        FASTATTN_ISAS=base,avx2 "$py" setup.py build_ext --inplace > "$work/build2.log" 2>&1 \
            || { tail -30 "$work/build2.log"; echo "plain build failed"; exit 1; }
        cat > "$work/calls.py" <<'EOF'
import numpy as np
import fastattn
rng = np.random.default_rng(0)
f = lambda *s, dt=np.float32: rng.standard_normal(s).astype(dt)
q, k, v = f(2, 4, 37, 16), f(2, 2, 70, 16), f(2, 2, 70, 9)
out = np.empty((2, 4, 37, 9), np.float32)
for n in (1, 2):
    with fastattn.num_threads(n):
        fastattn.attention(q, k, v, causal=True, return_lse=True)
        fastattn.attention(q, k, v, out=out, window=(20, 3), mask=rng.random((37, 70)) < 0.7)
        fastattn.attention(q.astype(np.float64), k, v, kv_lengths=np.array([70, 5]))
        fastattn.attention(q.astype(np.float16)[:, :, :1], k.astype(np.float16), v.astype(np.float16))
        fastattn.attention(q[..., ::-1, :], np.swapaxes(np.swapaxes(k, -1, -2).copy(), -1, -2), v[..., ::2])
        fastattn.attention(f(1, 5), f(0, 5), f(0, 3))
        fastattn.attention(f(0, 5), f(3, 5), f(3, 3))
        fastattn.attention_weights(q, k, causal=True)
        fastattn.attention(q, k, v, causal=True, softcap=2.0, alibi_slopes=[0.5, 0.25, 0.1, 0.05],
                           sinks=f(2, 4, dt=np.float64), q_lengths=np.array([37, 3]),
                           kv_lengths=np.array([70, 9]), return_lse=True)
        fastattn.attention_varlen(q[0], k[0], v[0], [0, 30, 30, 37], [0, 50, 55, 70], causal=True,
                                  return_lse=True)
        fastattn.softmax(f(4, 6))
for bad in (dict(kv_lengths=np.array([99, 1])), dict(window=(-3, 0)), dict(out=out[..., :3])):
    try:
        fastattn.attention(q, k, v, **bad)
    except (ValueError, TypeError):
        pass
print("calls done")
EOF
        echo "== valgrind memcheck on $work/calls.py"
        PYTHONMALLOC=malloc OMP_NUM_THREADS=2 PYTHONPATH="$work/src" valgrind --tool=memcheck \
            --errors-for-leak-kinds=none --track-origins=yes --num-callers=30 \
            --log-file="$work/valgrind.log" "$py" "$work/calls.py" > "$work/valgrind.out" 2>&1 \
            || { cat "$work/valgrind.out"; status=1; }
        # CPython itself reports a few known uninitialised-value errors under memcheck
        # (e.g. int.from_bytes when seeding random; see CPython's Misc/valgrind-python.supp).
        # Count only the errors with fastattn's extension (or its origin) in the stack.
        cat > "$work/vgcount.py" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
blocks = re.split(r"\n==\d+== \n", text)
kinds = r"^==\d+== (Invalid|Conditional|Use of|Syscall|Mismatched|Source and|Argument)"
errors = [b for b in blocks if re.search(kinds, b, re.M)]
ours = [b for b in errors if "_kernel_" in b or "fastattn" in b]
summary = re.findall(r"ERROR SUMMARY: .*", text)
print(f"   memcheck: {len(errors)} error contexts in all, {len(ours)} in fastattn; "
      + (summary[-1] if summary else "no summary"))
for b in ours[:5]:
    print(b)
sys.exit(1 if ours else 0)
EOF
        "$py" "$work/vgcount.py" "$work/valgrind.log" || status=1
        t3=$(date +%s)
        echo "   valgrind took $((t3 - t2)) s"
    fi
fi
echo "== sanitize.sh: $([ $status = 0 ] && echo clean || echo FINDINGS) in $(( $(date +%s) - t0 )) s"
exit $status

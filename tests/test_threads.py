"""fastattn's thread pool: thread counts, threadpoolctl, fork, and many calls in a row.

Results are compared byte for byte with a one-thread call: the pool must never change a
result, only who computes it.  Checks that need a fresh interpreter (which pool workers
exist, what is imported) run in a subprocess.
"""
import os
import textwrap

import numpy as np
import pytest

import fastattn
from fastattn._dispatch import kernel

from conftest import make_qkv, qkv_shapes, run_python

POOL = kernel.pool_info()["backend"]


def fresh_python(code):
    """Run ``code`` in a fresh interpreter at its default thread count; its stdout."""
    return run_python("-c", textwrap.dedent(code), env={"OMP_NUM_THREADS": None},
                      timeout=300).stdout


def _inputs(seed=0, L=300, Lk=700):
    return make_qkv(np.random.default_rng(seed), *qkv_shapes((2,), 4, 2, L, Lk, 64))


def test_many_calls_of_every_size_match_one_thread():
    # Back-to-back calls of very different sizes (a few items, many items, flash-decoding
    # splits) exercise a worker that wakes late for one call while the next one opens.
    rng = np.random.default_rng(3)
    cases = []
    for Lq, Lk, Hq, Hkv in [(1, 3000, 4, 1), (5, 40, 8, 8), (200, 200, 4, 2), (1, 70, 2, 2)]:
        q = rng.standard_normal((Hq, Lq, 32)).astype(np.float32)
        k = rng.standard_normal((Hkv, Lk, 32)).astype(np.float32)
        v = rng.standard_normal((Hkv, Lk, 32)).astype(np.float32)
        with fastattn.num_threads(1):
            cases.append(((q, k, v), fastattn.attention(q, k, v, causal=True)))
    with fastattn.num_threads(4):
        for i in range(400):
            (q, k, v), want = cases[i % len(cases)]
            got = fastattn.attention(q, k, v, causal=True)
            assert got.tobytes() == want.tobytes(), f"call {i}"


@pytest.mark.skipif(not hasattr(os, "fork") or POOL != "pthreads",
                    reason="needs fork() and the pthreads pool")
def test_fork_child_gets_its_own_workers():
    # After fork() only the forking thread exists: the child must not wait for the
    # parent's workers, and it computes the same bytes.
    out = fresh_python("""
        import os, numpy as np, fastattn
        from fastattn._dispatch import kernel
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((8, 256, 64)).astype(np.float32) for _ in range(3))
        with fastattn.num_threads(2):
            want = fastattn.attention(q, k, v)
            assert kernel.pool_info()["workers"] >= 1
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                got = fastattn.attention(q, k, v)
                ok = got.tobytes() == want.tobytes() and kernel.pool_info()["workers"] >= 1
                os.write(w, b"ok" if ok else b"bad")
                os._exit(0)
            os.close(w)
            print(os.read(r, 8).decode())
            os.waitpid(pid, 0)
    """)
    assert out.split() == ["ok"]


def test_import_does_not_import_threadpoolctl():
    out = fresh_python("import sys, fastattn; print('threadpoolctl' in sys.modules)")
    assert out.split() == ["False"]


# --------------------------------------------------------------------------- threadpoolctl

def _fastattn_entries(threadpoolctl):
    return [i for i in threadpoolctl.threadpool_info() if i["internal_api"] == "fastattn"]


def test_threadpool_info_lists_the_pool():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not hasattr(threadpoolctl, "register"):
        pytest.skip("threadpoolctl without custom controllers (< 3.5)")
    entries = _fastattn_entries(threadpoolctl)
    assert len(entries) == 1
    assert entries[0]["num_threads"] == fastattn.get_num_threads()
    assert entries[0]["filepath"] == os.path.realpath(kernel.__file__)
    assert entries[0]["version"] == fastattn.__version__


def test_threadpool_limits_caps_and_restores():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not hasattr(threadpoolctl, "register"):
        pytest.skip("threadpoolctl without custom controllers (< 3.5)")
    before = fastattn.get_num_threads()
    try:
        fastattn.set_num_threads(3)
        with threadpoolctl.threadpool_limits(1):
            assert fastattn.get_num_threads() == 1
            with fastattn.num_threads(2):        # a cap holds for the per-thread setting too
                assert fastattn.get_num_threads() == 1
            assert _fastattn_entries(threadpoolctl)[0]["num_threads"] == 1
        assert fastattn.get_num_threads() == 3
        with threadpoolctl.threadpool_limits(2, user_api="blas"):
            assert fastattn.get_num_threads() == 3
        with threadpoolctl.threadpool_limits({"fastattn": 2}):
            assert fastattn.get_num_threads() == 2
            fastattn.set_num_threads(1)          # below the cap: taken as is
            assert fastattn.get_num_threads() == 1
            fastattn.set_num_threads(3)
        assert fastattn.get_num_threads() == 3
    finally:
        fastattn.set_num_threads(before)


@pytest.mark.skipif(POOL != "pthreads", reason="counts the pthreads pool's workers")
@pytest.mark.parametrize("order", ["fastattn first", "threadpoolctl first"])
def test_threadpool_limits_one_starts_no_worker(order):
    pytest.importorskip("threadpoolctl")
    imports = ("import fastattn, threadpoolctl" if order == "fastattn first"
               else "import threadpoolctl, fastattn")
    out = fresh_python(imports + textwrap.dedent("""
        import numpy as np
        from fastattn._dispatch import kernel
        if not hasattr(threadpoolctl, "register"):
            print("skip"); raise SystemExit
        fastattn.set_num_threads(2)
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((8, 512, 64)).astype(np.float32) for _ in range(3))
        with threadpoolctl.threadpool_limits(1):
            one = fastattn.attention(q, k, v)
            print(kernel.pool_info()["workers"])
        two = fastattn.attention(q, k, v)
        print(kernel.pool_info()["workers"], one.tobytes() == two.tobytes())
    """))
    if out.split() == ["skip"]:
        pytest.skip("threadpoolctl without custom controllers (< 3.5)")
    assert out.split() == ["0", "1", "True"]


def test_lean_path_asks_for_the_thread_count_only_when_work_can_be_shared():
    # The front end passes get_num_threads itself; one tile of rows and keys runs on one
    # thread without asking, a call with more work asks once.
    asked = []

    def n_threads():
        asked.append(1)
        return 2

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 6, 3)).astype(np.float32) for _ in range(3))
    one_tile = kernel.attention_fast(q, k, v, None, False, False, None, n_threads)
    np.testing.assert_allclose(one_tile, fastattn.reference.attention(q, k, v), rtol=1e-5, atol=1e-6)
    assert asked == []
    q, k, v = _inputs()
    shared = kernel.attention_fast(q, k, v, None, True, False, None, n_threads)
    assert asked == [1]
    with fastattn.num_threads(1):
        assert shared.tobytes() == fastattn.attention(q, k, v, causal=True).tobytes()

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
from fastattn._machine.isa import kernel

from conftest import make_qkv, run_python

POOL = kernel.pool_info()["backend"]


def fresh_python(code):
    """Run ``code`` in a fresh interpreter at its default thread count and pool choice;
    its stdout."""
    return run_python("-c", textwrap.dedent(code),
                      env={"OMP_NUM_THREADS": None, "FASTATTN_POOL": None}, timeout=300).stdout


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
        from fastattn._machine.isa import kernel
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
        from fastattn._machine.isa import kernel
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

    q, k, v = make_qkv(0, batch=(1,), Lq=6, D=3)
    one_tile = kernel.attention_fast(q, k, v, None, False, False, None, n_threads)
    np.testing.assert_allclose(one_tile, fastattn.reference.attention(q, k, v), rtol=1e-5, atol=1e-6)
    assert asked == []
    q, k, v = make_qkv(0, batch=(2,), Hq=4, Hkv=2, Lq=300, Lk=700, D=64)
    shared = kernel.attention_fast(q, k, v, None, True, False, None, n_threads)
    assert asked == [1]
    with fastattn.num_threads(1):
        assert shared.tobytes() == fastattn.attention(q, k, v, causal=True).tobytes()


# --------------------------------------------------------------------------- OpenMP team
# Calls made from inside torch can run on the calling thread's OpenMP team (torch's)
# instead of the pool (FASTATTN_POOL, fastattn/_machine/threads.py).

TEAM = kernel.build_info()["openmp"] and POOL == "pthreads"
needs_team = pytest.mark.skipif(not TEAM, reason="needs the pthreads pool built with OpenMP")


@pytest.fixture
def pool_choice():
    """Set the pool choice for a test (fastattn._machine.threads._set_pool), restored after."""
    before = fastattn._machine.threads._pool
    yield fastattn._machine.threads._set_pool
    fastattn._machine.threads._set_pool(before)


@needs_team
def test_calls_on_the_openmp_team_match_one_thread(pool_choice):
    rng = np.random.default_rng(5)
    cases = []
    for Lq, Lk, Hq, Hkv in [(1, 3000, 4, 1), (200, 200, 4, 2), (130, 90, 2, 2)]:
        q = rng.standard_normal((2, Hq, Lq, 32)).astype(np.float32)
        k = rng.standard_normal((2, Hkv, Lk, 32)).astype(np.float32)
        v = rng.standard_normal((2, Hkv, Lk, 32)).astype(np.float32)
        dout = rng.standard_normal(q.shape).astype(np.float32)
        with fastattn.num_threads(1):
            out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
            grads = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
        cases.append(((q, k, v, dout, out, lse), (out,) + tuple(grads)))
    pool_choice("openmp")
    assert fastattn._machine.threads.pool_team() == "always"
    for n in (2, 3, 4):
        with fastattn.num_threads(n):
            for (q, k, v, dout, out, lse), want in cases:
                got = (fastattn.attention(q, k, v, causal=True),) + tuple(
                    fastattn.attention_backward(dout, q, k, v, out, lse, causal=True))
                for g, w in zip(got, want):
                    assert g.tobytes() == w.tobytes(), n


def test_pool_choice_is_checked(pool_choice):
    with pytest.raises(ValueError, match="auto, own, openmp"):
        pool_choice("torch")
    assert "FASTATTN_POOL='sometimes'" in run_python(
        "-c", "import fastattn", env={"FASTATTN_POOL": "sometimes"}, check=False).stderr


@needs_team
def test_own_and_openmp_choices_hold_whatever_is_imported(pool_choice):
    pool_choice("own")
    assert fastattn._machine.threads.pool_team() == "never"
    with fastattn._machine.threads.in_torch():
        assert fastattn._machine.threads.pool_team() == "never"
    pool_choice("openmp")
    assert fastattn._machine.threads.pool_team() == "always"


def test_in_torch_marks_the_calling_thread_and_restores():
    assert kernel.pool_set_in_torch(False) == 0
    with fastattn._machine.threads.in_torch():
        with fastattn._machine.threads.in_torch():
            pass
        assert kernel.pool_set_in_torch(True) == 1    # still marked after the inner block
    assert kernel.pool_set_in_torch(False) == 0


@needs_team
@pytest.mark.parametrize("order", ["fastattn first", "torch first"])
def test_auto_runs_the_torch_integrations_on_torchs_team(order):
    # Once torch is imported (before or after fastattn), the torch operation's calls run
    # on the OpenMP team: fastattn's pool starts no worker for them.  A plain call still
    # uses the pool.
    pytest.importorskip("torch")
    imports = "import fastattn, torch" if order == "fastattn first" else "import torch, fastattn"
    out = fresh_python(f"""
        {imports}
        from fastattn._machine.isa import kernel
        from fastattn._machine import threads as _threads
        from fastattn.integrations import torch as fa_torch
        print(_threads.pool_team() if _threads._torch_shares_openmp(torch) else "skip")
        q = torch.randn(2, 4, 200, 32)
        with fastattn.num_threads(2), torch.inference_mode():
            a = fa_torch.attention(q, q, q, causal=True)
            print(kernel.pool_info()["workers"])
            b = fastattn.attention(q.numpy(), q.numpy(), q.numpy(), causal=True)
            print(kernel.pool_info()["workers"], a.numpy().tobytes() == b.tobytes())
    """)
    if out.split()[0] == "skip":
        pytest.skip("torch does not run on this build's OpenMP library")
    assert out.split() == ["in", "torch", "0", "1", "True"]


@needs_team
def test_auto_without_torch_uses_the_pool():
    out = fresh_python("""
        import sys, fastattn
        print(fastattn._machine.threads.pool_team(), "torch" in sys.modules)
    """)
    assert out.split() == ["never", "False"]


@pytest.mark.skipif(not hasattr(os, "fork") or not TEAM,
                    reason="needs fork() and the pthreads pool built with OpenMP")
def test_fork_child_leaves_the_openmp_team():
    # The OpenMP library of a forked child may still count the parent's team threads,
    # which the child does not have: the child's calls use fastattn's pool.
    out = fresh_python("""
        import os, numpy as np, fastattn
        from fastattn._machine import threads as _threads
        from fastattn._machine.isa import kernel
        _threads._set_pool("openmp")
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((8, 256, 64)).astype(np.float32) for _ in range(3))
        with fastattn.num_threads(2):
            want = fastattn.attention(q, k, v)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                got = fastattn.attention(q, k, v)
                ok = (got.tobytes() == want.tobytes() and _threads.pool_team() == "never"
                      and kernel.pool_info()["workers"] >= 1)
                os.write(w, b"ok" if ok else b"bad")
                os._exit(0)
            os.close(w)
            print(os.read(r, 8).decode(), _threads.pool_team())
            os.waitpid(pid, 0)
    """)
    assert out.split() == ["ok", "always"]


def test_num_threads_context_restores():
    before = fastattn.get_num_threads()
    with fastattn.num_threads(1):
        assert fastattn.get_num_threads() == 1
    assert fastattn.get_num_threads() == before

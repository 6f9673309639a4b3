"""fastattn.integrations.dask on a real cluster: 2 worker processes, 1 thread each.

Every result is compared with the single-process fastattn.attention call on the same NumPy
arrays: bitwise where the keys are in one chunk (each block is the same kernel call on the
same rows, and a row's bits do not depend on the thread count or the rows beside it), and
within conftest's tolerance where key chunks are merged.  One cluster serves the module
(starting one costs a few seconds); the worker-failure test waits for the nanny to bring
the killed worker back before it ends.
"""
import logging
import os
import pickle
import signal
import time

import numpy as np
import pytest

from conftest import assert_close, import_optional, make_qkv

distributed = import_optional("distributed")
da = import_optional("dask.array")
import dask  # noqa: E402

import fastattn  # noqa: E402
from fastattn import reference  # noqa: E402
from fastattn.integrations import dask as fa_dask  # noqa: E402


def _worker_facts():
    import fastattn as fa
    from fastattn._machine.isa import kernel

    return dict(file=fa.__file__, omp=os.environ.get("OMP_NUM_THREADS"),
                threads=fa.get_num_threads(), pool_workers=kernel.pool_info()["workers"],
                pid=os.getpid())


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=":0", silence_logs=logging.ERROR)
    with cluster, distributed.Client(cluster) as c:
        c.wait_for_workers(2, timeout=60)
        facts = c.run(_worker_facts)
        assert len(facts) == 2, f"the cluster must have 2 workers: {facts}"
        # The workers must run the fastattn under test, or "bitwise equal" means nothing.
        assert {f["file"] for f in facts.values()} == {fastattn.__file__}, facts
        yield c


def rows(rng, batch=6, Hq=8, Hkv=2, Lq=33, Lk=70, D=32, Dv=16, dtype=np.float32):
    return make_qkv(rng, (batch, Hq, Lq, D), (batch, Hkv, Lk, D), (batch, Hkv, Lk, Dv), dtype)


def chunked(q, k, v, batch=2, heads=4, keys=None):
    G = q.shape[-3] // k.shape[-3]
    keys = keys or k.shape[-2]
    return (da.from_array(q, chunks=(batch, heads, -1, -1)),
            da.from_array(k, chunks=(batch, heads // G, keys, -1)),
            da.from_array(v, chunks=(batch, heads // G, keys, -1)))


# --------------------------------------------------------------------------- threads

def test_each_worker_runs_one_thread(client, rng):
    # The nanny sets OMP_NUM_THREADS=1 in every worker process; fastattn's default honours
    # it, and its pool never starts a second thread there, even after calls ran.
    q, k, v = chunked(*rows(rng))
    fa_dask.attention(q, k, v, causal=True).compute()
    for facts in client.run(_worker_facts).values():
        assert facts["omp"] == "1"
        assert facts["threads"] == 1
        assert facts["pool_workers"] == 0
    in_task = client.gather(client.map(lambda _: fastattn.get_num_threads(), range(4)))
    assert in_task == [1, 1, 1, 1]


# --------------------------------------------------------------------------- one chunk of keys

@pytest.mark.parametrize("keywords", [
    dict(), dict(causal=True), dict(window=(5, 0), softcap=20.0),
    dict(kv_lengths=np.array([70, 0, 12, 70, 33, 1]), causal="top-left"),
    dict(sinks=np.linspace(-1, 2, 8), alibi_slopes=np.linspace(0.1, 0.8, 8), causal=True),
    dict(q_lengths=np.array([33, 4, 0, 10, 33, 2]), causal=True),
])
def test_batch_and_head_chunks_are_bitwise(client, rng, keywords):
    q, k, v = rows(rng)
    expected, expected_lse = fastattn.attention(q, k, v, return_lse=True, **keywords)
    out, lse = fa_dask.attention(*chunked(q, k, v), return_lse=True, **keywords)
    assert out.chunks[:2] == ((2, 2, 2), (4, 4))
    out, lse = dask.compute(out, lse)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(lse, expected_lse)
    np.testing.assert_array_equal(fa_dask.attention(*chunked(q, k, v), **keywords).compute(),
                                  expected)


def test_numpy_inputs_broadcast_batch_and_mask(client, rng):
    q = rng.standard_normal((4, 3, 8, 16)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 3, 20, 16)).astype(np.float32)   # batch broadcast
    mask = rng.random((4, 1, 8, 20)) < 0.8                             # heads broadcast
    out = fa_dask.attention(da.from_array(q, chunks=(1, 3, 8, 16)), k, v, mask=mask)
    np.testing.assert_array_equal(out.compute(), fastattn.attention(q, k, v, mask=mask))
    # NumPy in, one block: the same call on a worker.
    np.testing.assert_array_equal(fa_dask.attention(q[0], k[0], v[0]).compute(),
                                  fastattn.attention(q[0], k[0], v[0]))
    np.testing.assert_array_equal(fa_dask.attention(q[0, 0], k[0, 0], v[0, 0]).compute(),
                                  fastattn.attention(q[0, 0], k[0, 0], v[0, 0]))


@pytest.mark.parametrize("keys", [40, 15])
def test_no_batch_axes(rng, keys):
    # (H, L, D) inputs: the per-batch keyword arrays are 0-d.
    q, k, v = make_qkv(rng, (4, 6, 16), (2, 40, 16), (2, 40, 8))
    kd, vd = (da.from_array(a, chunks=(1, keys, -1)) for a in (k, v))
    keywords = dict(kv_lengths=30, q_lengths=5, sinks=np.ones(4), causal=True)
    out, lse = dask.compute(*fa_dask.attention(q, kd, vd, return_lse=True, **keywords),
                            scheduler="synchronous")
    expected, expected_lse = fastattn.attention(q, k, v, return_lse=True, **keywords)
    assert_close(out, expected)
    assert_close(lse, expected_lse, scale=10.0)


def test_head_chunks_keep_gqa_groups(rng):
    q, k, v = rows(rng, Hq=12, Hkv=3)               # groups of 4 query heads
    qd = da.from_array(q, chunks=(3, 5, -1, -1))     # 5 heads would split a group
    out = fa_dask.attention(qd, k, v)
    assert all(c % 4 == 0 for c in out.chunks[1]), out.chunks
    np.testing.assert_array_equal(out.compute(scheduler="synchronous"),
                                  fastattn.attention(q, k, v))


# --------------------------------------------------------------------------- key chunks

@pytest.mark.parametrize("keywords", [
    dict(), dict(causal=True), dict(window=(6, 3)), dict(window=(40, 0), causal=True),
    dict(causal=True, kv_lengths=np.array([70, 0, 12, 70, 33, 1])),
    dict(sinks=np.linspace(-1, 2, 8), causal=True),
    dict(q_lengths=np.array([33, 4, 0, 10, 33, 2]), causal=True, softcap=5.0),
])
def test_key_chunks_merge_to_one_call(client, rng, keywords):
    q, k, v = rows(rng)
    expected, expected_lse = fastattn.attention(q, k, v, return_lse=True, **keywords)
    out, lse = fa_dask.attention(*chunked(q, k, v, keys=16), return_lse=True, split_every=2,
                                 **keywords)
    out, lse = dask.compute(out, lse)
    assert_close(out, expected)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    assert_close(lse, expected_lse, scale=10.0)


def test_key_chunks_float16_and_masks(client, rng):
    q, k, v = rows(rng, dtype=np.float16)
    mask = rng.standard_normal((6, 1, 33, 70)).astype(np.float32)
    mask[..., 3] = -np.inf
    for m in (mask, mask > 0):
        out = fa_dask.attention(*chunked(q, k, v, keys=25), mask=m, causal=True).compute()
        assert out.dtype == np.float16
        assert_close(out, fastattn.attention(q, k, v, mask=m, causal=True))


def test_decode_over_a_sharded_cache(client, rng):
    # One new token against 2 cache shards, a task per shard.  float32's own error: the one
    # call is ~1e-6 of max|out| away from the float64 result; the merge must be as close.
    q, k, v = make_qkv(rng, (1, 32, 1, 128), (1, 8, 1024, 128), (1, 8, 1024, 128))
    qd = da.from_array(q)
    kd, vd = (da.from_array(a, chunks=(1, 8, 512, 128)) for a in (k, v))
    out = fa_dask.attention(qd, kd, vd).compute()
    one = fastattn.attention(q, k, v)
    exact = reference.attention(*(a.astype(np.float64) for a in (q, k, v)))
    error = lambda a, b: np.abs(a - b).max() / np.abs(b).max()  # noqa: E731
    assert error(out, exact) <= 1.5 * error(one, exact)
    assert error(out, one) <= 2e-6


def _benchmark(name):
    """A script of benchmarks/ as a module, left out of sys.modules, so that the functions
    it sends to the workers travel by value (the workers cannot import it by name)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_decode_step_right_after_a_restart(client):
    """benchmarks/dask_scaling.py's decode step (tiny shapes) while the workers come back
    from a restart and the scheduler lists none yet: the step waits for its 2 workers,
    builds one shard on each, and merges the two partial results."""
    bench = _benchmark("dask_scaling")
    client.restart(wait_for_workers=False)
    errors = bench.decode_step(client, steps=2, shape=(4, 64, 16))
    # float32's own error: the merge is as close to the float64 result as one call is.
    for name in ("merged", "graph"):
        assert errors[name] <= 2e-6, errors
        assert errors[f"{name}_vs_float64"] <= 2 * errors["one_vs_float64"] + 1e-7, errors


def test_docstring_example():
    import doctest

    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = doctest.DocTestFinder().find(fa_dask.attention, "attention", globs={"np": np})
    assert tests and tests[0].examples
    for t in tests:
        runner.run(t)
    assert runner.failures == 0


def test_errors_before_any_task(rng):
    q, k, v = rows(rng)
    with pytest.raises(ValueError, match="k.shape=.*v.shape"):
        fa_dask.attention(q, k, v[..., :5, :])
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        fa_dask.attention(*chunked(q, k, v, keys=35), alibi_slopes=np.ones(8))
    with pytest.raises(TypeError, match="kv_lengths must be a NumPy array"):
        fa_dask.attention(q, k, v, kv_lengths=da.from_array(np.arange(6)))
    with pytest.raises(ValueError, match="kv_lengths must lie in"):
        fa_dask.attention(q, k, v, kv_lengths=np.full(6, 71))


# --------------------------------------------------------------------------- models

def test_layers_pickle_and_run_on_workers(client, rng):
    mha = fastattn.MultiHeadAttention(64, 8, n_kv_heads=2, seed=0)
    cache = fastattn.KVCache(capacity=8)
    prompt, step = rng.standard_normal((2, 1, 20, 64)).astype(np.float32)
    mha(prompt, cache=cache, causal=True)
    mha2, cache2 = pickle.loads(pickle.dumps((mha, cache)))
    # The copies decode the next token exactly as the originals do.
    a, _ = mha(step[:, :1], cache=cache)
    b, _ = mha2(step[:, :1], cache=cache2)
    np.testing.assert_array_equal(a, b)
    assert cache2.lengths.tolist() == cache.lengths.tolist()
    # A model scattered to the workers runs there (projections through each worker's BLAS).
    remote = client.scatter(mha, broadcast=True)
    prompts = rng.standard_normal((4, 12, 64)).astype(np.float32)
    futures = client.map(lambda m, x: m(x, causal=True), [remote] * 4, list(prompts))
    for x, y in zip(prompts, client.gather(futures)):
        np.testing.assert_allclose(y, mha(x, causal=True), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- failures

def test_worker_killed_mid_computation(client):
    """SIGKILL one worker while the graph runs: dask reruns its lost tasks, and the result
    equals the single-process call bitwise (no block lost, none counted twice).  The inputs
    are generated on the workers (seeded per block), so the victim loses inputs too."""
    gen = da.random.default_rng(7)
    q, k, v = (gen.standard_normal((16, 8, 1024, 64), chunks=(1, 2, -1, -1), dtype=np.float32)
               for _ in range(3))
    expected = fastattn.attention(*dask.compute(q, k, v), causal=True)
    out = fa_dask.attention(q, k, v, causal=True)
    client.wait_for_workers(2, timeout=60)      # an earlier test may have restarted them
    pids = {addr: f["pid"] for addr, f in client.run(_worker_facts).items()}
    assert len(pids) == 2, f"the cluster must have 2 workers: {pids}"
    victim = sorted(pids)[0]
    future = client.compute(out)
    deadline = time.monotonic() + 30
    # Wait until the victim holds finished blocks, so that killing it loses results.
    while not any(client.has_what().get(victim, ())):
        assert time.monotonic() < deadline, "no task finished on the victim worker"
        time.sleep(0.005)
    assert not future.done(), "the graph finished before the worker could be killed"
    os.kill(pids[victim], signal.SIGKILL)
    result = future.result(timeout=60)
    np.testing.assert_array_equal(result, expected)
    client.wait_for_workers(2, timeout=30)
    new_pids = {f["pid"] for f in client.run(_worker_facts).values()}
    assert pids[victim] not in new_pids and len(new_pids) == 2


# --------------------------------------------------------------------------- the docs

def test_docs_examples_run():
    """The cluster examples of docs/beyond-one-machine.md run as printed, each in a fresh
    interpreter (they start their own cluster), and print what the page says they print."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "beyond-one-machine.md").read_text(encoding="utf-8")
    examples = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "LocalCluster" in b]
    assert len(examples) == 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    for code in examples:
        res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        printed = res.stdout.split()
        claimed = re.search(r"print\(.*\)\s+# (.*)\n", code).group(1).split()
        if printed[0].startswith("("):       # the batch example: shape, then difference
            assert printed[:2] == claimed[:2] and float(printed[2]) <= 1e-6, res.stdout
        else:                                # the decode example: relative error
            assert float(printed[0]) <= 1e-6, res.stdout


def test_threads_per_task(rng, monkeypatch):
    # Under dask's local threaded scheduler no nanny sets OMP_NUM_THREADS: threads= does.
    seen = []
    attention = fastattn.attention

    def spy(*args, **keywords):
        seen.append(fastattn.get_num_threads())
        return attention(*args, **keywords)

    monkeypatch.setattr(fastattn, "attention", spy)
    q, k, v = rows(rng)
    with fastattn.num_threads(2):
        for keys, threads, expected in ((None, 1, 1), (35, 1, 1), (None, None, 2)):
            seen.clear()
            out = fa_dask.attention(*chunked(q, k, v, keys=keys), threads=threads)
            out.compute(scheduler="synchronous")
            assert seen and set(seen) == {expected}, (keys, threads, seen)
    with pytest.raises(ValueError, match="threads: n must be >= 1"):
        fa_dask.attention(q, k, v, threads=0)

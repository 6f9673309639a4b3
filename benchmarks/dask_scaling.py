"""fastattn on a Dask cluster against one process, and a decode step over a sharded cache.

    python benchmarks/dask_scaling.py [--rounds 5] [--calls 64]

1. Throughput: ``--calls`` prefill-1k calls (12 heads, Lq = Lk = 1024, D 64, float32), as
   ``fastattn.integrations.dask.attention`` on ``LocalCluster(2 workers x 1 thread)`` (each
   call's inputs generated on the worker that runs it; one task per call, and one per 4
   calls) against a loop of ``fastattn.attention`` calls in this process with 2 threads
   (cycling over 8 inputs).  Rounds alternate them; the ratio of each round's throughputs
   is printed, then the median and the range.
2. A decode step (decode-4k: 32 heads, 4096 cached keys, D 128, float32) against a KV cache
   split into 2 shards, one per worker, built there: each worker attends over its shard,
   the client merges with ``fastattn.merge_attention``; also the same step as
   ``fastattn.integrations.dask.attention`` on the sharded dask arrays (the merge is a task).
   Prints the max relative error against one call over the whole cache (and each against
   the float64 reference, float32's own error), the bytes that cross between client and
   workers per step, and the step's latency.

3. The merge alone: 8 partials of (32 heads, 1 row, D 128) float32, as a list and stacked
   in one array, against summing them (the least a merge must do: read every partial once).

Workers run with Dask's statistical profiler off and without ``MALLOC_TRIM_THRESHOLD_``
(``--dask-defaults`` keeps both; see ``tune_workers``).  The machine may be shared: read
the spread, not one number.
"""
import argparse
import statistics
import time

import numpy as np

import fastattn
from fastattn import reference
from fastattn.integrations import dask as fa_dask

PREFILL = (12, 1024, 64)          # heads, L, D
DECODE = (32, 4096, 128)          # heads, cached keys, D


def cluster_workers(client, n=2, timeout=120):
    """The addresses of n running workers, sorted, once the cluster has them.

    Asked of the scheduler (``client.nthreads()``), never read from
    ``client.scheduler_info()``: that returns the client's cached copy of the scheduler's
    identity, which a periodic refresh replaces with one that lists no workers, so on a
    busy machine it comes back empty now and then.  Right after a restart the scheduler
    itself lists no workers until they reconnect: hence the wait."""
    client.wait_for_workers(n, timeout=timeout)
    workers = sorted(client.nthreads())
    if len(workers) < n:
        raise RuntimeError(f"the cluster must have {n} workers running; the scheduler "
                           f"lists {len(workers)}: {workers}")
    return workers[:n]


def make_qkv(seed):
    H, L, D = PREFILL
    return np.random.default_rng(seed).standard_normal((3, 1, H, L, D), dtype=np.float32)


def prefill_rounds(client, calls, rounds, group=4):
    import dask
    import dask.array as da
    from distributed import wait

    H, L, D = PREFILL
    # Calls i .. i + group - 1 are generated on one worker, the next group on the other
    # (a balanced load, no input crossing between workers), q, k and v by one task.
    workers = cluster_workers(client)
    blocks = [client.submit(make_qkv, i, workers=[workers[i // group % 2]], pure=False)
              for i in range(calls)]
    wait(blocks)
    x = da.concatenate([da.from_delayed(dask.delayed(b), (3, 1, H, L, D), np.float32)
                        for b in blocks], axis=1)
    # Persisted inputs, one call per chunk and `group` calls per chunk: the timed graph is
    # then the attention tasks alone, each sent at once to the worker that holds its inputs.
    inputs = {n: client.persist([x[i].rechunk({0: n}) for i in range(3)]) for n in (1, group)}
    wait(list(inputs.values()))
    rng = np.random.default_rng(0)
    local = [rng.standard_normal((3, 1, H, L, D), dtype=np.float32) for _ in range(8)]

    def one_process():
        t = time.perf_counter()
        with fastattn.num_threads(2):
            for i in range(calls):
                fastattn.attention(*local[i % len(local)])
        return calls / (time.perf_counter() - t)

    def cluster(qkv):
        out = fa_dask.attention(*qkv)
        t = time.perf_counter()
        done = client.persist(out)
        wait(done)
        rate = calls / (time.perf_counter() - t)
        # Release the results before the next round, which would otherwise find them.
        client.cancel(done)
        del done
        while any(key[0] == out.name for keys in client.has_what().values() for key in keys):
            time.sleep(0.01)
        return rate

    one_process(), cluster(inputs[1]), cluster(inputs[group])      # warm-up
    print(f"prefill-1k x {calls}: calls/s, one process (2 threads) vs LocalCluster(2 x 1), "
          f"tasks of 1 call and of {group} calls")
    ratios = {1: [], group: []}
    for r in range(rounds):
        a = one_process()
        b = {n: cluster(inputs[n]) for n in ratios}
        line = "   ".join(f"{n} per task {b[n]:6.2f}/s ({b[n] / a:.3f})" for n in ratios)
        print(f"  round {r + 1}: one process {a:6.2f}/s   cluster: {line}")
        for n in ratios:
            ratios[n].append(b[n] / a)
    for n, rs in ratios.items():
        print(f"  {n} call(s) per task: ratio median {statistics.median(rs):.3f}  range "
              f"{min(rs):.3f}..{max(rs):.3f}  (target >= 0.85)")


def make_shard(seed, shard, n_shards, shape=DECODE):
    """Shard ``shard`` of the cache (keys shard*n/n_shards ...), built where it lives."""
    H, Lk, D = shape
    rng = np.random.default_rng([seed, shard])
    n = Lk // n_shards
    return rng.standard_normal((2, 1, H, n, D), dtype=np.float32)   # k and v


def attend_shard(q, kv, first):
    """The worker's part: attention over its shard, with the lse for the merge."""
    return fastattn.attention(q, kv[0], kv[1], return_lse=True)


def decode_step(client, steps, shape=DECODE):
    """Print the decode step's errors, bytes and latency; return its errors (max relative
    error of the client's merge and of the dask graph against one call over the whole
    cache, and of each of the three against the float64 reference)."""
    import dask
    import dask.array as da
    from distributed import wait

    H, Lk, D = shape
    workers = cluster_workers(client)
    shards = [client.submit(make_shard, 0, s, 2, shape, workers=[w], pure=False)
              for s, w in enumerate(workers)]
    wait(shards)
    holders = client.who_has(shards)
    assert [list(holders[f.key]) for f in shards] == [[w] for w in workers], holders
    k, v = np.concatenate([make_shard(0, s, 2, shape) for s in range(2)], axis=-2)
    q = np.random.default_rng(1).standard_normal((1, H, 1, D), dtype=np.float32)

    def client_merges():
        parts = [client.submit(attend_shard, q, s, n == 0, workers=[w], pure=False)
                 for n, (s, w) in enumerate(zip(shards, workers))]
        parts = client.gather(parts)
        return fastattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])[0], parts

    kd, vd = (da.concatenate([da.from_delayed(s[i], (1, H, Lk // 2, D), np.float32)
                              for s in map(dask.delayed, shards)], axis=-2)
              for i in (0, 1))
    one = fastattn.attention(q, k, v)
    exact = reference.attention(*(a.astype(np.float64) for a in (q, k, v)))
    error = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())  # noqa: E731
    merged, parts = client_merges()
    graph = client.compute(fa_dask.attention(q, kd, vd)).result()
    held = 2 * H * (Lk // 2) * D * 4
    print(f"\ndecode step ({H} heads, {Lk} cached keys, D {D}) over 2 shards "
          f"({held / 2**20:.1f} MiB of k and v on each worker)")
    print(f"  client merges: max rel error vs one call {error(merged, one):.2e}; vs float64 "
          f"{error(merged, exact):.2e} (one call vs float64 {error(one, exact):.2e})")
    print(f"  dask graph:    max rel error vs one call {error(graph, one):.2e}")
    sent = q.nbytes
    back = sum(p[0].nbytes + p[1].nbytes for p in parts)
    print(f"  bytes per step: q {sent} B to each worker ({2 * sent} B), partials back "
          f"{back} B ({parts[0][0].nbytes} B out + {parts[0][1].nbytes} B lse per worker); "
          f"the cache never moves")
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        client_merges()
        times.append(time.perf_counter() - t)
    local = []
    for _ in range(steps):
        t = time.perf_counter()
        with fastattn.num_threads(2):
            fastattn.attention(q, k, v)
        local.append(time.perf_counter() - t)
    print(f"  latency per step: cluster {1e3 * statistics.median(times):.2f} ms (median of "
          f"{steps}; {1e3 * min(times):.2f}..{1e3 * max(times):.2f}), one process "
          f"{1e3 * statistics.median(local):.2f} ms")
    return {"merged": error(merged, one), "graph": error(graph, one),
            "merged_vs_float64": error(merged, exact), "graph_vs_float64": error(graph, exact),
            "one_vs_float64": error(one, exact)}


def merge_overhead(rounds):
    import timeit

    rng = np.random.default_rng(0)
    outs = [rng.standard_normal((32, 1, 128), dtype=np.float32) for _ in range(8)]
    lses = [rng.standard_normal((32, 1), dtype=np.float32) for _ in range(8)]
    stacked, stacked_lse = np.stack(outs), np.stack(lses)

    def read():
        total = outs[0] + outs[1]
        for o in outs[2:]:
            total += o
        return total

    cases = {"sum of the list": read,
             "sum of the stack": lambda: np.add.reduce(stacked, axis=0),
             "merge the list": lambda: fastattn.merge_attention(outs, lses),
             "merge the stack": lambda: fastattn.merge_attention(stacked, stacked_lse)}
    times = {name: [] for name in cases}
    for _ in range(rounds):                       # alternate the cases, best of 5 x 500 each
        for name, f in cases.items():
            times[name].append(min(timeit.repeat(f, number=500, repeat=5)) / 500 * 1e6)
    print("\nmerge of 8 partials (32 heads, 1 row, D 128), float32, us per call")
    for name, t in times.items():
        print(f"  {name:17s} median {statistics.median(t):6.2f}  range {min(t):.2f}..{max(t):.2f}")
    for merge, read_ in (("merge the list", "sum of the list"), ("merge the stack", "sum of the stack")):
        extra = [a - b for a, b in zip(times[merge], times[read_])]
        print(f"  {merge} - {read_}: median {statistics.median(extra):.2f} us, range "
              f"{min(extra):.2f}..{max(extra):.2f} (target <= 10)")


def tune_workers():
    """Two worker settings that cost compute-bound tasks time: the statistical profiler,
    which samples every worker thread's stack every 10 ms, and MALLOC_TRIM_THRESHOLD_=65536,
    which makes glibc return freed memory at once (and disables its adaptive mmap
    threshold), so that calls fault fresh pages in again."""
    import dask

    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    dask.config.set({"distributed.worker.profile.enabled": False,
                     "distributed.nanny.pre-spawn-environ": env})


def main(argv=None):
    from distributed import Client, LocalCluster

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dask-defaults", action="store_true",
                        help="keep Dask's worker defaults (see tune_workers)")
    args = parser.parse_args(argv)
    if not args.dask_defaults:
        tune_workers()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        threads = client.run(fastattn.get_num_threads, workers=cluster_workers(client))
        print(f"workers: {len(threads)}, fastattn threads per worker: "
              f"{sorted(set(threads.values()))}, "
              + ("Dask's defaults" if args.dask_defaults else
                 "profiler off and MALLOC_TRIM_THRESHOLD_ unset (see tune_workers)") + "\n")
        prefill_rounds(client, args.calls, args.rounds)
        decode_step(client, args.steps)
    merge_overhead(args.rounds)


if __name__ == "__main__":
    main()

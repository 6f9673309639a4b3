"""Number of threads used by fastattn's kernels, and its threadpoolctl controller.

The kernels run on fastattn's own thread pool (src/fa_pool.h).  The process-wide default
honours ``OMP_NUM_THREADS`` like an OpenMP library (otherwise: the CPUs this process may
run on) and is changed by :func:`set_num_threads`.  The :func:`num_threads` context
manager overrides it for the calling Python thread only, so two threads can use different
settings at once.  ``threadpoolctl.threadpool_limits(n)`` caps whichever applies, for the
whole process, as it caps NumPy's BLAS.  The count is read once when a call starts:
changing it never affects a running call.
"""
import contextlib
import operator
import os
import sys
import threading

from ._dispatch import kernel


def _initial_default():
    backend = kernel.pool_info()["backend"]
    if backend == "none":
        return 1
    if backend == "openmp" or kernel.build_info()["openmp"]:
        # OpenMP's own reading of OMP_NUM_THREADS (and of the CPUs available).
        return max(1, int(kernel.omp_max_threads()))
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


_default = _initial_default()
# Cap set through threadpoolctl (None: no cap).
_limit = None


class _Local(threading.local):
    # A class-level default: reading ``_local.n`` in a thread that never set it finds None
    # here instead of raising and catching an AttributeError (whose message formatting
    # was ~5% of a tiny call).
    n = None


_local = _Local()


def _check(n):
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"n must be an int, got {type(n).__name__}") from None
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return n


def set_num_threads(n):
    """Set the default number of threads for fastattn's kernels (all Python threads).

    Parameters
    ----------
    n : int
        Number of threads, >= 1.
    """
    global _default
    _default = _check(n)


def get_num_threads():
    """Return the number of threads the next kernel call from this Python thread will use."""
    n = _local.n
    if n is None:
        n = _default
    if _limit is not None and n > _limit:
        return _limit
    return n


@contextlib.contextmanager
def num_threads(n):
    """Use ``n`` threads for fastattn calls made by this Python thread inside the block.

    Examples
    --------
    >>> q = k = v = np.random.default_rng(0).standard_normal((2, 64, 16))
    >>> with fastattn.num_threads(1) as n:
    ...     one = fastattn.attention(q, k, v)
    >>> n, fastattn.get_num_threads() >= 1
    (1, True)
    >>> np.array_equal(one, fastattn.attention(q, k, v))   # any thread count, the same bits
    True
    """
    n = _check(n)
    previous = _local.n
    _local.n = n
    try:
        yield n
    finally:
        _local.n = previous


# --------------------------------------------------------------------------- threadpoolctl
# threadpoolctl finds thread pools by scanning the shared libraries loaded in the process
# and asking each registered controller class whether it knows the file.  fastattn's pool
# lives in its compiled kernel module, so the controller matches that file.  Importing
# threadpoolctl costs ~10 ms, so fastattn never imports it: the controller is registered
# when threadpoolctl is already imported, or else right after it is imported.

def _register_with_threadpoolctl(threadpoolctl):
    if getattr(threadpoolctl, "_fastattn_registered", False):
        return
    if not hasattr(threadpoolctl, "register"):  # threadpoolctl < 3.5 has no custom controllers
        return

    class FastattnController(threadpoolctl.LibController):
        """fastattn's thread pool, as threadpoolctl sees it."""

        user_api = "fastattn"
        internal_api = "fastattn"
        filename_prefixes = (os.path.basename(kernel.__file__).lower(),)
        check_symbols = ("PyInit_" + kernel.__name__.rsplit(".", 1)[-1],)

        def get_num_threads(self):
            return _default if _limit is None else min(_default, _limit)

        def set_num_threads(self, num_threads):
            # A cap, not a new default: restoring the value read before a limit lifts it.
            global _limit
            _limit = None if num_threads >= _default else max(1, int(num_threads))

        def get_version(self):
            from . import __version__
            return __version__

        def set_additional_attributes(self):
            self.backend = kernel.pool_info()["backend"]

    threadpoolctl.register(FastattnController)
    threadpoolctl._fastattn_registered = True


class _ThreadpoolctlHook:
    """A meta-path finder that registers the controller once threadpoolctl is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "threadpoolctl":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            try:
                _register_with_threadpoolctl(module)
            except Exception:   # threadpoolctl works as before, without fastattn's pool
                pass

        spec.loader.exec_module = exec_and_register
        return spec


def _install_threadpoolctl_hook():
    if "threadpoolctl" in sys.modules:
        _register_with_threadpoolctl(sys.modules["threadpoolctl"])
    else:
        sys.meta_path.insert(0, _ThreadpoolctlHook())


_install_threadpoolctl_hook()

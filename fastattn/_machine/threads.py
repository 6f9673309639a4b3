"""Number of threads used by fastattn's kernels, and its threadpoolctl controller.

The kernels run on fastattn's own thread pool (src/pool/fa_pool.h).  The process-wide default
honours ``OMP_NUM_THREADS`` like an OpenMP library (otherwise: the CPUs this process may
run on) and is changed by :func:`set_num_threads`.  The :func:`num_threads` context
manager overrides it for the calling Python thread only, so two threads can use different
settings at once.  ``threadpoolctl.threadpool_limits(n)`` caps whichever applies, for the
whole process, as it caps NumPy's BLAS.  The count is read once when a call starts:
changing it never affects a running call.

Which threads run the work items: fastattn's own pool, or the OpenMP team of the calling
thread, which is torch's when torch runs its operations on the same OpenMP library as
fastattn's kernel.  torch's OpenMP threads keep spinning for milliseconds after each of its
parallel operations: a call on fastattn's own threads finds its second core taken, while
a call on the same team has those spinning threads pick up its work items at once.  But
the team's threads spin after fastattn's calls too, and take the cores from NumPy's BLAS
threads (calls of 0.1 ms become calls of 8 ms), so only calls made from inside a torch
program run on it: those of fastattn's torch integrations (:class:`in_torch`).
``FASTATTN_POOL`` chooses: ``auto`` (the default, as just described), ``own`` (always
fastattn's pool) or ``openmp`` (every call on the OpenMP team, in builds with OpenMP: for
programs that call :func:`fastattn.attention` between torch operations).  Either way every
work item computes the same bits on any thread.
"""
import contextlib
import operator
import os
import sys
import threading

from .isa import kernel
from .version import __version__


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
            return __version__

        def set_additional_attributes(self):
            self.backend = kernel.pool_info()["backend"]

    threadpoolctl.register(FastattnController)
    threadpoolctl._fastattn_registered = True


class _ImportHook:
    """A meta-path finder that calls ``then(module)`` once the module ``name`` is imported
    (after its code ran), and removes itself."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_and_then(module):
            exec_module(module)
            try:
                then(module)
            except Exception:   # the module works as before, without fastattn's hook
                pass

        spec.loader.exec_module = exec_and_then
        return spec


def _after_import(name, then):
    """``then(module)`` now if ``name`` is imported, else right after it is."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _ImportHook(name, then))


_after_import("threadpoolctl", _register_with_threadpoolctl)


# --------------------------------------------------------------------------- which threads
#: The values of ``FASTATTN_POOL``.
POOL_CHOICES = ("auto", "own", "openmp")


def _pool_choice():
    value = os.environ.get("FASTATTN_POOL", "").strip().lower() or "auto"
    if value not in POOL_CHOICES:
        raise ImportError(f"FASTATTN_POOL={value!r}: expected one of {', '.join(POOL_CHOICES)}")
    return value


def _openmp_runtimes():
    """Paths of the OpenMP libraries mapped into this process (Linux), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "omp" in line}
    except OSError:
        return None
    names = ("libgomp", "libiomp", "libomp")
    return {p for p in paths if os.path.basename(p).startswith(names)}


def _torch_shares_openmp(torch):
    """Whether ``torch`` runs its operations on the OpenMP library fastattn's kernel uses:
    its parallel backend is OpenMP and the process has one OpenMP library."""
    try:
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return False
    except Exception:
        return False
    runtimes = _openmp_runtimes()
    return runtimes is not None and len(runtimes) == 1


def _can_use_openmp():
    return kernel.pool_info()["backend"] == "pthreads" and kernel.build_info()["openmp"]


def _set_pool(choice):
    """Apply ``choice``, one of POOL_CHOICES (``FASTATTN_POOL`` at import; tests and the
    bench change it)."""
    if choice not in POOL_CHOICES:
        raise ValueError(f"choice must be one of {', '.join(POOL_CHOICES)}, got {choice!r}")
    global _pool
    _pool = choice
    team = "never"
    if _can_use_openmp():
        torch = sys.modules.get("torch")
        if choice == "openmp":
            team = "always"
        elif choice == "auto" and torch is not None and _torch_shares_openmp(torch):
            team = "in torch"
    kernel.pool_set_team(team)


def pool_team():
    """Which calls run on the calling thread's OpenMP team instead of fastattn's pool:
    ``"never"``, ``"always"`` or ``"in torch"`` (the calls of the torch integrations)."""
    return kernel.pool_info()["team"]


class in_torch:
    """Within the block, this Python thread's calls are made from inside torch: with
    ``FASTATTN_POOL=auto`` they run on torch's OpenMP team (see above).  fastattn's torch
    integrations wrap their kernel calls in it."""

    __slots__ = ("previous",)

    def __enter__(self):
        self.previous = kernel.pool_set_in_torch(True)

    def __exit__(self, *exc):
        kernel.pool_set_in_torch(self.previous)


_pool = _pool_choice()
_set_pool(_pool)
if _pool == "auto":
    _after_import("torch", lambda torch: _pool == "auto" and _set_pool("auto"))

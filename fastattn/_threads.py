"""OpenMP thread count used by fastattn's kernels.

The process-wide default starts as OpenMP's own (which honours ``OMP_NUM_THREADS``) and is
changed by :func:`set_num_threads`.  The :func:`num_threads` context manager overrides it
for the calling Python thread only, so two threads can use different settings at once.
The count is read once when a call starts: changing it never affects a running call.
"""
import contextlib
import operator
import threading

from ._dispatch import kernel

_default = max(1, int(kernel.omp_max_threads()))


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
    """Set the default number of OpenMP threads for fastattn's kernels (all Python threads).

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
    return _default if n is None else n


@contextlib.contextmanager
def num_threads(n):
    """Use ``n`` threads for fastattn calls made by this Python thread inside the block.

    Examples
    --------
    >>> with fastattn.num_threads(1):
    ...     out = fastattn.attention(q, k, v)
    """
    n = _check(n)
    previous = _local.n
    _local.n = n
    try:
        yield n
    finally:
        _local.n = previous

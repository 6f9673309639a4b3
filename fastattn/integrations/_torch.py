"""torch tensors as NumPy arrays for fastattn, shared by the integrations.

Only imported from inside the integrations' functions, after torch is: nothing here
imports torch at module level.  The integrations' calls are made from inside torch
programs, so they run marked as such (:class:`from_torch`): on torch's OpenMP threads when
they are fastattn's too, and with torch's float32 matmul precision.
"""
import functools

import numpy as np

import fastattn

from .._precision import float32_precision
from .._threads import in_torch


@functools.lru_cache(maxsize=None)
def bfloat16_dtype():
    """``ml_dtypes.bfloat16`` when that package is installed, else None."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


@functools.lru_cache(maxsize=None)
def float_dtypes(torch):
    """The torch dtypes fastattn computes with."""
    return frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16))


def needs_grad(torch, *tensors):
    """Whether autograd records a call on ``tensors`` (None allowed): grad mode on and an
    input that requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def view(torch, t):
    """The NumPy array sharing ``t``'s memory (bfloat16 read through its bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16_dtype())
    return t.numpy()


def tensor(torch, a):
    """The torch tensor sharing the NumPy array ``a``'s memory (ml_dtypes' bfloat16 as
    torch.bfloat16)."""
    if bfloat16_dtype() is not None and a.dtype == bfloat16_dtype():
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def arrays(torch, *tensors):
    """NumPy views of CPU ``tensors``, all of one dtype.

    Views share memory with the tensors (``torch.Tensor.numpy()``).  bfloat16 is viewed
    as ``ml_dtypes.bfloat16`` when that package is installed; otherwise bfloat16, and a mix
    of dtypes, are upcast to float32 copies.
    """
    first = tensors[0].dtype
    if first != torch.bfloat16 and all(t.dtype == first for t in tensors):
        return tuple([t.numpy() for t in tensors])
    dtypes = {t.dtype for t in tensors}
    if dtypes == {torch.bfloat16} and bfloat16_dtype() is not None:
        return tuple(view(torch, t) for t in tensors)
    return tuple(t.float().numpy() for t in tensors)


class from_torch:
    """Within the block, this thread's fastattn calls are made from inside torch: on
    torch's OpenMP team (:class:`fastattn._threads.in_torch`), and with torch's float32
    matmul precision ("medium": float32 calls multiply in bfloat16, see
    :func:`fastattn.set_float32_precision`)."""

    __slots__ = ("threads", "precision")

    def __init__(self, torch):
        medium = torch.get_float32_matmul_precision() == "medium"
        self.threads = in_torch()
        self.precision = float32_precision("bfloat16" if medium else "float32")

    def __enter__(self):
        self.threads.__enter__()
        self.precision.__enter__()

    def __exit__(self, *exc):
        self.precision.__exit__()
        self.threads.__exit__()


def attend_heads_last(torch, q, k, v, out_dtype, **keywords):
    """``fastattn.attention`` of the arrays ``q``, ``k``, ``v`` (batch, heads, rows, D),
    as a call from inside torch, into a new tensor laid out (batch, rows, heads, Dv) -- the
    layout models read -- of ``out_dtype``."""
    B, Hq, Lq, _ = q.shape
    out = np.empty((max(B, k.shape[0], v.shape[0]), Lq, Hq, v.shape[-1]), q.dtype)
    with from_torch(torch):
        fastattn.attention(q, k, v, out=out.transpose(0, 2, 1, 3), **keywords)
    t = tensor(torch, out)
    return t if t.dtype == out_dtype else t.to(out_dtype)

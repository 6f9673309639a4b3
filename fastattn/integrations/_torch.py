"""torch tensors as NumPy arrays for fastattn, shared by the integrations.

Only imported from inside the integrations' functions, after torch is: nothing here
imports torch at module level.
"""
import functools

import numpy as np


@functools.lru_cache(maxsize=None)
def bfloat16_dtype():
    """``ml_dtypes.bfloat16`` when that package is installed, else None."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def torch_dtype(torch, dtype):
    """The torch dtype of NumPy ``dtype`` (float16/32/64 or ml_dtypes' bfloat16)."""
    if dtype == bfloat16_dtype():
        return torch.bfloat16
    return {np.float16: torch.float16, np.float32: torch.float32,
            np.float64: torch.float64}[dtype.type]


def view(torch, t):
    """The NumPy array sharing ``t``'s memory (bfloat16 read through its bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16_dtype())
    return t.numpy()


def arrays(torch, *tensors):
    """NumPy views of CPU ``tensors``, all of one dtype.

    Views share memory with the tensors (``torch.Tensor.numpy()``).  bfloat16 is viewed
    as ``ml_dtypes.bfloat16`` when that package is installed; otherwise bfloat16, and a mix
    of dtypes, are upcast to float32 copies.
    """
    dtypes = {t.dtype for t in tensors}
    if dtypes == {torch.bfloat16} and bfloat16_dtype() is not None:
        return tuple(view(torch, t) for t in tensors)
    if torch.bfloat16 in dtypes or len(dtypes) > 1:
        return tuple(t.float().numpy() for t in tensors)
    return tuple(t.numpy() for t in tensors)

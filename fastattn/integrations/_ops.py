"""fastattn's torch operators: ``torch.ops.fastattn.*``, registered with ``torch.library``.

This module imports torch and registers the operators when it is first imported, which the
integrations do at their first call (and ``register()``): importing ``fastattn`` or
``fastattn.integrations`` never imports torch.

- ``fastattn::attention`` is :func:`fastattn.attention` on tensors, returning ``(out, lse)``;
  ``out`` is laid out rows before heads, ``(..., Lq, Hq, Dv)`` in memory seen as
  ``(..., Hq, Lq, Dv)`` (as torch's CPU flash attention lays it out), so that a model's
  ``out.transpose(1, 2).reshape(B, Lq, -1)`` costs no copy.  Its autograd formula is
- ``fastattn::attention_backward``, :func:`fastattn.attention_backward`, returning
  ``(dq, dk, dv, dsinks)`` (``dsinks`` empty when there are no sinks);
- ``fastattn::attention_with_kvcache`` is :func:`fastattn.attention_with_kvcache`, which
  writes the new keys and values into its caches (and q8_0 / q4_0 scales): the operator
  declares them mutated.  Caches may be int8 (q8_0) or uint8 (q4_0) with float16 scales,
  or ``torch.float8_e4m3fn`` / ``float8_e5m2`` (fp8, read and written as ``ml_dtypes``'
  types of the same bits) with float32 scales.

Each has a fake implementation that gives the results' shapes, dtypes and strides from the
inputs' alone, so ``torch.compile`` traces a call without running it and keeps it in one
graph.  The real implementations hand the tensors to fastattn as NumPy views of the same
memory (float32, float64, float16, and bfloat16 as ``ml_dtypes.bfloat16`` when that package
is installed; otherwise bfloat16 is upcast to float32 copies) and write ``out`` in place.
They run on torch's OpenMP team (:class:`fastattn._machine.threads.in_torch`) and with fastattn's
own float32 precision (:func:`fastattn.set_float32_precision`), never torch's matmul
precision.

Causal masking is a string in the schemas: ``"none"``, ``"bottom-right"`` (fastattn's
``causal=True``) or ``"top-left"`` (torch's ``is_causal``).
"""
import functools
from typing import Optional

import numpy as np
import torch

import fastattn

from .._storage import kinds as _kinds
from .._machine.threads import in_torch

Tensor = torch.Tensor

CAUSAL = {"none": False, "bottom-right": True, "top-left": "top-left"}


# --------------------------------------------------------------------------- tensors as arrays

@functools.lru_cache(maxsize=None)
def ml_dtype(name):
    """``ml_dtypes``' type ``name`` when that package is installed, else None."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(getattr(ml_dtypes, name))


def bfloat16_dtype():
    """``ml_dtypes.bfloat16`` when that package is installed, else None."""
    return ml_dtype("bfloat16")


# torch's dtypes that NumPy has only through ml_dtypes: its name there, and a torch dtype of
# the same width that NumPy has, to view the bits through.
_ML_DTYPES = {torch.bfloat16: ("bfloat16", torch.int16),
              torch.float8_e4m3fn: ("float8_e4m3fn", torch.uint8),
              torch.float8_e5m2: ("float8_e5m2", torch.uint8)}


def view(t):
    """The NumPy array sharing the CPU tensor ``t``'s memory (bfloat16 and fp8 read
    through their bits as ``ml_dtypes``' types, which must be installed)."""
    t = t.detach()
    if t.dtype in _ML_DTYPES:
        name, bits = _ML_DTYPES[t.dtype]
        return t.view(bits).numpy().view(ml_dtype(name))
    return t.numpy()


def readable(t):
    """``t`` as fastattn reads it: a view of its memory, or a float32 copy for bfloat16
    without ``ml_dtypes``."""
    if t.dtype == torch.bfloat16 and bfloat16_dtype() is None:
        return t.detach().float().numpy()
    return view(t)


def constant(t):
    """A keyword tensor (mask, lengths, slopes) as fastattn takes it: 16-bit floats as
    float32, the rest as they are."""
    if t is None:
        return None
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return view(t)


def tensor(a, dtype):
    """The NumPy result ``a`` as a contiguous tensor of ``dtype`` (its memory, when it is
    contiguous and of that dtype)."""
    t = tensor_view(np.ascontiguousarray(a))
    return t if t.dtype == dtype else t.to(dtype)


def result_dtype(*tensors):
    """The dtype of ``out``: the inputs' promotion, as :func:`fastattn.attention`'s result
    (16-bit dtypes mixed give float32)."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def compute_dtype(*tensors):
    """The dtype ``lse`` comes in: float64 when an input is, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64
                                for t in tensors) else torch.float32


def out_like(q, k, v, dtype):
    """The empty result of attention over ``q``, ``k``, ``v`` (batch dims broadcast),
    laid out ``(*batch, Lq, Hq, Dv)`` in memory."""
    Lq, Dv = q.shape[-2], v.shape[-1]
    if q.dim() == 2:
        return torch.empty((Lq, Dv), dtype=dtype)
    batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    return torch.empty((*batch, Lq, q.shape[-3], Dv), dtype=dtype).transpose(-3, -2)


def new_out(q, k, v, dtype):
    """:func:`out_like` as a NumPy array of ``dtype`` and its tensor, for the real call
    (NumPy allocates and broadcasts shapes in a fraction of torch's time)."""
    Lq, Dv = q.shape[-2], v.shape[-1]
    if q.dim() == 2:
        a = np.empty((Lq, Dv), dtype)
    else:
        batch = q.shape[:-3]
        if not batch == k.shape[:-3] == v.shape[:-3]:
            batch = np.broadcast_shapes(batch, k.shape[:-3], v.shape[:-3])
        a = np.empty((*batch, Lq, q.shape[-3], Dv), dtype).swapaxes(-3, -2)
    return a, tensor_view(a)


def tensor_view(a):
    """The tensor sharing the NumPy array ``a``'s memory (``ml_dtypes.bfloat16`` as
    torch.bfloat16)."""
    if bfloat16_dtype() is not None and a.dtype == bfloat16_dtype():
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# --------------------------------------------------------------------------- mask structure

def mask_structure(mask, Lq, Lk):
    """(causal, window, keep_mask) for the boolean ``mask``, cached on the tensor.

    ``causal`` / ``window`` describe the smallest bottom-right band (fastattn's alignment:
    query ``i`` sits at key position ``i + Lk - Lq``) that contains every True of the mask;
    passing them with the mask changes nothing but lets fastattn skip hidden key blocks.
    ``keep_mask`` is False when the mask is exactly that band.  A model's layers share one
    mask tensor per forward pass, so the analysis runs once per pass.
    """
    version = mask._version
    cached = getattr(mask, "_fastattn_structure", None)
    if cached is not None and cached[0] == (version, Lq, Lk):
        return cached[1]
    structure = derive_structure(mask, Lq, Lk)
    try:
        mask._fastattn_structure = ((version, Lq, Lk), structure)
    except (AttributeError, RuntimeError):  # a tensor that takes no attributes: no cache
        pass
    return structure


def derive_structure(mask, Lq, Lk):
    """:func:`mask_structure` computed."""
    if mask.shape[-2] != Lq or mask.shape[-1] != Lk or Lq == 0 or Lk == 0:
        return False, None, True  # a broadcast mask row or empty call: use it as it is
    off = Lk - Lq
    rows = mask.reshape(-1, Lq, Lk)
    seen = rows.any(dim=-1)  # (n, Lq)
    if not bool(seen.any()):
        return False, None, True
    i = torch.arange(Lq)
    # First and last visible key of each row (argmax returns the first maximum).
    first = rows.to(torch.uint8).argmax(dim=-1)
    last = Lk - 1 - rows.flip(-1).to(torch.uint8).argmax(dim=-1)
    left = int((i + off - first)[seen].max())
    right = int((last - i - off)[seen].max())
    # A side is unbounded when it already reaches every key of every row.
    left = -1 if left >= Lk - 1 else max(left, 0)
    right = -1 if right >= Lq - 1 else max(right, 0)
    causal = right == 0
    if causal:
        window = None if left == -1 else (left, 0)
    else:
        window = None if left == right == -1 else (left, right)
    j = torch.arange(Lk)
    d = j[None, :] - (i[:, None] + off)  # key j's offset from the row's diagonal
    band = torch.ones(Lq, Lk, dtype=torch.bool)
    if left != -1:
        band &= d >= -left
    if right != -1:
        band &= d <= right
    keep = not bool((rows == band).all())
    return causal, window, keep


def keywords(q, k, scale, causal, window, mask, kv_lengths, q_lengths, softcap,
             alibi_slopes):
    """The keywords of a :func:`fastattn.attention` call, as arrays.

    A boolean mask given alone (no causal, window or lengths, which would realign a band)
    also passes the band it lies in (:func:`mask_structure`), and is dropped when it is
    exactly that band.
    """
    causal = CAUSAL[causal]
    window = None if window is None else tuple(window)
    if (mask is not None and mask.dtype == torch.bool and causal is False and window is None
            and kv_lengths is None and q_lengths is None):
        causal, window, keep = mask_structure(mask, q.shape[-2], k.shape[-2])
        if not keep:
            mask = None
    return dict(scale=scale, causal=causal, window=window, mask=constant(mask),
                kv_lengths=constant(kv_lengths), q_lengths=constant(q_lengths),
                softcap=softcap, alibi_slopes=constant(alibi_slopes))


def sinks_array(sinks):
    return None if sinks is None else sinks.detach().double().numpy()


# --------------------------------------------------------------------------- attention

def _attention(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
              causal: str = "none", window: Optional[list[int]] = None,
              mask: Optional[Tensor] = None, kv_lengths: Optional[Tensor] = None,
              q_lengths: Optional[Tensor] = None, softcap: Optional[float] = None,
              alibi_slopes: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """:func:`fastattn.attention` with ``return_lse=True``; ``out`` written in place."""
    qa, ka, va = readable(q), readable(k), readable(v)
    out_a, out = new_out(q, k, v, np.result_type(qa, ka, va))
    kw = keywords(q, k, scale, causal, window, mask, kv_lengths, q_lengths, softcap,
                  alibi_slopes)
    with in_torch():
        _, lse = fastattn.attention(qa, ka, va, sinks=sinks_array(sinks), return_lse=True,
                                    out=out_a, **kw)
    dtype = result_dtype(q, k, v)   # bfloat16 computed without ml_dtypes: float32 until here
    return out if out.dtype == dtype else out.to(dtype), torch.from_numpy(lse)


attention = torch.library.custom_op("fastattn::attention", _attention, mutates_args=(),
                                    device_types="cpu")


@attention.register_fake
def _(q, k, v, scale=None, causal="none", window=None, mask=None, kv_lengths=None,
      q_lengths=None, softcap=None, alibi_slopes=None, sinks=None):
    check_shapes(q, k, v)
    out = out_like(q, k, v, result_dtype(q, k, v))
    return out, q.new_empty(out.shape[:-1], dtype=compute_dtype(q, k, v))


def check_shapes(q, k, v):
    """What the output shapes rest on, checked where the kernel's checks do not run (a
    traced call): the other checks are :func:`fastattn.attention`'s."""
    if not (q.dim() == k.dim() == v.dim() and q.dim() >= 2):
        raise ValueError(f"q, k and v must have the same number of dims, at least 2: "
                         f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, "
                         f"v.shape={tuple(v.shape)}")
    if q.dim() > 2:
        try:
            torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        except RuntimeError:
            raise ValueError(f"the batch dims of q, k and v do not broadcast: "
                             f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, "
                             f"v.shape={tuple(v.shape)}") from None


@torch.library.custom_op("fastattn::attention_backward", mutates_args=(), device_types="cpu")
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, dlse: Optional[Tensor] = None,
                       scale: Optional[float] = None, causal: str = "none",
                       window: Optional[list[int]] = None, mask: Optional[Tensor] = None,
                       kv_lengths: Optional[Tensor] = None, q_lengths: Optional[Tensor] = None,
                       softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                       sinks: Optional[Tensor] = None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`fastattn.attention_backward`: ``(dq, dk, dv, dsinks)``, each gradient in its
    input's dtype, ``dsinks`` empty without sinks."""
    kw = keywords(q, k, scale, causal, window, mask, kv_lengths, q_lengths, softcap,
                  alibi_slopes)
    with in_torch():
        grads = fastattn.attention_backward(
            readable(dout), readable(q), readable(k), readable(v), readable(out), view(lse),
            dlse=None if dlse is None else view(dlse), sinks=sinks_array(sinks), **kw)
    dq, dk, dv = (tensor(g, t.dtype) for g, t in zip(grads, (q, k, v)))
    dsinks = tensor(grads[3], sinks.dtype) if sinks is not None else q.new_empty(0)
    return dq, dk, dv, dsinks


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse=None, scale=None, causal="none", window=None,
      mask=None, kv_lengths=None, q_lengths=None, softcap=None, alibi_slopes=None,
      sinks=None):
    dsinks = torch.empty_like(sinks, memory_format=torch.contiguous_format) \
        if sinks is not None else q.new_empty(0)
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
            dsinks)


# attention's arguments after q, k, v, in order: tensors, which are saved for the
# backward, and the rest, kept on ctx.
_ARGUMENTS = ("scale", "causal", "window", "mask", "kv_lengths", "q_lengths", "softcap",
              "alibi_slopes", "sinks")
_CONSTANTS = ("mask", "kv_lengths", "q_lengths", "alibi_slopes", "sinks")


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    rest = dict(zip(_ARGUMENTS, rest))
    ctx.save_for_backward(q, k, v, *output, *(rest[n] for n in _CONSTANTS))
    ctx.scalars = {n: rest[n] for n in _ARGUMENTS if n not in _CONSTANTS}


def _backward(ctx, dout, dlse):
    # Grad mode is on inside a backward exactly when it runs with create_graph=True: the
    # gradients would then have to be differentiable, and fastattn's are not.
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "fastattn's attention has no double backward: its gradients are not "
            "differentiable, so a backward through it with create_graph=True (a gradient "
            "penalty, a Hessian-vector product) is refused")
    q, k, v, out, lse, *constants = ctx.saved_tensors
    constants = dict(zip(_CONSTANTS, constants))
    dq, dk, dv, dsinks = attention_backward(dout, q, k, v, out, lse, dlse, **constants,
                                            **ctx.scalars)
    # One gradient per argument: none for the scalars and the constant tensors.
    return (dq, dk, dv, *(None,) * (len(_ARGUMENTS) - 1),
            None if constants["sinks"] is None else dsinks)


attention.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- serving caches

def _attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                           k: Optional[Tensor] = None, v: Optional[Tensor] = None,
                           block_table: Optional[Tensor] = None,
                           k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
                           rotary_cos: Optional[Tensor] = None,
                           rotary_sin: Optional[Tensor] = None,
                           rotary_interleaved: bool = False, scale: Optional[float] = None,
                           causal: str = "none", window: Optional[list[int]] = None,
                           softcap: Optional[float] = None,
                           alibi_slopes: Optional[Tensor] = None,
                           sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """:func:`fastattn.attention_with_kvcache` with ``return_lse=True``: the new rows
    written into the caches in place, ``out`` in ``q``'s dtype."""
    caches = {}
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale),
                    ("v_scale", v_scale)):
        if t is not None and t.dtype in _ML_DTYPES and ml_dtype(_ML_DTYPES[t.dtype][0]) is None:
            raise TypeError(f"{name} is {t.dtype}, which needs the ml_dtypes package to be "
                            "read and written in place (pip install ml_dtypes)")
        caches[name] = None if t is None else view(t)
    with in_torch():
        out, lse = fastattn.attention_with_kvcache(
            readable(q), caches["k_cache"], caches["v_cache"],
            None if k is None else readable(k), None if v is None else readable(v),
            k_scale=caches["k_scale"], v_scale=caches["v_scale"],
            cache_seqlens=constant(cache_seqlens), block_table=constant(block_table),
            rotary_cos=constant(rotary_cos), rotary_sin=constant(rotary_sin),
            rotary_interleaved=rotary_interleaved, scale=scale, causal=CAUSAL[causal],
            window=None if window is None else tuple(window), softcap=softcap,
            alibi_slopes=constant(alibi_slopes), sinks=sinks_array(sinks), return_lse=True)
    return tensor(out, q.dtype), torch.from_numpy(lse)


_CACHES = ("k_cache", "v_cache", "k_scale", "v_scale")
attention_with_kvcache = torch.library.custom_op(
    "fastattn::attention_with_kvcache", _attention_with_kvcache, mutates_args=_CACHES,
    device_types="cpu")


@attention_with_kvcache.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k=None, v=None, block_table=None, k_scale=None,
      v_scale=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False, scale=None,
      causal="none", window=None, softcap=None, alibi_slopes=None, sinks=None):
    B, Hq, Lq, _ = q.shape
    lse_dtype = compute_dtype(q, k_cache, v_cache, k, v)
    Dv = _kinds.row_values(str(v_cache.dtype).split(".")[-1], v_cache.shape[-1])
    return q.new_empty((B, Hq, Lq, Dv)), q.new_empty((B, Hq, Lq), dtype=lse_dtype)


# --------------------------------------------------------------------------- calls

def plain_eager(tensors, differentiable):
    """Whether a call may run its operator's implementation without torch's dispatcher:
    plain CPU tensors in eager mode, nothing for autograd to record (no ``differentiable``
    tensor that requires grad, or grad mode off), and no trace, mode or transform active.
    The dispatcher's work for a call with keywords costs about what a decode step's
    attention does, and does nothing in that case; anything else goes through it."""
    return (not torch.compiler.is_compiling()
            and all(type(t) is Tensor for t in tensors if t is not None)
            and not (torch.is_grad_enabled()
                     and any(t is not None and t.requires_grad for t in differentiable))
            and not torch._C._is_torch_function_mode_enabled()
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active())


def call_attention(q, k, v, **arguments):
    """``torch.ops.fastattn.attention(q, k, v, **arguments)``: ``(out, lse)``."""
    if plain_eager((q, k, v), (q, k, v, arguments.get("sinks"))):
        return _attention(q, k, v, **arguments)
    return torch.ops.fastattn.attention(q, k, v, **arguments)


def call_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, **arguments):
    """``torch.ops.fastattn.attention_with_kvcache(...)``: ``(out, lse)``, the caches
    appended in place (their version counters moved, as the operator's declared mutation
    moves them)."""
    caches = (k_cache, v_cache, arguments.get("k_scale"), arguments.get("v_scale"))
    if not plain_eager((q, arguments.get("k"), arguments.get("v"), *caches), ()):
        return torch.ops.fastattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens,
                                                         **arguments)
    result = _attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, **arguments)
    if arguments.get("k") is not None:
        torch.autograd.graph.increment_version([t for t in caches if t is not None])
    return result

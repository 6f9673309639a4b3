"""fastattn as an attention implementation of Hugging Face transformers.

``register()`` adds two functions under one name: the attention function, which
transformers' models call in every attention layer, and the mask function, which builds the
mask those layers receive.  Both are needed: for an implementation with no mask function,
transformers builds no mask at all and hands the layers ``attention_mask=None``, so padding
would be silently ignored.  The mask function is transformers' own SDPA one, so the masks
mean exactly what they mean for ``attn_implementation="sdpa"``.

The attention function calls the operator ``torch.ops.fastattn.attention``
(:mod:`fastattn.integrations._ops`), so a model on fastattn compiles with
``torch.compile`` as it does on ``"sdpa"``, and trains through the operator's backward.
From a boolean mask the operator reads the structure fastattn can use (the bottom-right
causal rule, a sliding window): ``fastattn.attention`` then skips the key blocks no row
can see, and when the mask says nothing more than that structure (no padding) the mask
itself is dropped.  The analysis is cached on the mask tensor, which all layers of one
forward pass share.
"""
import functools
import sys
import warnings

__all__ = ["register", "attention_forward"]

_FALLBACKS = ("sdpa", None)

# One warning per reason and process: a generate() loop calls the function thousands of times.
_warned = set()


def register(name="fastattn", *, fallback="sdpa"):
    """Make fastattn available to transformers as ``attn_implementation=name``.

    Registers an attention function with ``transformers.AttentionInterface`` and the mask
    function that goes with it with ``transformers.AttentionMaskInterface`` (transformers'
    SDPA mask, a boolean ``(batch, 1, Lq, Lk)`` tensor or ``None`` for plain causal).
    Registering again under the same name replaces the earlier registration.

    Parameters
    ----------
    name : str, optional
        The name to pass as ``attn_implementation`` (default ``"fastattn"``).
    fallback : {"sdpa", None}, optional
        What to do with a call fastattn cannot run but PyTorch's SDPA can: CUDA (or other
        non-CPU) tensors, dropout in training, a T5-style ``position_bias``, a paged
        cache.  ``"sdpa"`` (default) hands the call to transformers' ``sdpa`` function,
        with one ``RuntimeWarning`` per reason, and a call with ``output_attentions=True``
        to the model's ``eager`` function, which returns the attention weights (sdpa
        cannot); ``None`` raises ``NotImplementedError``.

    Returns
    -------
    str
        ``name``, so that ``attn_implementation=register()`` reads in one line.

    Notes
    -----
    - **Zero-copy.** CPU tensors of float32 are handed to :func:`fastattn.attention` as
      NumPy views of the same memory (``torch.Tensor.numpy()``), and the result is written
      straight into the ``(batch, Lq, heads, Dv)`` tensor returned to the model.  float16
      and bfloat16 are read in place too (computed in float32, returned in their dtype);
      bfloat16, which NumPy lacks, as ``ml_dtypes.bfloat16`` bits when ``ml_dtypes`` is
      installed, else upcast to a float32 copy.
    - **GQA / MQA.** Keys and values keep their fewer heads; fastattn maps query head ``h``
      to key/value head ``h // (Hq // Hkv)``, as ``repeat_kv`` would, without the copy.
    - **Masks.** Padding (left or right), causal and sliding-window masks all arrive in
      the boolean mask.  transformers' sliding window of size ``w`` lets query position
      ``i`` see keys ``i - w < j <= i``, which is fastattn's ``window=(w - 1, 0)`` with
      ``causal=True``.  Without a mask, a causal layer with more than one query row uses
      PyTorch's top-left causal alignment, as ``sdpa`` does.
    - **Score modifiers.** Attention-logit soft-capping (Gemma 2) and attention sinks
      (gpt-oss) are passed on as fastattn's ``softcap`` and ``sinks``.
    - **Training.** When autograd records the call (grad mode on and an input that
      requires grad), the operator's backward is :func:`fastattn.attention_backward`.
    - **torch.compile.** The call is the operator ``torch.ops.fastattn.attention``, which
      ``torch.compile`` keeps in its graph.
    - **Precision.** float32 calls follow :func:`fastattn.set_float32_precision` (exact
      float32 by default), not ``torch.set_float32_matmul_precision``.
    - The attention weights are not returned (``None``), as with ``sdpa``; with
      ``output_attentions=True`` the call runs as ``eager`` (see ``fallback``).
    - **Continuous batching.** ``model.generate_batch`` and ``ContinuousBatchingManager``
      run a model loaded on ``name`` on fastattn too, reading transformers' paged cache in
      place (:mod:`fastattn.integrations._paged`), on transformers 5.23 to 5.24.  The
      internals this reads are checked when registered and when used; where one differs,
      batching runs on transformers' own cache path with one warning naming the release,
      and the same tokens.  transformers admits to continuous
      batching only "sdpa", "paged|eager" and names containing "flash", so a second name,
      ``name + "_flash"``, is registered for it, and the manager's switch to a batching
      implementation (``switch_to_cb_friendly_attn``) moves a model on ``name`` to it and
      back when the manager stops.  Load models with ``name``, never with the second one:
      transformers looks for a flash-attention package behind any "flash" name it loads.

    Examples
    --------
    A small model with random weights generates the same tokens as with ``sdpa``:

    >>> import torch
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> import fastattn.integrations.transformers as fa_tf
    >>> fa_tf.register()
    'fastattn'
    >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> _ = torch.manual_seed(0)
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="fastattn")
    >>> prompt = torch.tensor([[1, 2, 3, 4]])
    >>> with torch.no_grad():
    ...     out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    >>> model.set_attn_implementation("sdpa")
    >>> with torch.no_grad():
    ...     torch.equal(out, model.generate(prompt, max_new_tokens=6, do_sample=False))
    True

    A trained model is loaded the same way (it needs the download):

    >>> model = AutoModelForCausalLM.from_pretrained(
    ...     "some/model", attn_implementation="fastattn")       # doctest: +SKIP
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if fallback not in _FALLBACKS:
        raise ValueError(f"fallback must be 'sdpa' or None, got {fallback!r}")
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, functools.partial(attention_forward, fallback=fallback))
    AttentionMaskInterface.register(name, sdpa_mask)
    _register_batching_twin(name, fallback)
    return name


def _register_batching_twin(name, fallback):
    """The name continuous batching runs a model on ``name`` under (see :func:`register`):
    the same attention function, and flash attention's mask function (none, or the 2-D
    padding mask), since a batching step describes its requests by their lengths.  Checks
    the internals of transformers' continuous batching that fastattn relies on
    (:data:`fastattn.integrations._paged.INTERNALS`), warning once where one differs."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask
    try:
        from transformers.generation.continuous_batching.continuous_api import (
            ContinuousBatchingManager)
    except ImportError:    # a transformers without continuous batching
        return
    from . import _paged

    twin = name + "_flash"
    AttentionInterface.register(twin, functools.partial(attention_forward, fallback=fallback))
    AttentionMaskInterface.register(twin, flash_attention_mask)
    _BATCHING_TWINS[name] = twin
    reason = _paged.install(lambda implementation: implementation in _BATCHING_TWINS.values())
    if reason is not None:
        _paged.warn_once(reason)
    switch = getattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn", None)
    if switch is None:
        _paged.warn_once("ContinuousBatchingManager has no switch_to_cb_friendly_attn",
                         "load the model with attn_implementation='sdpa' for continuous batching")
    elif not getattr(switch, "_fastattn", False):
        ContinuousBatchingManager.switch_to_cb_friendly_attn = _switch_to_twin(switch)


# name -> the name continuous batching runs it under
_BATCHING_TWINS = {}


def _switch_to_twin(switch):
    """transformers' ``switch_to_cb_friendly_attn``, which also moves a model on a name
    :func:`register` gave to that name's batching twin, setting the config as
    ``set_attn_implementation`` does but without its search for a flash package (the manager
    restores the original name, kept in ``_original_attn_impl``, when it stops).  A manager
    without that attribute could not restore it: the model then goes to ``"sdpa"``,
    transformers' own path, with a warning."""
    @functools.wraps(switch)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        current = getattr(model.config, "_attn_implementation", None)
        if current in _BATCHING_TWINS:
            if hasattr(self, "_original_attn_impl"):
                model.config._attn_implementation = _BATCHING_TWINS[current]
                self._original_attn_impl = current
                return None
            from . import _paged
            _paged.warn_once("the manager keeps no _original_attn_impl to restore the model's "
                             "attention with", "the batch and the model stay on 'sdpa'")
            model.set_attn_implementation("sdpa")
        return switch(self, model, *args, **kwargs)

    switch_to_cb_friendly_attn._fastattn = True
    return switch_to_cb_friendly_attn


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, *, fallback="sdpa", **kwargs):
    """transformers' attention-function signature, computed by :func:`fastattn.attention`.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (read for ``is_causal`` when the argument is ``None``).
    query : torch.Tensor, shape (batch, Hq, Lq, D)
    key : torch.Tensor, shape (batch, Hkv, Lk, D)
    value : torch.Tensor, shape (batch, Hkv, Lk, Dv)
        ``Hq`` a multiple of ``Hkv``.
    attention_mask : torch.Tensor or None
        Boolean (True = may attend) or additive float mask broadcastable to
        ``(batch, Hq, Lq, Lk)``, as built by the registered mask function.
    dropout : float
        Must be 0 (dropout is only asked for in training).
    scaling : float, optional
        Score scale; ``None`` means ``1 / sqrt(D)``.
    is_causal : bool, optional
        Used when ``attention_mask`` is ``None`` and ``Lq > 1`` (top-left aligned).
    fallback : {"sdpa", None}
        See :func:`register`.

    Returns
    -------
    (torch.Tensor, None)
        The output, shape (batch, Lq, Hq, Dv), dtype of ``query``; no attention weights.
    """
    import torch

    if kwargs.get("cache") is not None or "write_index" in kwargs:
        # continuous batching: a step's requests packed in one row (no mask to hand over)
        reason = _paged_unsupported(torch, query, key, value, dropout, kwargs)
        if reason is not None:
            raise NotImplementedError(
                f"fastattn cannot run this continuous-batching call: {reason}; load the "
                "model with attn_implementation='sdpa' for it")
        from . import _paged
        return _paged.attention(module, query, key, value, scaling=scaling, **kwargs)
    reason = _unsupported(torch, query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        if fallback is None:
            raise NotImplementedError(
                f"fastattn cannot run this attention call: {reason}.  Register with "
                "fallback='sdpa' to hand such calls to PyTorch's SDPA")
        to = "eager" if reason == _WEIGHTS else "sdpa"
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"fastattn hands this call (and later ones like it) to '{to}': "
                          f"{reason}", RuntimeWarning, stacklevel=2)
        if to == "eager":
            return _eager(torch, module, query, key, value, attention_mask, dropout, scaling,
                          is_causal, kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)

    from . import _ops

    causal = "none"
    if attention_mask is None:
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        # sdpa's rule: one query row (decoding) sees every key it is given; more rows are
        # causal with PyTorch's top-left alignment (a static cache's unused tail is hidden).
        if is_causal and query.shape[-2] > 1:
            causal = "top-left"
    softcap = kwargs.get("softcap")
    # The operator reads the band of a boolean mask (causal, sliding window) and skips the
    # key blocks outside it; its result, laid out (batch, Lq, Hq, Dv), is what the model
    # reads, so the transpose below is free.
    out, _ = _ops.call_attention(
        query, key, value, scale=scaling, causal=causal, mask=attention_mask,
        softcap=None if softcap is None else float(softcap),
        sinks=kwargs.get("s_aux", kwargs.get("sinks")))
    return out.transpose(1, 2), None


# --------------------------------------------------------------------------- helpers

# The reason that only an implementation returning the weights can serve.
_WEIGHTS = "output_attentions=True (the weights are computed by 'eager')"


def _eager(torch, module, query, key, value, attention_mask, dropout, scaling, is_causal,
           kwargs):
    """The call by the model's own ``eager_attention_forward`` (defined beside its attention
    layer), which returns the attention weights.  Eager adds its mask to the scores, so the
    boolean mask of the registered (sdpa) mask function becomes an additive one, and no
    mask becomes sdpa's causal rule written out."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"fastattn cannot return attention weights, and {type(module).__name__}'s module "
            "has no eager_attention_forward to hand the call to; use "
            "attn_implementation='eager'")
    Lq, Lk = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        if is_causal and Lq > 1:   # top-left, as sdpa aligns it
            attention_mask = torch.ones(Lq, Lk, dtype=torch.bool, device=query.device).tril()
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype,
                                     device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                 **kwargs)


def _paged_unsupported(torch, query, key, value, dropout, kwargs):
    """Why fastattn cannot read this call's paged cache (continuous batching) in place, or
    None if it can."""
    if not (query.is_cpu and key.is_cpu and value.is_cpu):
        return "tensors not on the CPU"
    if dropout or kwargs.get("output_attentions") or kwargs.get("position_bias") is not None:
        return "dropout, output_attentions or a position_bias"
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {query.dtype}"
    if query.dtype == torch.bfloat16 and _ops_bfloat16() is None:
        return "a bfloat16 cache without ml_dtypes (pip install ml_dtypes)"
    return None


def _ops_bfloat16():
    from . import _ops
    return _ops.bfloat16_dtype()


def _unsupported(torch, query, key, value, attention_mask, dropout, kwargs):
    """Why fastattn cannot take this call (a short phrase), or None if it can."""
    if not (query.is_cpu and key.is_cpu and value.is_cpu
            and (attention_mask is None or attention_mask.is_cpu)):
        devices = {t.device.type for t in (query, key, value, attention_mask) if t is not None}
        return f"tensors on {', '.join(sorted(devices - {'cpu'}))} (fastattn runs on the CPU)"
    if dropout:
        return f"dropout={dropout} (the module is in training mode)"
    if kwargs.get("position_bias") is not None:
        return "a position_bias (additive relative-position scores)"
    if kwargs.get("output_attentions"):
        return _WEIGHTS
    known = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    if not (query.dtype in known and key.dtype in known and value.dtype in known):
        return f"dtype {sorted(map(str, {query.dtype, key.dtype, value.dtype}))}"
    return None

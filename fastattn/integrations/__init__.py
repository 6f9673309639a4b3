"""fastattn as the attention kernel of other frameworks.

Each submodule plugs fastattn into one framework through that framework's own extension
point, and imports the framework only when its ``register()`` is called: importing
``fastattn`` or ``fastattn.integrations`` never imports torch, and fastattn's runtime
dependency stays NumPy alone.

- ``fastattn.integrations.transformers``: ``register(name="fastattn")`` adds an attention
  implementation (and its mask function) to Hugging Face transformers, used with
  ``attn_implementation="fastattn"``.
- ``fastattn.integrations.tabpfn``: ``register()`` adds an attention backend that TabPFN
  prefers for its CPU calls.
- ``fastattn.integrations.torch``: ``scaled_dot_product_attention`` and ``attention`` as
  differentiable torch operations (their backward is :func:`fastattn.attention_backward`),
  which the transformers and TabPFN backends use when autograd records a call.
- ``fastattn.integrations.dask``: ``attention(q, k, v, ...)`` on dask arrays, one task per
  block of batch elements and heads, keys split across chunks merged exactly.

The torch-based integrations hand torch's CPU tensors to fastattn as NumPy views of the
same memory (``torch.Tensor.numpy()``), so float32 inputs are not copied.
"""

__all__ = ["dask", "tabpfn", "torch", "transformers"]

"""fastattn as the attention kernel of other frameworks.

Each submodule plugs fastattn into one framework through that framework's own extension
point, and imports the framework only when its ``register()`` is called: importing
``fastattn`` or ``fastattn.integrations`` never imports torch, and fastattn's runtime
dependency stays NumPy alone.

- ``fastattn.integrations.transformers``: ``register(name="fastattn")`` adds an attention
  implementation (and its mask function) to Hugging Face transformers, used with
  ``attn_implementation="fastattn"``.
- ``fastattn.integrations.tabpfn``: ``register()`` adds an attention backend that TabPFN
  prefers for its CPU inference calls.
- ``fastattn.integrations.dask``: ``attention(q, k, v, ...)`` on dask arrays, one task per
  block of batch elements and heads, keys split across chunks merged exactly.

The first two hand torch's CPU tensors to :func:`fastattn.attention` as NumPy views of the same
memory (``torch.Tensor.numpy()``), so float32 inputs and the result are not copied.
"""

__all__ = ["dask", "tabpfn", "transformers"]

"""fastattn as an attention backend of TabPFN.

TabPFN (>= 9.2) routes every attention call of its architectures through one SDPA wrapper,
``tabpfn.architectures.shared.scaled_dot_product_attention``, which asks a registry of
backends (``tabpfn.architectures.shared.attention_backends``) whether one of them prefers
the call; if none does, torch's SDPA runs.  ``register()`` puts fastattn at the front of
that registry for the calls it can take: CPU tensors, in inference and in training.
"""
__all__ = ["register", "unregister", "FastattnBackend"]

_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")


class FastattnBackend:
    """A TabPFN attention backend computed by :func:`fastattn.attention`.

    Follows TabPFN's ``AttentionBackend`` protocol: ``is_preferred(spec)`` decides from
    the call's shapes alone, ``run(q, k, v)`` computes it on ``(B, S, H, D)`` tensors.

    Attributes
    ----------
    name : str
        ``"fastattn"``, the name it is registered under.
    """

    name = "fastattn"

    def is_preferred(self, spec):
        """Whether fastattn takes a call: CPU tensors of float32/float16/bfloat16/float64,
        keys present, ``Hq`` a multiple of ``Hkv``.  Calls under autograd and inside
        ``torch.compile`` are taken too: they run as the operator
        ``torch.ops.fastattn.attention``, whose backward is fastattn's.
        """
        return (
            spec.device.type == "cpu"
            and str(spec.dtype).rpartition(".")[2] in _DTYPE_NAMES
            and spec.seq_len_kv is not None
            and spec.num_kv_heads > 0
            and spec.num_heads % spec.num_kv_heads == 0
        )

    def run(self, q_BSHD, k_BSJD, v_BSJD, **_informational):
        """Attention of ``q`` (B, Sq, Hq, D) over ``k``, ``v`` (B, Sk, Hkv, D/Dv).

        Returns a new (B, Sq, Hq, Dv) tensor in the dtype of ``q``.  The batch dimension
        broadcasts (as in torch's SDPA); query head ``h`` reads key/value head
        ``h // (Hq // Hkv)``.  float32 inputs are read in place and the result is written
        in place (the (B, H, S, D) views fastattn reads are transposes of the tensors).
        """
        from . import _ops

        if k_BSJD is None or v_BSJD is None:
            raise ValueError("fastattn's TabPFN backend needs dense keys and values, got None")
        # The operator's result is laid out (B, Sq, Hq, Dv): its transpose is that tensor.
        out, _ = _ops.call_attention(
            *(t.transpose(1, 2) for t in (q_BSHD, k_BSJD, v_BSJD)))
        return out.transpose(1, 2)

    def __repr__(self):
        return "FastattnBackend()"


_BACKEND = FastattnBackend()


def register():
    """Register fastattn with TabPFN's attention backends, ahead of those registered before.

    From then on TabPFN runs its CPU attention on fastattn, inference and fine-tuning
    (calls under autograd use fastattn's backward); CUDA/MPS calls keep their usual path.
    Calling it again is a no-op.  Needs ``tabpfn >= 9.2`` (``register_attention_backend``).

    Returns
    -------
    FastattnBackend
        The registered backend.

    Notes
    -----
    q, k and v arrive as ``(B, S, H, D)`` tensors; fastattn reads them as ``(B, H, S, D)``
    transposed views, so float32 (and float16, through fastattn's float16 path) inputs are
    not copied, and the result is written in place into the returned tensor.  bfloat16 is
    read in place too when ``ml_dtypes`` is installed, else upcast to float32 copies.

    Examples
    --------
    >>> import fastattn.integrations.tabpfn                      # doctest: +SKIP
    >>> fastattn.integrations.tabpfn.register()                  # doctest: +SKIP
    FastattnBackend()
    >>> from tabpfn import TabPFNClassifier                      # doctest: +SKIP
    >>> clf = TabPFNClassifier(device="cpu").fit(X_train, y_train)  # doctest: +SKIP
    >>> clf.predict(X_test)              # attention on fastattn  # doctest: +SKIP
    """
    try:
        from tabpfn.architectures.shared.attention_backends import register_attention_backend
    except ImportError as e:
        raise ImportError(
            "fastattn.integrations.tabpfn needs tabpfn >= 9.2, which has "
            f"tabpfn.architectures.shared.attention_backends ({e})") from None
    # The SDPA module registers TabPFN's own (GPU / Apple) backends at its import: import it
    # first, so that fastattn, registered after, is consulted before them.
    import tabpfn.architectures.shared.scaled_dot_product_attention  # noqa: F401

    register_attention_backend(_BACKEND)
    return _BACKEND


def unregister():
    """Remove fastattn from TabPFN's attention backends (a no-op if it is not there)."""
    from tabpfn.architectures.shared.attention_backends import unregister_attention_backend

    unregister_attention_backend(FastattnBackend.name)

"""``torch.nn.MultiheadAttention`` state dicts as ``fastattn.MultiHeadAttention`` layers.

The code behind ``MultiHeadAttention.from_torch_state_dict``.  torch is never imported:
a state dict's tensors are recognised by their ``detach`` method and read as NumPy arrays,
so a state dict of NumPy arrays or lists works without torch installed.

torch computes ``x @ W.T + b`` with the query, key and value weights stacked in one
``in_proj_weight (3E, E)`` (or separate ``q_proj_weight`` / ``k_proj_weight`` /
``v_proj_weight`` when the module was built with ``kdim``/``vdim``); fastattn's layer
computes ``x @ w + b``, so each weight is transposed.
"""
import numpy as np

from .._calls import args as _args


def _reader(state_dict, prefix):
    """``get(name, required=True)``: ``state_dict[prefix + name]`` as a NumPy array."""
    def get(name, required=True):
        key = prefix + name
        if key not in state_dict:
            if required:
                raise ValueError(f"state_dict has no key {key!r} (keys: {sorted(state_dict)})")
            return None
        t = state_dict[key]
        if hasattr(t, "detach"):          # a torch tensor, without importing torch
            t = t.detach().cpu().numpy()
        return _args.check_array(t, f"state_dict[{key!r}]")

    return get


def _input_projections(get, state_dict, prefix, n_heads, n_kv_heads):
    """``(E, w_q, w_k, w_v)``, torch's ``(rows, E)`` weights, checked against each other."""
    if prefix + "in_proj_weight" in state_dict:
        w_in = get("in_proj_weight")
        if w_in.ndim != 2 or w_in.shape[0] != 3 * w_in.shape[1]:
            raise ValueError(
                f"state_dict['{prefix}in_proj_weight'] must have shape (3E, E), got {w_in.shape}"
            )
        E = w_in.shape[1]
        return E, w_in[:E], w_in[E:2 * E], w_in[2 * E:]
    w_q, w_k, w_v = get("q_proj_weight"), get("k_proj_weight"), get("v_proj_weight")
    E = w_q.shape[0]
    # Grouped-query projections: k and v have n_kv_heads heads of E // n_heads.
    n_kv = n_kv_heads or n_heads
    E_kv = E // n_heads * n_kv if E % n_heads == 0 else E
    for name, w, rows in (("q_proj_weight", w_q, E), ("k_proj_weight", w_k, E_kv),
                          ("v_proj_weight", w_v, E_kv)):
        if w.shape != (rows, E):
            raise ValueError(
                f"state_dict['{prefix}{name}'] has shape {w.shape}, expected "
                f"({rows}, {E}) for embed_dim {E}, n_heads {n_heads} and n_kv_heads "
                f"{n_kv} (self-attention: kdim == vdim == embed_dim)"
            )
    return E, w_q, w_k, w_v


def _output_and_biases(get, prefix, E, E_k):
    """``(w_out, b_in, b_out)``; the biases are None when the state dict has none."""
    w_out = get("out_proj.weight")
    if w_out.shape != (E, E):
        raise ValueError(f"state_dict['{prefix}out_proj.weight'] must have shape ({E}, {E}), "
                         f"got {w_out.shape}")
    b_in, b_out = get("in_proj_bias", False), get("out_proj.bias", False)
    if b_in is not None and b_in.shape != (E + 2 * E_k,):
        raise ValueError(f"state_dict['{prefix}in_proj_bias'] must have shape "
                         f"({E + 2 * E_k},), got {b_in.shape}")
    if b_out is not None and b_out.shape != (E,):
        raise ValueError(f"state_dict['{prefix}out_proj.bias'] must have shape ({E},), "
                         f"got {b_out.shape}")
    return w_out, b_in, b_out


def layer_from_state_dict(cls, state_dict, n_heads, *, prefix="", dtype=None, **kwargs):
    """An instance of ``cls`` (``MultiHeadAttention``) holding the state dict's weights;
    the arguments are ``MultiHeadAttention.from_torch_state_dict``'s."""
    get = _reader(state_dict, prefix)
    for unsupported in ("bias_k", "bias_v"):
        if prefix + unsupported in state_dict:
            raise ValueError(
                f"state_dict has {prefix + unsupported!r}: add_bias_kv=True is not supported"
            )
    E, w_q, w_k, w_v = _input_projections(get, state_dict, prefix, n_heads,
                                          kwargs.get("n_kv_heads"))
    E_k = w_k.shape[0]
    w_out, b_in, b_out = _output_and_biases(get, prefix, E, E_k)
    if dtype is None:
        dtype = np.result_type(w_q, w_out)
        dtype = dtype if dtype.kind == "f" else np.dtype(np.float32)
    has_bias = b_in is not None or b_out is not None
    layer = cls(E, n_heads, bias=has_bias, dtype=dtype, **kwargs)

    def conv(a):
        return np.ascontiguousarray(a, dtype=layer.dtype)

    layer.w_q, layer.w_k, layer.w_v = conv(w_q.T), conv(w_k.T), conv(w_v.T)
    layer.w_o = conv(w_out.T)
    if b_in is not None:
        layer.b_q, layer.b_k, layer.b_v = (conv(b_in[:E]), conv(b_in[E:E + E_k]),
                                           conv(b_in[E + E_k:]))
    if b_out is not None:
        layer.b_o = conv(b_out)
    return layer

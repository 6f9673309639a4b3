"""fastattn as a transformers attention implementation, against ``attn_implementation="sdpa"``.

Models are tiny and randomly initialised from a config (no download).  Their weights are
drawn with ``initializer_range=0.5`` rather than the usual 0.02 so that attention is peaked:
then a wrong key, a lost padding mask or a window off by one moves the logits by O(1)
(ignoring the padding of the Llama batch below moves them by ~16), while the two
implementations' float32 roundings differ by ~3e-5 on logits of size ~15.  Logits are
compared with an absolute tolerance of 1e-5 times their largest magnitude (x 1e-4 for the
model runs, whose two layers and RMS norms amplify rounding differences), and greedy
generation must give identical tokens.

The attention function itself is checked on random tensors against torch's SDPA in float64,
with the tolerances of tests/conftest.py.
"""
import copy
import warnings

import numpy as np
import pytest

from conftest import assert_close, import_optional, make_qkv

torch = import_optional("torch")
transformers = import_optional("transformers")
F = torch.nn.functional

import fastattn  # noqa: E402
from fastattn.integrations import _ops, transformers as fa_tf  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

STRICT = "fastattn-strict"


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert fa_tf.register() == "fastattn"
    assert fa_tf.register(STRICT, fallback=None) == STRICT


@pytest.fixture
def calls(monkeypatch):
    """Record the arguments of every fastattn.attention call the integration makes."""
    seen = []
    real = fastattn.attention

    def spy(q, k, v, **kw):
        seen.append(dict(kw, q=q, k=k, v=v))
        return real(q, k, v, **kw)

    monkeypatch.setattr(fastattn, "attention", spy)
    return seen


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# --------------------------------------------------------------------------- models

def pair(config, model_cls, dtype=torch.float32):
    """The same random model twice: under "sdpa" and under "fastattn"."""
    torch.manual_seed(0)
    ref = model_cls._from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                 dtype=dtype).eval()
    fa = model_cls._from_config(copy.deepcopy(config), attn_implementation="fastattn",
                                dtype=dtype).eval()
    fa.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "sdpa"
    assert fa.config._attn_implementation == "fastattn"
    return ref, fa


def llama_config(**kw):
    # GQA (4 query heads on 2 key/value heads), RoPE, head_dim 16.
    return transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.5, **kw)


def mistral_config(sliding_window):
    return transformers.MistralConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=sliding_window, initializer_range=0.5)


def assert_logits_close(actual, expected, rel=1e-4):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double().numpy(), expected.double().numpy()
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, e, rtol=0, atol=rel * np.abs(e).max())


def ids_and_left_padding(B=3, L=19, pads=(0, 5, 11), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
        ids[b, :p] = 0  # a pad token id
    return ids, mask


def test_llama_logits_and_generate(calls):
    ref, fa = pair(llama_config(), transformers.LlamaForCausalLM)
    ids, _ = ids_and_left_padding(B=2, pads=(0, 0))
    assert_logits_close(fa(ids).logits, ref(ids).logits)
    # GQA reaches fastattn without repeat_kv: keys and values keep their 2 heads.
    assert calls and all(c["q"].shape[1] == 4 and c["k"].shape[1] == 2 for c in calls)
    # No mask: a causal layer over a whole prompt is top-left causal, as in sdpa.
    assert calls[0]["causal"] == "top-left" and calls[0]["mask"] is None
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = ref.generate(ids, **gen)
    assert torch.equal(fa.generate(ids, **gen), expected)
    assert expected.shape[1] == ids.shape[1] + 12


def test_llama_left_padded_batch(calls):
    ref, fa = pair(llama_config(), transformers.LlamaForCausalLM)
    ids, mask = ids_and_left_padding()
    expected = ref(ids, attention_mask=mask).logits
    real = mask.bool()
    assert_logits_close(fa(ids, attention_mask=mask).logits[real], expected[real])
    # The mask function delivered the padding: without it the rows of the padded
    # sequences would differ from sdpa's by O(1) (checked here against the unpadded run).
    assert calls[0]["mask"] is not None and calls[0]["mask"].dtype == bool
    assert calls[0]["causal"] is True  # read from the mask: lets fastattn skip blocks
    unmasked = ref(ids).logits
    assert (unmasked[1][real[1]] - expected[1][real[1]]).abs().max() > 1.0
    gen = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(fa.generate(ids, **gen), ref.generate(ids, **gen))


@pytest.mark.parametrize("window", [1, 4, 7])
def test_mistral_sliding_window(calls, window):
    ref, fa = pair(mistral_config(window), transformers.MistralForCausalLM)
    ids, _ = ids_and_left_padding(B=2, L=23, pads=(0, 0))
    expected = ref(ids).logits
    assert_logits_close(fa(ids).logits, expected)
    # transformers' window w: query i sees keys i - w < j <= i, fastattn's (w - 1, 0);
    # with nothing else in the mask the mask itself is dropped.
    assert calls[0]["causal"] is True and calls[0]["window"] == (window - 1, 0)
    assert calls[0]["mask"] is None
    # The window matters here: the same weights without it give other logits.
    full = copy.deepcopy(ref.config)
    full.sliding_window = None
    unwindowed = transformers.MistralForCausalLM._from_config(full, attn_implementation="sdpa")
    unwindowed.load_state_dict(ref.state_dict())
    assert (unwindowed.eval()(ids).logits - expected).abs().max() > 1.0
    # Decoding past the window, with left padding, through the sliding-window cache.
    ids, mask = ids_and_left_padding(B=2, L=11, pads=(0, 3))
    gen = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(fa.generate(ids, **gen), ref.generate(ids, **gen))


def test_mistral_window_with_padding():
    ref, fa = pair(mistral_config(5), transformers.MistralForCausalLM)
    ids, mask = ids_and_left_padding(B=3, L=17, pads=(0, 2, 9))
    real = mask.bool()
    assert_logits_close(fa(ids, attention_mask=mask).logits[real],
                        ref(ids, attention_mask=mask).logits[real])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_llama_reduced_precision(dtype):
    ref, fa = pair(llama_config(), transformers.LlamaForCausalLM, dtype)
    ids, mask = ids_and_left_padding()
    real = mask.bool()
    got = fa(ids, attention_mask=mask).logits
    assert got.dtype == dtype
    # Both sides round every layer's activations to the storage dtype: allow a few of its
    # ulps (2**-10 for float16, 2**-7 for bfloat16) of the logits' size.
    ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)
    assert_logits_close(got[real], ref(ids, attention_mask=mask).logits[real], rel=8 * ulp)


# --------------------------------------------------------------------------- the function

class Layer(torch.nn.Module):
    """What the attention function reads from a model's attention layer."""

    def __init__(self, groups=1, is_causal=True):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = is_causal
        self.layer_idx = 0


def tensors(arrays, dtype=torch.float32):
    """NumPy arrays as torch tensors of ``dtype`` (float32 ones share the arrays' memory)."""
    return tuple(torch.from_numpy(a).to(dtype) for a in arrays)


def sdpa64(q, k, v, mask=None, **kw):
    """torch's SDPA in float64, GQA by repeating heads, as (B, Lq, H, Dv)."""
    rep = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(rep, dim=1)
    v = v.double().repeat_interleave(rep, dim=1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, **kw).transpose(1, 2)


def check(out, expected, dtype):
    assert out.dtype == dtype
    assert out.is_contiguous()
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}.get(dtype)
    if np_dtype is None:  # bfloat16: rounded once from float32, 2**-8 relative at most
        np.testing.assert_allclose(out.double().numpy(), expected.numpy(), rtol=8e-3, atol=8e-3)
    else:
        assert_close(out.numpy(), expected.numpy().astype(np_dtype).astype(np.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (6, 2), (4, 1)])
def test_function_left_padding_mask(calls, dtype, Hq, Hkv):
    q, k, v = tensors(make_qkv(0, batch=(3,), Hq=Hq, Hkv=Hkv, Lq=9, D=16, Dv=8), dtype)
    valid = torch.arange(9)[None, :] >= torch.tensor([0, 3, 8])[:, None]  # left padding
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    out, weights = fa_tf.attention_forward(Layer(Hq // Hkv), q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (3, 9, Hq, 8)
    # Padding query rows see no key: zeros, as torch gives.
    check(out, sdpa64(q, k, v, mask, scale=0.3), dtype)
    assert calls[0]["k"].shape[1] == Hkv and calls[0]["scale"] == 0.3


def test_function_is_zero_copy_for_float32(calls):
    q, k, v = tensors(make_qkv(0, batch=(2,), Hq=4, Hkv=2, Lq=5, Lk=7, D=16))
    # A layer's q and k are views, e.g. a transpose of (B, L, H, D) projections.
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    out, _ = fa_tf.attention_forward(Layer(2), q, k, v, None)
    c = calls[0]
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert np.shares_memory(c[name], t.numpy()), name
    assert np.shares_memory(c["out"], out.numpy())
    check(out, sdpa64(q, k, v, is_causal=True), torch.float32)


@pytest.mark.parametrize("Lq, Lk", [(1, 9), (4, 9), (9, 9)])
def test_function_without_mask(Lq, Lk):
    # No mask: one query row (decoding) sees all keys; several rows are top-left causal,
    # which hides a static cache's unused tail (keys past Lq) as sdpa does.
    q, k, v = tensors(make_qkv(0, batch=(2,), Hq=4, Hkv=2, Lq=Lq, Lk=Lk, D=8))
    out, _ = fa_tf.attention_forward(Layer(2), q, k, v, None)
    check(out, sdpa64(q, k, v, is_causal=Lq > 1), torch.float32)
    out, _ = fa_tf.attention_forward(Layer(2, is_causal=False), q, k, v, None)
    check(out, sdpa64(q, k, v), torch.float32)


def test_function_float_mask():
    q, k, v = tensors(make_qkv(0, batch=(2,), Hq=4, Lq=6, Lk=10, D=8))
    g = torch.Generator().manual_seed(3)
    mask = torch.randn(2, 1, 6, 10, generator=g)
    mask[:, :, :, 7:] = torch.finfo(torch.float32).min
    out, _ = fa_tf.attention_forward(Layer(), q, k, v, mask)
    check(out, sdpa64(q, k, v, mask), torch.float32)


@pytest.mark.parametrize("seed", range(6))
def test_function_random_bool_masks(calls, seed):
    # Any boolean mask: the structure read from it (a superset band) never changes a row.
    g = torch.Generator().manual_seed(seed)
    Lq, Lk = int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    mask = torch.rand(2, 1, Lq, Lk, generator=g) < 0.6
    mask &= torch.rand(1, 1, Lq, Lk, generator=g) < 0.8
    if seed % 2:
        d = torch.arange(Lk)[None, :] - torch.arange(Lq)[:, None] - (Lk - Lq)
        mask &= (d <= 0) & (d >= -seed)
    q, k, v = tensors(make_qkv(seed, batch=(2,), Hq=4, Hkv=2, Lq=Lq, Lk=Lk, D=8))
    out, _ = fa_tf.attention_forward(Layer(2), q, k, v, mask)
    check(out, sdpa64(q, k, v, mask), torch.float32)


def _band(Lq, Lk, left, right):
    d = torch.arange(Lk)[None, :] - torch.arange(Lq)[:, None] - (Lk - Lq)
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if left != -1:
        ok &= d >= -left
    if right != -1:
        ok &= d <= right
    return ok


@pytest.mark.parametrize("Lq, Lk", [(6, 6), (3, 10), (1, 10)])
def test_mask_structure(Lq, Lk):
    plan = lambda m: _ops.derive_structure(m[None, None], Lq, Lk)  # noqa: E731
    # One query row (decoding): bottom-right causal is no restriction, "right" unbounded.
    right = 0 if Lq > 1 else -1
    causal = _band(Lq, Lk, -1, 0)
    assert plan(causal) == (Lq > 1, None, False)
    assert plan(_band(Lq, Lk, 2, 0)) == (Lq > 1, (2, right) if Lq == 1 else (2, 0), False)
    assert plan(torch.ones(Lq, Lk, dtype=torch.bool)) == (False, None, False)
    padded = causal.clone()
    padded[:, :1] = False  # key 0 hidden: the band shrinks by one key, the mask stays
    assert plan(padded) == (Lq > 1, (Lk - 2, right), Lq > 1)  # one row: exactly that band
    if Lq > 1:
        assert plan(_band(Lq, Lk, 1, 1)) == (False, (1, 1), False)


def test_mask_structure_is_cached_per_tensor(calls):
    q, k, v = tensors(make_qkv(0, batch=(1,), Hq=2, Lq=5, D=8))
    mask = _band(5, 5, 1, 0)[None, None].clone()
    fa_tf.attention_forward(Layer(), q, k, v, mask)
    assert calls[-1]["window"] == (1, 0)
    mask[..., 0, 0] = False  # an in-place change (row 0 then sees no key) is noticed
    out, _ = fa_tf.attention_forward(Layer(), q, k, v, mask)
    assert calls[-1]["mask"] is not None
    check(out, sdpa64(q, k, v, mask), torch.float32)


# --------------------------------------------------------------------------- what it defers

def _deferred_cases():
    q, k, v = tensors(make_qkv(0, batch=(1,), Hq=4, Hkv=2, Lq=5, D=8))
    meta = [t.to("meta") for t in (q, k, v)]
    return {
        "dropout": ((q, k, v), {"dropout": 0.1}),
        "meta": (meta, {}),
        "position_bias": ((q, k, v), {"position_bias": torch.zeros(1, 4, 5, 5)}),
    }


@pytest.mark.parametrize("case", ["dropout", "meta", "position_bias"])
def test_deferred_to_sdpa(calls, case):
    tensors, kw = _deferred_cases()[case]
    fa_tf._warned.clear()
    with torch.enable_grad():
        with pytest.warns(RuntimeWarning, match="to 'sdpa'"):
            out, _ = fa_tf.attention_forward(Layer(2), *tensors, None, **kw)
        assert not calls  # fastattn was not called
        if case not in ("dropout", "meta"):  # dropout is random; meta tensors hold no data
            torch.manual_seed(0)
            expected, _ = sdpa_attention_forward(Layer(2), *tensors, None, **kw)
            assert torch.equal(out, expected)
        with pytest.raises(NotImplementedError, match="fallback='sdpa'"):
            fa_tf.attention_forward(Layer(2), *tensors, None, fallback=None, **kw)
        # One warning per reason, not one per call.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fa_tf.attention_forward(Layer(2), *tensors, None, **kw)


@pytest.mark.parametrize("padded", [False, True])
def test_output_attentions_runs_as_eager_and_returns_its_weights(calls, padded):
    # sdpa cannot return the weights either: the call goes to the model's eager function,
    # with one warning, and the weights and logits are eager's own.
    torch.manual_seed(0)
    config = llama_config()
    eager = transformers.LlamaForCausalLM._from_config(
        copy.deepcopy(config), attn_implementation="eager").eval()
    fa = transformers.LlamaForCausalLM._from_config(
        copy.deepcopy(config), attn_implementation="fastattn").eval()
    fa.load_state_dict(eager.state_dict())
    ids, mask = ids_and_left_padding(pads=(0, 5, 11) if padded else (0, 0, 0))
    kw = dict(attention_mask=mask) if padded else {}
    fa_tf._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fa(ids, output_attentions=True, **kw)
    assert [str(w.message) for w in caught if "eager" in str(w.message)] and len(caught) == 1
    want = eager(ids, output_attentions=True, **kw)
    assert len(got.attentions) == config.num_hidden_layers
    for a, b in zip(got.attentions, want.attentions):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(got.logits, want.logits)
    assert not calls   # fastattn was not called: eager computed the weights
    q, k, v = tensors(make_qkv(0, batch=(1,), Hq=4, Hkv=2, Lq=5, D=16))
    with pytest.raises(NotImplementedError, match="output_attentions"):
        fa_tf.attention_forward(fa.model.layers[0].self_attn, q, k, v, None,
                                output_attentions=True, fallback=None)


def test_training_gradients_match_sdpa_with_nothing_deferred():
    # A random Llama in train mode, left padding, fallback=None: every attention call runs
    # on fastattn's forward and backward, and the parameter gradients are sdpa's.
    ref, fa = pair(llama_config(), transformers.LlamaForCausalLM, dtype=torch.float64)
    fa.set_attn_implementation(STRICT)
    ids, mask = ids_and_left_padding()
    grads = []
    for model in (ref, fa):
        model.train()
        with torch.enable_grad():
            loss = model(ids, attention_mask=mask, labels=ids).loss
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for (name, _), got, want in zip(fa.named_parameters(), grads[1], grads[0]):
        scale = max(float(want.abs().max()), 1e-30)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-9 * scale,
                                   err_msg=name)


def _gemma2():
    config = transformers.Gemma2Config(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        attn_logit_softcapping=5.0, final_logit_softcapping=None, initializer_range=0.5)
    torch.manual_seed(0)
    ref = transformers.Gemma2ForCausalLM._from_config(copy.deepcopy(config),
                                                      attn_implementation="eager").eval()
    fa = transformers.Gemma2ForCausalLM._from_config(copy.deepcopy(config),
                                                     attn_implementation="fastattn").eval()
    fa.load_state_dict(ref.state_dict())
    return ref, fa


def test_softcap_matches_eager():
    # Gemma 2 soft-caps its logits: fastattn's softcap must match transformers' eager
    # attention.
    ref, fa = _gemma2()
    ids, _ = ids_and_left_padding(B=2, L=13, pads=(0, 0))
    assert_logits_close(fa(ids).logits, ref(ids).logits)


def test_sinks_match_eager():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = tensors(make_qkv(0, batch=(1,), Hq=4, Hkv=2, Lq=5, D=8))
    sinks = torch.randn(4)
    layer = Layer(2)
    layer.sinks = sinks
    layer.training = False
    mask = _band(5, 5, -1, 0)[None, None]
    expected, _ = eager_attention_forward(layer, q, k, v, torch.where(mask, 0.0, -torch.inf),
                                          scaling=8 ** -0.5, dropout=0.0)
    out, _ = fa_tf.attention_forward(layer, q, k, v, mask, s_aux=sinks)
    check(out, expected.double(), torch.float32)


def test_register_arguments():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    assert "fastattn" in AttentionInterface._global_mapping
    assert AttentionMaskInterface._global_mapping["fastattn"] is sdpa_mask
    with pytest.raises(TypeError, match="name"):
        fa_tf.register("")
    with pytest.raises(ValueError, match="fallback"):
        fa_tf.register(fallback="eager")


def test_continuous_batching_call_it_cannot_read_is_refused():
    # A batching step packs its requests in one row without a mask: handing such a call
    # to sdpa would let requests see each other, so it is refused, naming why.
    q = torch.zeros(1, 4, 3, 16, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="continuous-batching call: dtype"):
        fa_tf.attention_forward(Layer(2), q, q[:, :2], q[:, :2], None, cache=object())

"""fastattn's torch operators under torch.library's checks and torch.compile.

- ``torch.library.opcheck`` on each operator (``fastattn::attention``,
  ``fastattn::attention_backward``, ``fastattn::attention_with_kvcache``): the schema
  (declared mutations), the fake implementation against the real one (shapes, dtypes,
  strides), the autograd registration, and a trace through AOTAutograd.
- ``torch.compile(fullgraph=True)`` of code calling the torch operations compiles in one
  graph, and its results, forward and backward, have the bits of the eager call.
- Small random Hugging Face models on ``attn_implementation="fastattn"`` have no more graph
  breaks (``torch._dynamo.explain``) than on ``"sdpa"`` (Gemma 2: ``"eager"``, the only
  implementation transformers gives it besides flash attention).

Compiling is slow on a small machine: the shapes are tiny and inductor runs on one
function only.
"""
import copy
import importlib.util

import numpy as np
import pytest

from conftest import import_optional

torch = import_optional("torch")

import fastattn  # noqa: E402
from fastattn.integrations import _ops  # noqa: E402
from fastattn.integrations import torch as fa_torch  # noqa: E402

ops = torch.ops.fastattn


def randn(*shape, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    yield
    torch._dynamo.reset()


def opcheck(op, args, kwargs, skip=()):
    """torch.library.opcheck's tests of ``op`` on one call, but those in ``skip``."""
    from torch.library import opcheck as torch_opcheck
    tests = [t for t in ("test_schema", "test_autograd_registration", "test_faketensor",
                         "test_aot_dispatch_dynamic") if t not in skip]
    result = torch_opcheck(op, args, kwargs, test_utils=tests)
    assert set(result) == set(tests) and set(result.values()) == {"SUCCESS"}, result


# --------------------------------------------------------------------------- opcheck

def _attention_cases():
    q, k, v = randn(2, 4, 5, 8, grad=True), randn(2, 2, 7, 8, seed=1, grad=True), \
        randn(2, 2, 7, 6, seed=2, grad=True)
    sinks = randn(4, dtype=torch.float64, seed=3, grad=True)
    g = torch.Generator().manual_seed(4)
    bool_mask = torch.rand(2, 1, 5, 7, generator=g) < 0.7
    band = torch.ones(5, 7, dtype=torch.bool).tril(2)   # a mask the operator reads as causal
    return {
        "plain": ((q, k, v), {}),
        "causal, sinks, softcap": ((q, k, v), dict(causal="bottom-right", sinks=sinks,
                                                  softcap=3.0)),
        "bool mask, window": ((q, k, v), dict(mask=bool_mask, window=[2, 1])),
        "band mask": ((q, k, v), dict(mask=band)),
        "float mask, top-left": ((q, k, v), dict(mask=randn(5, 7, seed=5),
                                                causal="top-left", scale=0.3)),
        "lengths, alibi": ((q, k, v), dict(kv_lengths=torch.tensor([7, 4]),
                                          q_lengths=torch.tensor([5, 3]),
                                          alibi_slopes=torch.tensor([0.5, 0.25, 0.1, 0.0]))),
        "float64": (tuple(t.detach().double().requires_grad_() for t in (q, k, v)), {}),
        "float16": (tuple(t.detach().half().requires_grad_() for t in (q, k, v)), {}),
        "bfloat16": (tuple(t.detach().bfloat16().requires_grad_() for t in (q, k, v)), {}),
        "mixed": ((q.detach().double().requires_grad_(), k, v), {}),
        "broadcast batch": ((q, k[:1], v[:1]), dict(causal="bottom-right")),
        "one head": ((q[0, 0], k[0, 0], v[0, 0]), dict(causal="bottom-right")),
        "no batch": ((q[0], k[0], v[0]), {}),
    }


@pytest.mark.parametrize("sinks", [False, True])
def test_opcheck_attention_backward(sinks):
    q, k, v = randn(2, 4, 5, 8), randn(2, 2, 7, 8, seed=1), randn(2, 2, 7, 8, seed=2)
    kwargs = dict(causal="bottom-right", softcap=2.0)
    if sinks:
        kwargs["sinks"] = randn(4, dtype=torch.float64, seed=3)
    out, lse = ops.attention(q, k, v, **kwargs)
    dout, dlse = randn(*out.shape, seed=4), randn(*lse.shape, seed=5)
    opcheck(ops.attention_backward.default, (dout, q, k, v, out, lse, dlse), kwargs)


def _kvcache_cases():
    B, Hq, Hkv, D, Lmax = 2, 4, 2, 32, 16
    q, k, v = randn(B, Hq, 2, D), randn(B, Hkv, 2, D, seed=1), randn(B, Hkv, 2, D, seed=2)
    k_cache, v_cache = randn(B, Hkv, Lmax, D, seed=3), randn(B, Hkv, Lmax, D, seed=4)
    lens = torch.tensor([3, 9])
    # Pages of 4 rows, handed out in a shuffled order.
    pool_k, pool_v = (c.reshape(B, Hkv, 4, 4, D).permute(0, 2, 1, 3, 4).reshape(8, Hkv, 4, D)
                      for c in (k_cache, v_cache))
    table = torch.tensor([[5, 2, 7, 0], [1, 6, 3, 4]])
    pool_k, pool_v = pool_k[table.flatten().argsort()], pool_v[table.flatten().argsort()]
    kq, ks = (torch.from_numpy(a) for a in fastattn.quantize_q8_0(k_cache.numpy()))
    vq, vs = (torch.from_numpy(a) for a in fastattn.quantize_q8_0(v_cache.numpy()))
    k4, k4s = (torch.from_numpy(a) for a in fastattn.quantize_q4_0(k_cache.numpy()))
    v4, v4s = (torch.from_numpy(a) for a in fastattn.quantize_q4_0(v_cache.numpy()))
    cos, sin = randn(Lmax, D // 4, seed=5).cos(), randn(Lmax, D // 4, seed=5).sin()
    fp8 = {}
    if importlib.util.find_spec("ml_dtypes") is not None:
        f8s = torch.tensor([0.05, 0.2])
        k8, v8 = (torch.from_numpy(fastattn.quantize_fp8(c.numpy(), f8s.numpy()).view(np.uint8))
                  .view(torch.float8_e4m3fn) for c in (k_cache, v_cache))
        fp8 = {"fp8": ((q, k8, v8, lens), dict(k=k, v=v, k_scale=f8s, v_scale=f8s.flip(0),
                                               causal="bottom-right"))}
    return fp8 | {
        "q4_0": ((q, k4, v4, lens), dict(k=k, v=v, k_scale=k4s, v_scale=v4s)),
        "append": ((q, k_cache, v_cache, lens), dict(k=k, v=v, causal="bottom-right")),
        "decode, no new rows": ((q[:, :, :1], k_cache, v_cache, lens), {}),
        "paged": ((q, pool_k, pool_v, lens), dict(k=k, v=v, block_table=table,
                                                  causal="bottom-right")),
        "q8_0": ((q, kq, vq, lens), dict(k=k, v=v, k_scale=ks, v_scale=vs,
                                         causal="bottom-right")),
        "bfloat16": ((q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), lens),
                     dict(k=k.bfloat16(), v=v.bfloat16(), window=[4, 0])),
        "rotary, sinks": ((q, k_cache, v_cache, lens),
                          dict(k=k, v=v, rotary_cos=cos, rotary_sin=sin, causal="bottom-right",
                               sinks=randn(Hq, seed=6), softcap=4.0)),
    }


CASES = {"attention": _attention_cases, "attention_with_kvcache": _kvcache_cases}


@pytest.mark.parametrize("op, case", [(op, case) for op, cases in CASES.items()
                                      for case in cases()])
def test_opcheck(op, case):
    args, kwargs = CASES[op]()[case]
    if case == "bfloat16":
        import_optional("ml_dtypes")
    # torch's schema check compares a mutated tensor by arithmetic that CPU float8 tensors
    # do not have ("mul_cpu_reduced_float"): the fp8 cache takes the other checks
    opcheck(getattr(ops, op).default, args, kwargs,
            skip=("test_schema",) if case == "fp8" else ())


def test_operators_schemas():
    # The names and arguments others compile against.
    assert str(ops.attention.default._schema) == (
        "fastattn::attention(Tensor q, Tensor k, Tensor v, float? scale=None, "
        "str causal=\"none\", SymInt[]? window=None, Tensor? mask=None, "
        "Tensor? kv_lengths=None, Tensor? q_lengths=None, float? softcap=None, "
        "Tensor? alibi_slopes=None, Tensor? sinks=None) -> (Tensor, Tensor)")
    mutable = [a.name for a in ops.attention_with_kvcache.default._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert mutable == ["k_cache", "v_cache", "k_scale", "v_scale"]
    assert not any(a.alias_info for a in ops.attention_backward.default._schema.arguments)


def test_result_is_laid_out_rows_before_heads():
    # (B, Hq, Lq, Dv) seen, (B, Lq, Hq, Dv) in memory: a model's transpose(1, 2) and
    # reshape to (B, Lq, Hq * Dv) then cost no copy.
    out = fa_torch.attention(randn(2, 4, 5, 8), randn(2, 2, 7, 8), randn(2, 2, 7, 6))
    assert out.shape == (2, 4, 5, 6) and out.transpose(1, 2).is_contiguous()


# --------------------------------------------------------------------------- torch.compile

def _attention_loss(q, k, v, sinks, mask):
    out, lse = fa_torch.attention(q, k, v, causal=True, sinks=sinks, softcap=4.0,
                                  return_lse=True)
    y = fa_torch.scaled_dot_product_attention(out, k, v, attn_mask=mask, enable_gqa=True)
    return out, lse, y


def test_compiled_forward_and_backward_have_the_eager_bits():
    leaves = [randn(2, 4, 6, 8, grad=True), randn(2, 2, 9, 8, seed=1, grad=True),
              randn(2, 2, 9, 8, seed=2, grad=True), randn(4, seed=3, grad=True)]
    mask = torch.rand(6, 9, generator=torch.Generator().manual_seed(4)) < 0.8
    grads_out = [randn(2, 4, 6, 8, seed=5), randn(2, 4, 6, seed=6), randn(2, 4, 6, 8, seed=7)]
    results = []
    for fn in (_attention_loss, torch.compile(_attention_loss, fullgraph=True)):
        outs = fn(*leaves, mask)
        grads = torch.autograd.grad(outs, leaves, grads_out)
        results.append((outs, grads))
    (want, want_g), (got, got_g) = results
    for a, b in zip((*got, *got_g), (*want, *want_g)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _decode_step(q, k_cache, v_cache, k, v, lens):
    return fa_torch.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                           causal=True) * 2


def test_compiled_kvcache_call_appends_as_eager():
    q, k, v = randn(2, 4, 1, 32), randn(2, 2, 1, 32, seed=1), randn(2, 2, 1, 32, seed=2)
    caches = [randn(2, 2, 8, 32, seed=3), randn(2, 2, 8, 32, seed=4)]
    lens = torch.tensor([2, 5])
    copies = [c.clone() for c in caches]
    with torch.inference_mode():
        want = _decode_step(q, *copies, k, v, lens)
        got = torch.compile(_decode_step, fullgraph=True)(q, *caches, k, v, lens)
    assert torch.equal(got, want)
    for c, w in zip(caches, copies):
        assert torch.equal(c, w)
    assert torch.equal(caches[0][1, :, 5], k[1, :, 0])   # the new row, written in place


def test_eager_calls_skip_the_dispatcher_with_the_same_bits(monkeypatch):
    # With nothing to trace or record, the torch operation runs the operator's
    # implementation without torch's dispatcher: the same bits either way.
    q, k, v = randn(1, 4, 3, 16), randn(1, 2, 9, 16, seed=1), randn(1, 2, 9, 16, seed=2)
    with torch.no_grad():
        direct = fa_torch.attention(q, k, v, causal=True, return_lse=True)
        monkeypatch.setattr(_ops, "plain_eager", lambda *a: False)
        dispatched = fa_torch.attention(q, k, v, causal=True, return_lse=True)
    for a, b in zip(direct, dispatched):
        assert torch.equal(a, b)
    assert not _ops.plain_eager((q.to("meta"),), ())


# --------------------------------------------------------------------------- models

@pytest.fixture
def transformers():
    return import_optional("transformers")    # skips these tests alone when it is absent


def _model(transformers, name, impl):
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config, cls = {
        "llama": (lambda: transformers.LlamaConfig(**kw), transformers.LlamaForCausalLM),
        "mistral": (lambda: transformers.MistralConfig(sliding_window=4, **kw),
                    transformers.MistralForCausalLM),
        "gemma2": (lambda: transformers.Gemma2Config(head_dim=8, sliding_window=4,
                                                     attn_logit_softcapping=5.0, **kw),
                   transformers.Gemma2ForCausalLM),
    }[name]
    torch.manual_seed(0)
    return cls._from_config(copy.deepcopy(config()), attn_implementation=impl).eval()


@pytest.mark.parametrize("name, padded", [("llama", False), ("llama", True),
                                          ("mistral", True), ("gemma2", True)])
def test_models_have_no_more_graph_breaks_than_sdpa(transformers, name, padded):
    from fastattn.integrations import transformers as fa_tf

    fa_tf.register()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    kw = {}
    if padded:
        kw["attention_mask"] = torch.ones(2, 10, dtype=torch.long)
        kw["attention_mask"][1, :3] = 0
    counts = {}
    for impl in ("eager" if name == "gemma2" else "sdpa", "fastattn"):
        model = _model(transformers, name, impl)
        torch._dynamo.reset()
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(ids, **kw)
        counts[impl] = explained.graph_break_count
        assert explained.graph_count == explained.graph_break_count + 1
    assert counts["fastattn"] <= min(counts.values()), counts
    assert counts["fastattn"] == 0, counts

"""transformers' continuous batching (``generate_batch``) on a model loaded with "fastattn".

The oracles are independent of fastattn's batching path: each request's greedy tokens from
sequential ``generate`` (one request at a time, no paged cache), and sdpa's own
``generate_batch``.  Models are tiny and randomly initialised from a config (no download),
with ``initializer_range=0.5`` so that attention is peaked: a request that sees another's
keys, or a key off by one, changes its greedy tokens.

The batching configurations cover what a step can hold: prompts prefilled whole, prompts
prefilled in chunks over their earlier chunks' pages (16-token pages, 24 tokens a step),
steps that mix one request's prefill with others' decoding, and sliding-window layers beside
full ones.  Where an internal of transformers that fastattn reads differs (simulated by
taking it away), the batch runs on transformers' own cache path with one warning naming the
release, and the tokens stay the same.
"""
import copy
import warnings

import pytest

from conftest import import_optional

torch = import_optional("torch")
transformers = import_optional("transformers")

from fastattn.integrations import _paged, transformers as fa_tf  # noqa: E402
from transformers.generation.continuous_batching import PagedAttentionCache  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    FullAttentionCacheAllocator)

NEW_TOKENS = 12
CHUNKED = {"page_size": 16, "max_batch_tokens": 24}


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert fa_tf.register() == "fastattn"


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def warned():
    """The RuntimeWarnings fastattn gives during the test (none told before it)."""
    _paged._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    _paged._warned.clear()


def ours(caught):
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning) and "fastattn" in str(w.message)]


def config(cls, **kw):
    # GQA (4 query heads on 2 key/value heads), head_dim 16.
    return cls(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               initializer_range=0.5, **kw)


def model(cls, cfg):
    torch.manual_seed(0)
    return cls._from_config(copy.deepcopy(cfg), attn_implementation="fastattn").eval()


def llama():
    return model(transformers.LlamaForCausalLM, config(transformers.LlamaConfig))


def prompts(lengths, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 100, (n,), generator=g).tolist() for n in lengths]


SHORT = (1, 3, 7, 16, 17, 40, 64)      # 7 requests: one token to four pages


def generate_batch(m, implementation, batch, **cb):
    m.set_attn_implementation(implementation)
    greedy = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                           eos_token_id=-1, pad_token_id=0)
    cb_config = transformers.ContinuousBatchingConfig(**cb) if cb else None
    out = m.generate_batch(batch, generation_config=greedy,
                           continuous_batching_config=cb_config, progress_bar=False)
    m.set_attn_implementation("fastattn")
    tokens = [list(out[f"req_{i}"].generated_tokens) for i in range(len(batch))]
    assert all(len(t) == NEW_TOKENS for t in tokens), "a request failed (see the log)"
    return tokens


def sequential(m, batch):
    """Each request alone through ``generate`` (fastattn's regular path, checked against
    sdpa's in tests/test_integrations_transformers.py)."""
    assert m.config._attn_implementation == "fastattn"
    return [m.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in batch]


@pytest.fixture
def gathers(monkeypatch):
    """Counts the full-attention layers whose keys were gathered out of the paged cache
    (an update with rows to read) rather than read in place."""
    seen = []
    update = FullAttentionCacheAllocator.update

    def counting(self, key_states, value_states, layer_idx, read_index, write_index):
        if read_index.numel():
            seen.append(layer_idx)
        return update(self, key_states, value_states, layer_idx, read_index, write_index)

    monkeypatch.setattr(FullAttentionCacheAllocator, "update", counting)
    return seen


@pytest.mark.parametrize("cb", [{}, CHUNKED], ids=["whole", "chunked"])
def test_short_prompts_give_sequential_tokens(cb, gathers, warned):
    m = llama()
    batch = prompts(SHORT)
    got = generate_batch(m, "fastattn", batch, **cb)
    assert got == sequential(m, batch)
    assert got == generate_batch(m, "sdpa", batch, **cb)
    assert not ours(warned)
    assert m.config._attn_implementation == "fastattn"   # restored when the manager stopped


def test_long_prompts_read_in_place_through_steps_that_mix_prefill_and_decode(
        monkeypatch, gathers, warned):
    # Prompts of 32-480 tokens through 24-token steps: chunks over earlier chunks' pages,
    # and steps holding one request's chunk beside others' decoding.  No full-attention
    # layer's keys are gathered, while sdpa's are.
    m = llama()
    batch = prompts((32, 97, 480, 5), seed=3)
    seen = {"decode": 0, "prefill": 0, "mixed": 0}
    attend = _paged._Step.attend

    def counting(step, *args):
        seen["decode"] += len(step.decode)
        seen["prefill"] += len(step.prefill)
        seen["mixed"] += bool(len(step.decode) and len(step.prefill))
        return attend(step, *args)

    monkeypatch.setattr(_paged._Step, "attend", counting)
    got = generate_batch(m, "fastattn", batch, **CHUNKED)
    assert not gathers
    assert seen["decode"] and seen["mixed"] and seen["prefill"] > 2 * 480 // 24
    assert got == sequential(m, batch)
    assert got == generate_batch(m, "sdpa", batch, **CHUNKED)
    assert gathers   # the oracle's path gathers: the spy sees it
    assert not ours(warned)


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]],
                         ids=["all-sliding", "mixed"])
def test_sliding_window_layers(layer_types, warned):
    # Window 8, shorter than the prompts: the sliding layers' ring buffers are gathered by
    # the cache's update, the full layers beside them are read in place.
    if layer_types is None:
        m = model(transformers.MistralForCausalLM,
                  config(transformers.MistralConfig, sliding_window=8))
    else:
        m = model(transformers.Qwen2ForCausalLM,
                  config(transformers.Qwen2Config, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0, layer_types=layer_types))
    batch = prompts((6, 21, 40), seed=3)
    got = generate_batch(m, "fastattn", batch, **CHUNKED)
    assert got == sequential(m, batch)
    assert got == generate_batch(m, "sdpa", batch, **CHUNKED)
    assert not ours(warned)


def test_a_differing_page_pool_falls_back_with_one_warning(monkeypatch, gathers, warned):
    # Without the allocator's page pool, the guard sends every layer to the keys the
    # cache's update gathers: one warning naming the release, the same tokens.
    m = llama()
    batch = prompts(SHORT[:4])
    expected = sequential(m, batch)
    monkeypatch.delattr(FullAttentionCacheAllocator, "get_cache_for_block_table")
    assert generate_batch(m, "fastattn", batch, **CHUNKED) == expected
    told = ours(warned)
    assert len(told) == 1 and f"transformers {transformers.__version__}" in told[0]
    assert "get_cache_for_block_table" in told[0] and gathers


def test_a_differing_update_falls_back_with_one_warning(monkeypatch, warned):
    # An update that is not the one register() wrapped (as a release with another update
    # would have): no pages reach the attention function, which attends over the keys the
    # update gathered, with one warning.
    m = llama()
    batch = prompts(SHORT[:4])
    expected = sequential(m, batch)
    wrapped = PagedAttentionCache.update

    def other(self, key_states, value_states, layer_idx, kwargs):
        return wrapped.__wrapped__(self, key_states, value_states, layer_idx, kwargs)

    monkeypatch.setattr(PagedAttentionCache, "update", other)
    assert generate_batch(m, "fastattn", batch, **CHUNKED) == expected
    told = ours(warned)
    assert len(told) == 1 and f"transformers {transformers.__version__}" in told[0]


def test_internals_are_named_in_one_place():
    # Each internal read names the check that guards it.
    assert len(_paged.INTERNALS) == 4 and all(_paged.INTERNALS.values())
    assert getattr(PagedAttentionCache.update, "_fastattn", False)
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager)
    assert getattr(ContinuousBatchingManager.switch_to_cb_friendly_attn, "_fastattn", False)


def test_twin_name():
    # transformers admits to continuous batching only names containing "flash": register()
    # adds one beside each name it registers, and the manager's switch moves models to it.
    from transformers import AttentionInterface
    assert "fastattn_flash" in AttentionInterface._global_mapping
    assert fa_tf._BATCHING_TWINS["fastattn"] == "fastattn_flash"

"""A Llama-style decoder in NumPy with fastattn's attention, timed against Hugging Face.

    python benchmarks/e2e_decoder.py [--threads 2] [--prompt 512] [--steps 64] [--vocab 32000]
    python benchmarks/e2e_decoder.py --backends [--runs 9]

The model is the textbook one: token embedding; per layer RMSNorm, attention with rotary
positions (fastattn.rope) and grouped-query heads (fastattn.attention, keys and values in
a fastattn.KVCache), a residual, RMSNorm, a SwiGLU MLP and a residual; a final RMSNorm
and the output projection.  Every matrix product is NumPy's (OpenBLAS).  Weights are
random (seeded): the point is the speed, and that both implementations agree.

It generates greedily: one forward pass over the prompt (prefill) gives the first new
token, then each decode step feeds the last token and gives the next.  When torch and
transformers are installed, the same model is built with LlamaConfig, the weights are
copied, HF's generate() runs with attn_implementation="sdpa", and the two token sequences
must be identical.  Every library runs on the same number of threads.

``--backends`` times something else: HF's generate() on this model with fastattn's
transformers backend (``fastattn.integrations.transformers``) against the same with
``sdpa``, the runs interleaved (one of each in turn, the order alternating).  It prints
the median of the runs' ratios (sdpa time / fastattn time: above 1 when fastattn's backend
makes the whole model faster) and the median time of the attention calls inside
generate(), prefill and decode apart, timed by wrapping the two registered attention
functions.  The greedy tokens of both must be identical.
"""
import argparse
import statistics
import time

import numpy as np

import fastattn
from fastattn.cli.bench.harness import blas_threads

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32000, 1024, 8, 16, 4, 2816
HEAD_DIM = HIDDEN // HEADS
ROPE_BASE, EPS = 10000.0, 1e-5


def random_weights(seed=0, vocab=VOCAB):
    """Weights as (in, out) matrices, so that a layer is ``x @ W``."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    layers = [dict(attn_norm=np.ones(HIDDEN, np.float32),
                   wq=w(HIDDEN, HEADS * HEAD_DIM), wk=w(HIDDEN, KV_HEADS * HEAD_DIM),
                   wv=w(HIDDEN, KV_HEADS * HEAD_DIM), wo=w(HEADS * HEAD_DIM, HIDDEN),
                   mlp_norm=np.ones(HIDDEN, np.float32),
                   w_gate=w(HIDDEN, FFN), w_up=w(HIDDEN, FFN), w_down=w(FFN, HIDDEN))
              for _ in range(LAYERS)]
    return dict(embed=w(vocab, HIDDEN), layers=layers,
                norm=np.ones(HIDDEN, np.float32), lm_head=w(HIDDEN, vocab))


def rms_norm(x, weight):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(EPS)) * weight


def silu(x):
    return x / (1 + np.exp(-x))


class Decoder:
    """The NumPy + fastattn model.  One KVCache per layer holds the keys and values."""

    def __init__(self, weights):
        self.w = weights
        # q, k and v projections in one product, gate and up in another: the same
        # arithmetic per output column as separate products, with fewer BLAS calls.
        self.wqkv = [np.concatenate([p["wq"], p["wk"], p["wv"]], axis=1) for p in weights["layers"]]
        self.wgu = [np.concatenate([p["w_gate"], p["w_up"]], axis=1) for p in weights["layers"]]

    def forward(self, tokens, caches):
        """Logits of the last position, for ``tokens`` that follow what the caches hold."""
        start = len(caches[0])
        positions = np.arange(start, start + len(tokens))
        x = self.w["embed"][tokens]                                    # (L, hidden)
        for p, wqkv, wgu, cache in zip(self.w["layers"], self.wqkv, self.wgu, caches):
            qkv = rms_norm(x, p["attn_norm"]) @ wqkv
            q, k, v = np.split(qkv, [HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM], axis=1)
            q = q.reshape(-1, HEADS, HEAD_DIM).swapaxes(0, 1)          # (heads, L, head_dim)
            k = k.reshape(-1, KV_HEADS, HEAD_DIM).swapaxes(0, 1)
            v = v.reshape(-1, KV_HEADS, HEAD_DIM).swapaxes(0, 1)
            cache.append(fastattn.rope(k, positions, ROPE_BASE), v)
            a = fastattn.attention(fastattn.rope(q, positions, ROPE_BASE),
                                   cache.k, cache.v, causal=True)
            x = x + a.swapaxes(0, 1).reshape(-1, HEADS * HEAD_DIM) @ p["wo"]
            gate, up = np.split(rms_norm(x, p["mlp_norm"]) @ wgu, 2, axis=1)
            x = x + (silu(gate) * up) @ p["w_down"]
        return rms_norm(x[-1], self.w["norm"]) @ self.w["lm_head"]

    def generate(self, prompt, steps):
        """Greedy: the prefill's token, then one token per decode step."""
        caches = [fastattn.KVCache(capacity=len(prompt) + steps + 1) for _ in range(LAYERS)]
        tokens = [int(np.argmax(self.forward(prompt, caches)))]
        for _ in range(steps):
            tokens.append(int(np.argmax(self.forward(np.array(tokens[-1:]), caches))))
        return tokens


def hf_model(weights):
    """The same model in transformers, with the weights copied (torch stores (out, in))."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(weights["embed"]), hidden_size=HIDDEN,
                         intermediate_size=FFN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, rms_norm_eps=EPS, rope_theta=ROPE_BASE,
                         max_position_embeddings=4096, tie_word_embeddings=False,
                         attn_implementation="sdpa", torch_dtype=torch.float32)
    model = LlamaForCausalLM(config).eval()

    def put(param, array):
        param.data.copy_(torch.from_numpy(np.ascontiguousarray(array)))

    put(model.model.embed_tokens.weight, weights["embed"])
    for layer, p in zip(model.model.layers, weights["layers"]):
        put(layer.input_layernorm.weight, p["attn_norm"])
        put(layer.self_attn.q_proj.weight, p["wq"].T)
        put(layer.self_attn.k_proj.weight, p["wk"].T)
        put(layer.self_attn.v_proj.weight, p["wv"].T)
        put(layer.self_attn.o_proj.weight, p["wo"].T)
        put(layer.post_attention_layernorm.weight, p["mlp_norm"])
        put(layer.mlp.gate_proj.weight, p["w_gate"].T)
        put(layer.mlp.up_proj.weight, p["w_up"].T)
        put(layer.mlp.down_proj.weight, p["w_down"].T)
    put(model.model.norm.weight, weights["norm"])
    put(model.lm_head.weight, weights["lm_head"].T)
    model.generation_config.eos_token_id = None    # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, prompt, steps):
    import torch
    with torch.inference_mode():
        ids = model.generate(torch.from_numpy(prompt[None]), max_new_tokens=steps + 1,
                             min_new_tokens=steps + 1, do_sample=False)
    return ids[0, len(prompt):].tolist()


def best_time(fn, repeat):
    """Best wall time of ``repeat`` runs (after one untimed run) and the last result."""
    result = fn()
    times = []
    for _ in range(repeat):
        time.sleep(0.3)   # idle BLAS/OpenMP workers stop spinning between runs
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def timed_attention(forward, times):
    """``forward`` (a transformers attention function) that appends each call's wall time
    to ``times["prefill"]`` or ``times["decode"]`` (one query row)."""
    def timed(module, query, *args, **kwargs):
        t0 = time.perf_counter()
        result = forward(module, query, *args, **kwargs)
        times["decode" if query.shape[-2] == 1 else "prefill"].append(time.perf_counter() - t0)
        return result
    return timed


def register_timed_backends():
    """Register "timed-fastattn" and "timed-sdpa": fastattn's backend and sdpa, each with
    transformers' SDPA mask and wrapped by :func:`timed_attention`.  Returns
    ``{name: times}``, the lists the wrappers fill."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    import fastattn.integrations.transformers as fa_tf

    forwards = {"fastattn": AttentionInterface._global_mapping[fa_tf.register()],
                "sdpa": sdpa_attention_forward}
    times = {}
    for name, forward in forwards.items():
        times[name] = {"prefill": [], "decode": []}
        AttentionInterface.register(f"timed-{name}", timed_attention(forward, times[name]))
        AttentionMaskInterface.register(f"timed-{name}", sdpa_mask)
    return times


def compare_backends(model, prompt, steps, runs):
    """HF generate() with fastattn's backend and with sdpa, interleaved: per backend the
    run times, the attention calls' times and the tokens of the last run."""
    calls = register_timed_backends()
    runs_s = {name: [] for name in calls}
    tokens = {}
    for i in range(runs + 1):              # run 0 of each warms up, untimed
        for name in (list(calls) if i % 2 else list(reversed(calls))):
            model.set_attn_implementation(f"timed-{name}")
            time.sleep(0.3)   # idle BLAS/OpenMP workers stop spinning between runs
            t0 = time.perf_counter()
            tokens[name] = hf_generate(model, prompt, steps)
            runs_s[name].append(time.perf_counter() - t0)
            if i == 0:
                runs_s[name].clear()
                for times in calls[name].values():
                    times.clear()
    return runs_s, calls, tokens


def report_backends(runs_s, calls, tokens):
    """Print compare_backends' figures; the exit status (1 if the tokens differ)."""
    ratios = [s / f for s, f in zip(runs_s["sdpa"], runs_s["fastattn"])]
    for name in runs_s:
        med = {kind: statistics.median(t) * 1e6 for kind, t in calls[name].items()}
        print(f"{name:9s} generate: median {statistics.median(runs_s[name]):.3f} s; "
              f"attention calls: prefill {med['prefill']:.0f} us, decode {med['decode']:.1f} us")
    dec = {name: statistics.median(calls[name]["decode"]) for name in calls}
    pre = {name: statistics.median(calls[name]["prefill"]) for name in calls}
    print(f"generate, sdpa time / fastattn time: median {statistics.median(ratios):.3f} "
          f"(runs: {' '.join(f'{r:.3f}' for r in ratios)})")
    print(f"attention calls, fastattn / sdpa: decode {dec['fastattn'] / dec['sdpa']:.2f}x, "
          f"prefill {pre['fastattn'] / pre['sdpa']:.2f}x")
    same = tokens["fastattn"] == tokens["sdpa"]
    print(f"greedy tokens identical: {same}")
    return 0 if same else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=fastattn.get_num_threads())
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (prefill)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per side (best)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size")
    parser.add_argument("--backends", action="store_true",
                        help="HF generate with fastattn's backend against sdpa, interleaved")
    parser.add_argument("--runs", type=int, default=9, help="--backends: timed runs per side")
    args = parser.parse_args()

    weights = random_weights(vocab=args.vocab)
    prompt = np.random.default_rng(1).integers(0, args.vocab, args.prompt)
    n_new = args.steps + 1
    print(f"Llama-style decoder: hidden {HIDDEN}, {LAYERS} layers, {HEADS}/{KV_HEADS} heads, "
          f"vocab {args.vocab}, float32, batch 1; {args.prompt}-token prompt, {args.steps} "
          f"decode steps; {args.threads} threads")
    if args.backends:
        import torch
        torch.set_num_threads(args.threads)
        with fastattn.num_threads(args.threads):
            return report_backends(*compare_backends(hf_model(weights), prompt, args.steps,
                                                     args.runs))

    with blas_threads(args.threads), fastattn.num_threads(args.threads):
        ours = Decoder(weights)
        t_ours, tokens = best_time(lambda: ours.generate(prompt, args.steps), args.repeat)
    print(f"NumPy + fastattn:       {t_ours:6.2f} s  {n_new / t_ours:6.1f} new tokens/s")

    try:
        import torch
        import transformers
    except ImportError:
        print("transformers + torch not installed: no comparison")
        return 0
    torch.set_num_threads(args.threads)
    model = hf_model(weights)
    t_hf, hf_tokens = best_time(lambda: hf_generate(model, prompt, args.steps), args.repeat)
    print(f"transformers {transformers.__version__} sdpa: {t_hf:6.2f} s  "
          f"{n_new / t_hf:6.1f} new tokens/s")
    same = tokens == hf_tokens
    print(f"greedy tokens identical: {same}; NumPy + fastattn is {t_hf / t_ours:.2f}x "
          "as fast as transformers")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

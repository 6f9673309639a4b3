"""A compiled Hugging Face Llama forward on fastattn against the same model compiled on "sdpa".

    python benchmarks/compiled_llama.py [--tokens 1024] [--batch 1] [--layers 4]
        [--hidden 1024] [--heads 16] [--kv-heads 4] [--rounds 9] [--threads 2]
        [--dtype float32|bfloat16]

One random-init Llama (transformers' ``LlamaConfig``, the sizes above), loaded twice with
the same weight tensors: with ``attn_implementation="fastattn"`` (after
``fastattn.integrations.transformers.register()``) and with ``"sdpa"``, each wrapped in
``torch.compile``.
Both run the same causal prompt of ``--tokens`` tokens under ``torch.inference_mode``; after
warm-up (the compilation) the forwards alternate round by round, and the report gives each
one's median, the ratio sdpa / fastattn (above 1: fastattn's forward is faster), dynamo's
graph-break count of each, and the largest difference between their logits.  The whole
forward is timed, so the ratio is diluted by the projections and MLPs that both share.  The
"bg load" figure is the share of the CPUs other processes used meanwhile.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _model(transformers, torch, args, attn):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(2048, args.tokens))
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn,
                                                       dtype=dtype)
    return model.eval()


def _graph_breaks(torch, model, ids):
    torch._dynamo.reset()
    with torch.inference_mode():
        explanation = torch._dynamo.explain(model)(input_ids=ids)
    return explanation.graph_break_count


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    import torch
    import transformers

    import fastattn
    from fastattn.cli.bench.harness import OtherLoad
    from fastattn.integrations.transformers import register

    torch.set_num_threads(args.threads)
    fastattn.set_num_threads(args.threads)
    register()
    ids = torch.randint(0, 32000, (args.batch, args.tokens),
                        generator=torch.Generator().manual_seed(1))
    models = {attn: _model(transformers, torch, args, attn) for attn in ("fastattn", "sdpa")}
    # One set of weights, shared: the projections' matmuls then read the same memory in
    # both models, so the weights' placement cannot favour either.
    models["fastattn"].load_state_dict(models["sdpa"].state_dict(), assign=True)
    breaks = {attn: _graph_breaks(torch, m, ids) for attn, m in models.items()}
    torch._dynamo.reset()
    compiled = {attn: torch.compile(m) for attn, m in models.items()}
    logits = {}
    with torch.inference_mode():
        for attn, m in compiled.items():       # compile, then one more warm call
            m(input_ids=ids)
            logits[attn] = m(input_ids=ids).logits.float()
        samples = {attn: [] for attn in compiled}
        load = OtherLoad()
        for r in range(args.rounds):
            order = list(compiled) if r % 2 == 0 else list(reversed(compiled))
            for attn in order:
                t = time.perf_counter()
                compiled[attn](input_ids=ids)
                samples[attn].append(time.perf_counter() - t)
        busy = load.fraction()
    med = {attn: statistics.median(s) for attn, s in samples.items()}
    diff = (logits["fastattn"] - logits["sdpa"]).abs().max().item()
    print(f"Llama: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / "
          f"{args.kv_heads} kv heads, {args.batch} x {args.tokens} tokens, {args.dtype}, "
          f"{args.threads} threads, torch {torch.__version__}, transformers "
          f"{transformers.__version__}")
    for attn in compiled:
        print(f"  compiled {attn:9} {med[attn] * 1e3:9.1f} ms   graph breaks {breaks[attn]}")
    print(f"  sdpa / fastattn: {med['sdpa'] / med['fastattn']:.2f}x   max |logits diff| "
          f"{diff:.1e}   bg load {'?' if busy is None else f'{100 * busy[0]:.0f}%'}")


if __name__ == "__main__":
    main()

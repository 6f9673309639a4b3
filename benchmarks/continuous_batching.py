"""transformers' continuous batching on fastattn against its "sdpa" and "paged|eager" paths.

    python benchmarks/continuous_batching.py [--requests 16] [--min-prompt 32]
        [--max-prompt 480] [--new-tokens 32] [--layers 4] [--hidden 512] [--heads 8]
        [--kv-heads 2] [--rounds 3] [--threads 2] [--plot FILE.png]

A random-init Llama (transformers' ``LlamaConfig``, the sizes above) generates greedily for
``--requests`` requests with random prompts of ``--min-prompt`` to ``--max-prompt`` tokens,
``--new-tokens`` each, through ``model.generate_batch`` (transformers' continuous batching:
a paged cache, prefill chunks and decode steps of several requests in one forward).  The
model runs on three attention implementations in turn, round after round: fastattn (after
``fastattn.integrations.transformers.register()``, which reads the paged cache in place),
``"sdpa"`` and ``"eager"`` (which continuous batching runs as ``"paged|eager"``).  The report
gives each one's generated tokens per second (the median of the rounds), the ratio to
fastattn, and whether its tokens equal fastattn's, request by request.  ``--plot`` draws the
throughputs as bars (needs matplotlib).  The "bg load" figure is the share of the CPUs
other processes used meanwhile: a figure taken beside other work is not the machine's.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BACKENDS = (("fastattn", "fastattn"), ("sdpa", "sdpa"), ("paged|eager", "eager"))


def _model(transformers, torch, args):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _generate(torch, model, prompts, config, implementation):
    model.set_attn_implementation(implementation)
    t = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, progress_bar=False)
    seconds = time.perf_counter() - t
    tokens = {rid: list(r.generated_tokens) for rid, r in out.items()}
    if len(tokens) != len(prompts) or any(len(t) != config.max_new_tokens
                                          for t in tokens.values()):
        raise RuntimeError(f"generate_batch on {implementation!r} did not generate every "
                           f"request's {config.max_new_tokens} tokens (see its log above)")
    return tokens, seconds


def _plot(path, names, rates):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(names, rates, color=["tab:green", "tab:blue", "tab:gray"])
    ax.set_ylabel("generated tokens / s")
    ax.set_title("continuous batching (generate_batch)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=480)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", metavar="FILE.png")
    args = ap.parse_args(argv)
    if args.plot:
        import matplotlib  # noqa: F401  (checked before the run)
    import torch
    import transformers

    import fastattn
    from fastattn.cli.bench.harness import OtherLoad
    from fastattn.integrations.transformers import register

    torch.set_num_threads(args.threads)
    fastattn.set_num_threads(args.threads)
    register()
    transformers.logging.set_verbosity_error()
    model = _model(transformers, torch, args)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=g)
    prompts = [torch.randint(1, 32000, (int(n),), generator=g).tolist() for n in lengths]
    config = transformers.GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False,
                                           eos_token_id=-1, pad_token_id=0)
    seconds = {name: [] for name, _ in BACKENDS}
    tokens = {}
    _generate(torch, model, prompts[:2], config, "fastattn")    # warm-up
    load = OtherLoad()
    for r in range(args.rounds):
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        for name, implementation in order:
            tokens[name], s = _generate(torch, model, prompts, config, implementation)
            seconds[name].append(s)
    busy = load.fraction()
    generated = args.requests * args.new_tokens
    rate = {name: generated / statistics.median(s) for name, s in seconds.items()}
    print(f"Llama: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / "
          f"{args.kv_heads} kv heads; {args.requests} requests of {int(lengths.min())}-"
          f"{int(lengths.max())} prompt tokens, {args.new_tokens} new each; {args.threads} "
          f"threads; torch {torch.__version__}, transformers {transformers.__version__}")
    for name, _ in BACKENDS:
        same = tokens[name] == tokens["fastattn"]
        print(f"  {name:12} {rate[name]:8.1f} tokens/s   fastattn / it "
              f"{rate['fastattn'] / rate[name]:5.2f}x   same tokens as fastattn: {same}")
    print(f"  bg load {'?' if busy is None else f'{100 * busy[0]:.0f}%'}")
    if args.plot:
        _plot(args.plot, [n for n, _ in BACKENDS], [rate[n] for n, _ in BACKENDS])
        print(f"  plot: {args.plot}")


if __name__ == "__main__":
    main()

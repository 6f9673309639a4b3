"""``python -m fastattn demo``: the seed notebooks' examples, end to end, on the kernel.

Three small stories, each printed as attention-weight tables (row = the query
token, column = the key token it attends to; each row sums to 1):

1. "A cat sat on the mat" -- seed 001's vectors, attention without learned
   weights: ``softmax(x x^T) x``.
2. "I love you today" -- seed 004's vocabulary plus sinusoidal positions, fed
   through a 5-head ``MultiHeadAttention`` (fixed seed, so the numbers repeat).
3. "each session has a chair" vs "each person has a chair" -- seed 000's
   masked (causal) attention: the same word "chair" gets a different
   contextualised vector depending on its neighbours.  Then 000's learned
   projections W_Q, W_K, W_V, W_O on the first sentence.

``--plot DIR`` also saves each table as a heatmap PNG in ``DIR`` (needs
matplotlib; without it the command prints how to install it and exits 1).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

__all__ = ["main", "format_table"]

# Seed 001: six tokens, embedding dimension 3.
CAT_TOKENS = ["A", "cat", "sat", "on", "the", "mat"]
CAT_VECTORS = np.array([
    [0.43, 0.15, 0.89],
    [0.55, 0.87, 0.66],
    [0.57, 0.85, 0.64],
    [0.22, 0.58, 0.33],
    [0.77, 0.25, 0.10],
    [0.05, 0.80, 0.55],
])

# Seed 004: a four-word sentence with a three-dimensional vocabulary.
LOVE_TOKENS = ["I", "love", "you", "today"]
LOVE_VOCABULARY = {"I": [0, 1, 0], "love": [0, 1, 1], "you": [1, 1, 1], "today": [0, 0, 0]}

# Seed 000: two sentences differing in one word, and the notebook's learned weights.
CHAIR_EMBEDDINGS = {
    "each": [4, 3, 3], "session": [7, 2, 1], "person": [1, 2, 7],
    "has": [3.5, 3, 3.5], "a": [3, 3, 4], "chair": [3, 4, 3],
}
CHAIR_SENTENCES = (["each", "session", "has", "a", "chair"],
                   ["each", "person", "has", "a", "chair"])
W_Q = np.array([[1, 2, 1], [-1, 1, 0], [-2, 1, 1]])
W_K = np.array([[-1, -2, -1], [-1, -1, 2], [0, -1, 1]])
W_V = np.array([[-1, 1, -2, 2], [1, 0, 1, 1], [1, 0, 0, -1]])
W_O = np.array([[1, 1, 2], [3, 1, 2], [6, 2, 1], [0, 0, 1]])


def format_table(weights, rows, cols=None, *, decimals=3, hidden=None, corner="query \\ key"):
    """Render a 2-d weight matrix as text with labelled rows and columns.

    ``hidden`` (bool, same shape) marks keys a query may not see (causal
    masking); they print as ``.`` rather than ``0.000``, so that a masked key
    is told apart from a visible key of negligible weight.
    """
    weights = np.asarray(weights, dtype=np.float64)
    cols = rows if cols is None else cols
    if weights.shape != (len(rows), len(cols)):
        raise ValueError(f"weights has shape {weights.shape}, expected {(len(rows), len(cols))}")
    width = max(decimals + 3, *(len(c) for c in cols)) + 1
    label = max(len(corner), *(len(r) for r in rows))
    lines = [corner.rjust(label) + "".join(c.rjust(width + 1) for c in cols)]
    for i, r in enumerate(rows):
        cells = []
        for j in range(len(cols)):
            if hidden is not None and hidden[i, j]:
                cells.append(".".rjust(width + 1))
            else:
                cells.append(f"{weights[i, j]:{width + 1}.{decimals}f}")
        lines.append(r.rjust(label) + "".join(cells))
    return "\n".join(lines)


def _vectors(rows, labels, decimals=3):
    label = max(len(r) for r in labels)
    return "\n".join(
        f"{name.rjust(label)}  [" + " ".join(f"{x:{decimals + 4}.{decimals}f}" for x in row) + " ]"
        for name, row in zip(labels, np.asarray(rows, dtype=np.float64))
    )


def _title(text):
    return f"\n== {text} " + "=" * max(3, 76 - len(text))


def _cat_sat(emit, figures):
    from . import _api
    from .layers import self_attention

    x = CAT_VECTORS
    emit(_title('1. "A cat sat on the mat" (seed 001): attention without learned weights'))
    emit("Each token is a 3-d vector; weights = softmax(x @ x.T), context = weights @ x.\n")
    weights = _api.attention_weights(x, x, scale=1.0)
    emit(format_table(weights, CAT_TOKENS))
    context = self_attention(x, scale=1.0)
    emit("\ncontext vectors (seed 001 prints cat -> [0.4419, 0.6515, 0.5683]):")
    emit(_vectors(context, CAT_TOKENS, 4))
    figures.append(("01_cat_sat_on_the_mat", '"A cat sat on the mat"',
                    [(weights, CAT_TOKENS, CAT_TOKENS, None, None)]))


def _love_you(emit, figures):
    from .layers import MultiHeadAttention
    from .positions import sinusoidal_positions

    words = np.array([LOVE_VOCABULARY[w] for w in LOVE_TOKENS], dtype=np.float64)
    pe = sinusoidal_positions(len(LOVE_TOKENS), words.shape[1])
    x = words + pe
    mha = MultiHeadAttention(3, 5, d_head=6, d_value=8, dtype=np.float64, seed=4)
    emit(_title('2. "I love you today" (seed 004): positions + multi-head attention'))
    emit("word vectors + sinusoidal positions (d_model=3 is odd: the last column is a sine;")
    emit("seed 004 leaves it at 0):")
    emit(_vectors(x, LOVE_TOKENS, 3))
    emit(f"\n{mha!r}, random weights (seed=4), scale 1/sqrt(6).")
    heads = mha.attention_weights(x)                      # (5, 4, 4)
    for h, w in enumerate(heads):
        emit(f"\nhead {h}:")
        emit(format_table(w, LOVE_TOKENS))
    out = mha(x)
    emit(f"\noutput (5 heads x d_value 8 -> w_o -> d_model 3), shape {out.shape}:")
    emit(_vectors(out, LOVE_TOKENS, 3))
    figures.append(("02_i_love_you_today", '"I love you today": 5 heads',
                    [(w, LOVE_TOKENS, LOVE_TOKENS, None, f"head {h}") for h, w in enumerate(heads)]))


def _chair(emit, figures):
    from . import _api
    from .layers import self_attention

    emit(_title('3. "each session/person has a chair" (seed 000): masked attention'))
    emit("Causal: a word attends to itself and the words before it ('.' = masked).")
    emit("weights = softmax(x_i . x_j over j <= i), contextualised y_i = sum_j w_ij x_j\n")
    chairs = []
    for sentence in CHAIR_SENTENCES:
        x = np.array([CHAIR_EMBEDDINGS[w] for w in sentence], dtype=np.float64)
        weights = _api.attention_weights(x, x, scale=1.0, causal=True)
        hidden = np.triu(np.ones((len(sentence),) * 2, dtype=bool), 1)
        emit(f"{' '.join(sentence)}:")
        emit(format_table(weights, sentence, hidden=hidden))
        emit("")
        y = self_attention(x, scale=1.0, causal=True)
        chairs.append(y[-1])
        name = "03_" + "_".join(sentence)
        figures.append((name, f'"{" ".join(sentence)}" (causal)',
                        [(weights, sentence, sentence, hidden, None)]))
    labels = ["'chair' alone"] + [f"'chair' in '{' '.join(s)}'" for s in CHAIR_SENTENCES]
    emit(_vectors([CHAIR_EMBEDDINGS["chair"]] + chairs, labels, 4))
    emit("(seed 000: [3.4882, 3.3862, 3.1256] and [3.1256, 3.3862, 3.4882])")

    sentence = CHAIR_SENTENCES[0]
    x = np.array([CHAIR_EMBEDDINGS[w] for w in sentence], dtype=np.float64)
    emit(_title("3b. the same sentence with seed 000's learned W_Q, W_K, W_V (d_v=4), W_O"))
    emit("scores (x_i W_Q).(x_j W_K) / sqrt(3), causal; the scores are large (tens), so the")
    emit("softmax is nearly one-hot: here each word attends almost only to itself:\n")
    weights = _api.attention_weights(x @ W_Q, x @ W_K, causal=True)
    hidden = np.triu(np.ones((len(sentence),) * 2, dtype=bool), 1)
    emit(format_table(weights, sentence, hidden=hidden))
    y = self_attention(x, W_Q, W_K, W_V, W_O, causal=True)
    emit("\ncontextualised embeddings (attention @ W_V, then @ W_O back to 3 dims):")
    emit(_vectors(y, sentence, 3))
    figures.append(("03b_learned_projections", "seed 000 learned W_Q, W_K, W_V (causal)",
                    [(weights, sentence, sentence, hidden, None)]))


def _save_heatmaps(figures, directory, plt):
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, title, panels in figures:
        n = len(panels)
        # Panels show the same queries: labels only on the first, so they cannot overlap.
        fig, axes = plt.subplots(1, n, figsize=(2.8 * n + 1.6, 4.2), squeeze=False,
                                 layout="constrained")
        for ax, (w, rows, cols, hidden, sub) in zip(axes[0], panels):
            shown = np.ma.masked_array(w, mask=hidden) if hidden is not None else w
            im = ax.imshow(shown, vmin=0.0, vmax=1.0, cmap="viridis")
            ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right")
            ax.set_yticks(range(len(rows)), rows)
            ax.tick_params(labelleft=ax is axes[0][0])
            ax.set_xlabel("key")
            if sub:
                ax.set_title(sub)
            for i in range(len(rows)):
                for j in range(len(cols)):
                    if hidden is None or not hidden[i, j]:
                        ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=7,
                                color="black" if w[i, j] > 0.6 else "white")
        axes[0][0].set_ylabel("query")
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
        fig.suptitle(title)
        path = os.path.join(directory, name + ".png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Run the demo; ``argv`` are the arguments after ``demo`` (a leading "demo" is ignored).

    Returns the exit status: 0, or 1 when ``--plot`` is asked for without matplotlib.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(
        prog="python -m fastattn demo",
        description="The seed notebooks' attention examples with their attention weights.",
    )
    parser.add_argument("--plot", metavar="DIR",
                        help="also save the weight tables as heatmap PNGs in DIR (needs matplotlib)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:          # --help or a usage error: report, do not raise
        return int(exc.code or 0)

    plt = None
    if args.plot is not None:
        # Checked before any output so that a missing dependency fails fast and clearly.
        try:
            import matplotlib
            matplotlib.use("Agg")      # files only; never needs a display
            import matplotlib.pyplot as plt
        except ImportError:
            print("fastattn demo --plot needs matplotlib, which is not installed.\n"
                  "Install it with:  pip install matplotlib   "
                  "(or run the demo without --plot for the tables only)", file=sys.stderr)
            return 1

    figures = []
    emit = print
    with np.printoptions(precision=4, suppress=True):
        _cat_sat(emit, figures)
        _love_you(emit, figures)
        _chair(emit, figures)

    if plt is not None:
        paths = _save_heatmaps(figures, args.plot, plt)
        print(f"\nsaved {len(paths)} heatmaps:")
        for p in paths:
            print("  " + p)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m fastattn demo``: classic self-attention examples, end to end, on the kernel.

Three small stories, each printed as attention-weight tables (row = the query
token, column = the key token it attends to; each row sums to 1):

1. "A cat sat on the mat" -- six hand-made 3-d word vectors, attention without
   learned weights: ``softmax(x x^T) x``.
2. "I love you today" -- a three-word vocabulary plus sinusoidal positions, fed
   through a 5-head ``MultiHeadAttention`` (fixed seed, so the numbers repeat).
3. "each session has a chair" vs "each person has a chair" -- masked (causal)
   attention: the same word "chair" gets a different contextualised vector
   depending on its neighbours.  Then learned projections W_Q, W_K, W_V, W_O
   on the first sentence.

``--plot DIR`` also saves each table as a heatmap PNG in ``DIR`` (needs
matplotlib; without it the command says how to install it and exits with status 3
before printing anything).
"""

from __future__ import annotations

import os
import textwrap

import numpy as np

from .common import COMMON_STATUSES, ENVIRONMENT, OK, pyplot

HELP = "classic self-attention examples with their attention weights"
EXIT_STATUSES = {**COMMON_STATUSES,
                 ENVIRONMENT: "--plot without matplotlib (checked before anything runs)"}

# Six tokens, embedding dimension 3.
CAT_TOKENS = ["A", "cat", "sat", "on", "the", "mat"]
CAT_VECTORS = np.array([
    [0.43, 0.15, 0.89],
    [0.55, 0.87, 0.66],
    [0.57, 0.85, 0.64],
    [0.22, 0.58, 0.33],
    [0.77, 0.25, 0.10],
    [0.05, 0.80, 0.55],
])

# A four-word sentence with a three-dimensional vocabulary.
LOVE_TOKENS = ["I", "love", "you", "today"]
LOVE_VOCABULARY = {"I": [0, 1, 0], "love": [0, 1, 1], "you": [1, 1, 1], "today": [0, 0, 0]}

# Two sentences differing in one word, and a small set of trained projection weights.
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


def format_weights(weights, rows, cols=None, *, decimals=3, hidden=None, corner="query \\ key"):
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


def _words(items):
    items = [f"'{w}'" for w in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def describe_peaks(weights, tokens, *, one_hot=0.99):
    """Say in words where each row of ``weights`` puts most of its weight.

    The sentence is worked out from the numbers, so the demo's text cannot disagree with
    its own table: rows whose largest weight is on their own token are listed together,
    every other row by the token it looks at and the weight it puts there.
    """
    weights = np.asarray(weights, dtype=np.float64)
    top, peak = weights.argmax(axis=1), weights.max(axis=1)
    if np.all(peak >= one_hot):
        text = f"Every row is nearly one-hot (largest weight >= {one_hot})"
        how = "almost only"
    else:
        text = "The largest weight of each row"
        how = "most"
    own = [t for i, t in enumerate(tokens) if top[i] == i]
    parts = []
    if own:
        verb, obj = ("attends", "itself") if len(own) == 1 else ("attend", "themselves")
        parts.append(f"{_words(own)} {verb} {how} to {obj}")
    parts += [f"'{t}' puts {peak[i]:.3f} of its weight on '{tokens[top[i]]}'"
              for i, t in enumerate(tokens) if top[i] != i]
    return text + ": " + "; ".join(parts) + "."


def _vectors(rows, labels, decimals=3):
    label = max(len(r) for r in labels)
    return "\n".join(
        f"{name.rjust(label)}  [" + " ".join(f"{x:{decimals + 4}.{decimals}f}" for x in row) + " ]"
        for name, row in zip(labels, np.asarray(rows, dtype=np.float64))
    )


def _title(text):
    return f"\n== {text} " + "=" * max(3, 76 - len(text))


def _cat_sat(emit, figures):
    from fastattn import attention_weights, self_attention

    x = CAT_VECTORS
    emit(_title('1. "A cat sat on the mat": attention without learned weights'))
    emit("Each token is a 3-d vector; weights = softmax(x @ x.T), context = weights @ x.\n")
    weights = attention_weights(x, x, scale=1.0)
    emit(format_weights(weights, CAT_TOKENS))
    context = self_attention(x, scale=1.0)
    emit("\ncontext vectors (each row of weights @ x):")
    emit(_vectors(context, CAT_TOKENS, 4))
    figures.append(("01_cat_sat_on_the_mat",
                    '"A cat sat on the mat": softmax(x xᵀ), no learned weights',
                    [(weights, CAT_TOKENS, CAT_TOKENS, None, None)]))


def _love_you(emit, figures):
    from fastattn import MultiHeadAttention, sinusoidal_positions

    words = np.array([LOVE_VOCABULARY[w] for w in LOVE_TOKENS], dtype=np.float64)
    pe = sinusoidal_positions(len(LOVE_TOKENS), words.shape[1])
    x = words + pe
    mha = MultiHeadAttention(3, 5, d_head=6, d_value=8, dtype=np.float64, seed=4)
    emit(_title('2. "I love you today": positions + multi-head attention'))
    emit("word vectors + sinusoidal positions (d_model=3 is odd: the last column is a sine):")
    emit(_vectors(x, LOVE_TOKENS, 3))
    emit(f"\n{mha!r}, random weights (seed=4), scale 1/sqrt(6).")
    heads = mha.attention_weights(x)                      # (5, 4, 4)
    for h, w in enumerate(heads):
        emit(f"\nhead {h}:")
        emit(format_weights(w, LOVE_TOKENS))
    out = mha(x)
    emit(f"\noutput (5 heads x d_value 8 -> w_o -> d_model 3), shape {out.shape}:")
    emit(_vectors(out, LOVE_TOKENS, 3))
    figures.append(("02_i_love_you_today",
                    '"I love you today": 5 attention heads (random weights, seed 4)',
                    [(w, LOVE_TOKENS, LOVE_TOKENS, None, f"head {h}") for h, w in enumerate(heads)]))


def _chair(emit, figures):
    from fastattn import attention_weights, self_attention

    emit(_title('3. "each session/person has a chair": masked attention'))
    emit("Causal: a word attends to itself and the words before it ('.' = masked).")
    emit("weights = softmax(x_i . x_j over j <= i), contextualised y_i = sum_j w_ij x_j\n")
    chairs = []
    for sentence in CHAIR_SENTENCES:
        x = np.array([CHAIR_EMBEDDINGS[w] for w in sentence], dtype=np.float64)
        weights = attention_weights(x, x, scale=1.0, causal=True)
        hidden = np.triu(np.ones((len(sentence),) * 2, dtype=bool), 1)
        emit(f"{' '.join(sentence)}:")
        emit(format_weights(weights, sentence, hidden=hidden))
        emit("")
        y = self_attention(x, scale=1.0, causal=True)
        chairs.append(y[-1])
        name = "03_" + "_".join(sentence)
        figures.append((name, f'"{" ".join(sentence)}": causal, no learned weights',
                        [(weights, sentence, sentence, hidden, None)]))
    labels = ["'chair' alone"] + [f"'chair' in '{' '.join(s)}'" for s in CHAIR_SENTENCES]
    emit(_vectors([CHAIR_EMBEDDINGS["chair"]] + chairs, labels, 4))
    emit("(one word, two contexts: 'chair' comes out as a different vector in each sentence)")

    sentence = CHAIR_SENTENCES[0]
    x = np.array([CHAIR_EMBEDDINGS[w] for w in sentence], dtype=np.float64)
    emit(_title("3b. the same sentence with learned projections W_Q, W_K, W_V (d_v=4), W_O"))
    q, k = x @ W_Q, x @ W_K
    weights = attention_weights(q, k, causal=True)
    hidden = np.triu(np.ones((len(sentence),) * 2, dtype=bool), 1)
    scores = np.where(hidden, np.nan, q @ k.T / np.sqrt(q.shape[-1]))
    emit(f"scores s_ij = (x_i W_Q).(x_j W_K) / sqrt(3), causal: they lie between "
         f"{np.nanmin(scores):.0f} and {np.nanmax(scores):.0f},")
    emit("and two scores 5 apart already give weights in a ratio of e^5, about 150.")
    emit(textwrap.fill(describe_peaks(weights, sentence), 88) + "\n")
    emit(format_weights(weights, sentence, hidden=hidden))
    y = self_attention(x, W_Q, W_K, W_V, W_O, causal=True)
    emit("\ncontextualised embeddings (attention @ W_V, then @ W_O back to 3 dims):")
    emit(_vectors(y, sentence, 3))
    figures.append(("03b_learned_projections",
                    f'"{" ".join(sentence)}": causal, learned W_Q and W_K',
                    [(weights, sentence, sentence, hidden, None)]))


def examples():
    """Run the three examples; return ``[(text, figures), ...]``, one entry per example.

    ``text`` is what ``python -m fastattn demo`` prints for it; ``figures`` are
    ``(file name, title, panels)`` for :func:`save_heatmaps`. The documentation is built
    from the same call, so its tables and heatmaps are the demo's.
    """
    out = []
    with np.printoptions(precision=4, suppress=True):
        for example in (_cat_sat, _love_you, _chair):
            lines, figures = [], []
            example(lines.append, figures)
            out.append(("\n".join(lines), figures))
    return out


def save_heatmaps(figures, directory, plt=None):
    """Save each figure of :func:`examples` as ``directory/<name>.png``; return the paths.

    Needs matplotlib (imported here when ``plt`` is not given, with the file-only backend).
    """
    if plt is None:
        plt = pyplot("demo")
        if plt is None:
            raise ImportError("save_heatmaps needs matplotlib")
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, title, panels in figures:
        n = len(panels)
        # Panels show the same queries: labels only on the first, so they cannot overlap.
        # The size follows the panels (about 2.3 inches per 4-token head), so that a row of
        # heads leaves no band of empty space around them.
        side = 0.45 * max(len(p[1]) for p in panels) + 1.3
        fig, axes = plt.subplots(1, n, figsize=(side * n + 1.6, side + 1.3), squeeze=False,
                                 layout="constrained")
        for ax, (w, rows, cols, hidden, sub) in zip(axes[0], panels):
            shown = np.ma.masked_array(w, mask=hidden) if hidden is not None else w
            im = ax.imshow(shown, vmin=0.0, vmax=1.0, cmap="viridis")
            ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right")
            ax.set_yticks(range(len(rows)), rows)
            ax.tick_params(labelleft=ax is axes[0][0])
            ax.set_xlabel("key")
            if sub:
                ax.set_title(sub, fontsize=10)
            for i in range(len(rows)):
                for j in range(len(cols)):
                    if hidden is None or not hidden[i, j]:
                        ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=7,
                                color="black" if w[i, j] > 0.6 else "white")
        axes[0][0].set_ylabel("query")
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.9, aspect=25, pad=0.02,
                     label="attention weight")
        fig.suptitle(title, fontsize=11)
        path = os.path.join(directory, name + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def add_arguments(parser):
    parser.add_argument("--plot", metavar="DIR",
                        help="also save the weight tables as heatmap PNGs in DIR (needs "
                             "matplotlib)")
    return parser


def run(args, stdout=None):
    """Print the examples (and save their heatmaps with ``--plot``); the exit status."""
    plt = None
    if args.plot is not None:
        # Checked before any output so that a missing dependency fails fast and clearly.
        plt = pyplot("demo")
        if plt is None:
            return ENVIRONMENT
    figures = []
    for text, figs in examples():
        print(text, file=stdout)
        figures += figs
    if plt is not None:
        paths = save_heatmaps(figures, args.plot, plt)
        print(f"\nsaved {len(paths)} heatmaps:", file=stdout)
        for p in paths:
            print("  " + p, file=stdout)
    return OK

"""Draw docs/images/three_kinds.png (run: python docs/scripts/encoder_decoder_pictures.py).

The encoder-decoder of ``qkv train translate`` (seed 0, its default 400 steps) on one held-out sentence:
the three kinds of attention of its first layer side by side, each for the head that aligns best.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from qkv import train as tr  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "images"


def main() -> None:
    model, result = tr.train("translate", seed=0)
    head = int(tr.head_scores(model, "translate")["alignment"][0].argmax())
    (src, dec_in), target, _ = tr.make_batch("translate", 1, np.random.default_rng(7))
    _, _, seen = model.forward((src, dec_in), want_weights=True)
    source = [f"s{t}" for t in src[0]]
    decoder_in = ["<start>"] + [f"t{t}" for t in dec_in[0, 1:]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 6), layout="constrained")
    panels = [
        ("encoder self-attention\n(bidirectional: every source word sees all)", seen["encoder"][0][0, head], source, source),
        ("decoder self-attention\n(causal: a target word sees the ones before)", seen["decoder"][0][0, head], decoder_in, decoder_in),
        ("cross-attention\n(target words over source words: the alignment)", seen["cross"][0][0, head], source, decoder_in),
    ]
    for ax, (title, w, keys, queries) in zip(axes, panels):
        im = ax.imshow(w, vmin=0, vmax=1, cmap="viridis")
        ax.set_title(title)
        ax.set_xticks(range(len(keys)), keys, rotation=90)
        ax.set_yticks(range(len(queries)), queries)
        ax.set_xlabel("key (attended to)")
    axes[0].set_ylabel("query (attending)")
    fig.colorbar(im, ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle(f"qkv train translate (held-out accuracy {result.accuracy:.3f}): layer 0, head {head}, one sentence")
    OUT.mkdir(exist_ok=True)
    fig.savefig(OUT / "three_kinds.png", dpi=110, bbox_inches="tight")
    print(f"wrote {OUT / 'three_kinds.png'}")


if __name__ == "__main__":
    main()

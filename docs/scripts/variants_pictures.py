"""Draw docs/images/variants.png and docs/images/variants_block_mask.png (run: python docs/scripts/variants_pictures.py).

Every variant of docs/variants.md on one small example: 20 tokens, one head,
random queries and keys (seeded), the weights qkv computes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import qkv
from qkv import mods, viz

OUT = Path(__file__).resolve().parents[1] / "images"


def main() -> None:
    rng = np.random.default_rng(0)
    L = 20
    q, k = rng.standard_normal((2, 1, L, 16)) * 1.5  # (H, L, D), scores of a few units
    doc = np.repeat([0, 1, 2], [7, 6, 7])
    cases = {
        "causal (every decoder)": dict(is_causal=True),
        "sliding window 5 (Mistral, Gemma)": dict(mask_mod=mods.sliding_window(4)),
        "prefix-LM, prefix 6": dict(mask_mod=mods.prefix_lm(6)),
        "3 packed documents, causal": dict(mask_mod=mods.and_masks(mods.document(doc), mods.causal())),
        "dilated window (Longformer)": dict(mask_mod=mods.dilated_sliding_window(4, 2)),
        "local + global token 0 (BigBird)": dict(mask_mod=mods.or_masks(mods.sliding_window(2, 2), mods.global_tokens([0]))),
        "ALiBi, slope 0.5, causal (BLOOM)": dict(alibi_slopes=[0.5], is_causal=True),
        "softcap 1 (Gemma 2), causal": dict(softcap=1.0, is_causal=True),
        "sink logit 2 (gpt-oss), causal": dict(sinks=[2.0], is_causal=True),
    }
    weights, names, keeps = [], [], []
    for name, kw in cases.items():
        w = qkv.attention_weights(q, k, **kw)[0]  # (L, L)
        mm = kw.get("mask_mod")
        keep = mm(0, 0, np.arange(L)[:, None], np.arange(L)) if mm is not None else (np.tril(np.ones((L, L), bool)) if kw.get("is_causal") else np.ones((L, L), bool))
        weights.append(w)
        keeps.append(np.broadcast_to(keep, (L, L)))
        names.append(name)
    fig = viz.plot_attention(np.stack(weights), [str(i) for i in range(L)], mask=np.stack(keeps), head_names=names, title="One head's weights under each variant (20 tokens, the same queries and keys)", ncols=3, annotate=False)
    viz.save(fig, OUT / "variants.png")
    doc = np.repeat(np.arange(8), 256)
    bm = mods.create_block_mask(mods.and_masks(mods.document(doc), mods.causal()), None, None, 2048, 2048, block=128)
    viz.save(viz.plot_block_mask(bm, title=f"8 packed documents of 256 tokens, causal, 2,048 tokens: {bm.counts()['empty']} of {bm.kinds.size} tiles skipped"), OUT / "variants_block_mask.png")
    print("wrote", OUT / "variants.png", OUT / "variants_block_mask.png")


if __name__ == "__main__":
    main()

"""Draw docs/images/serving_pages.png (run: python docs/scripts/serving_pictures.py).

A real run of qkv serve's scheduler on Gemma 3 270M: three chat requests, two
of them with the same long system prompt, a pool of 40 pages of 16 tokens.
The picture is the pool and the block tables after a few decode steps: which
page each request holds, and the pages the two share by reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "images"
SYSTEM = "You are a patient teacher. " + " ".join(f"Rule {i}: explain each step of attention with a small example." for i in range(6))


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from qkv.models import load_causal_lm
    from qkv.models.serving.scheduler import Request, Scheduler

    lm = load_causal_lm()
    s = Scheduler(lm, num_pages=40, page_size=16, max_batch=4, prefill_chunk=256)
    chats = {"A": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a query?"}],
             "C": [{"role": "user", "content": "Write a haiku about the sea."}],
             "B": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And what is a key, and a value?"}]}  # fmt: skip
    reqs = {}
    for name, messages in chats.items():
        ids = lm.tokenizer.encode(lm.apply_chat_template(messages), add_bos=False)
        reqs[name] = Request(prompt=ids, max_tokens=40, emit=lambda kind, payload: None)
        s.submit(reqs[name])
        if name == "A":  # A first: its system prompt's pages are published before B arrives
            for _ in range(3):
                s.step()
    for _ in range(6):
        s.step()
    colours = {"A": "#4e79a7", "B": "#f28e2b", "C": "#59a14f", "shared": "#b07aa1"}
    holders = {p: [n for n, r in reqs.items() if p in r.pages] for p in range(s.pool.num_pages)}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.5]})
    cols = 8
    for p in range(s.pool.num_pages):
        x, y = p % cols, -(p // cols)
        who = holders[p]
        face = "white" if not who else colours["shared"] if len(who) > 1 else colours[who[0]]
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=face, edgecolor="#444"))
        ax.text(x + 0.45, y + 0.45, str(p), ha="center", va="center", fontsize=8, color="white" if who else "#888")
    ax.set_xlim(-0.2, cols)
    ax.set_ylim(-(s.pool.num_pages // cols) + 0.8, 1.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"the pool: {s.pool.num_pages} pages of 16 tokens (white: free)")
    for row, (name, r) in enumerate(sorted(reqs.items())):
        y = -row * 1.3
        bx.text(-0.3, y + 0.45, f"{name}: {len(r.tokens)} tokens", ha="right", va="center", fontsize=9)
        for j, p in enumerate(r.pages):
            shared = len(holders[p]) > 1
            bx.add_patch(Rectangle((j, y), 0.9, 0.9, facecolor=colours["shared" if shared else name], edgecolor="#444"))
            bx.text(j + 0.45, y + 0.45, str(p), ha="center", va="center", fontsize=8, color="white")
    widest = max(len(r.pages) for r in reqs.values())
    bx.set_xlim(-3.2, widest + 0.2)
    bx.set_ylim(-3.0, 1.2)
    bx.set_aspect("equal")
    bx.axis("off")
    shared_n = sum(1 for w in holders.values() if len(w) > 1)
    bx.set_title(f"block tables: a request's pages in order ({shared_n} pages of A's system prompt shared by B)")
    fig.tight_layout()
    OUT.mkdir(exist_ok=True)
    fig.savefig(OUT / "serving_pages.png", dpi=110)
    print(f"wrote {OUT / 'serving_pages.png'}; B reused {reqs['B'].cached_tokens} of its {len(reqs['B'].prompt)} prompt tokens")


if __name__ == "__main__":
    main()

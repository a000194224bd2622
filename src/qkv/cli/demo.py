"""``qkv demo``: multi-head self-attention on a sentence, step by step (a toy layer, or a real encoder with --model)."""

from __future__ import annotations

import json
import sys

import numpy as np

from .common import CLIError, DEFAULT_MODEL_TEXTS, DEFAULT_TEXT, MASKED, MAX_DEMO_TOKENS, MAX_TABLE_TOKENS, _format_table, _html_path, _load, _out_dir, _plots_module, _summary, _text


def _demo(args) -> dict:
    from .. import MultiHeadAttention, Vocabulary, sinusoidal_position_encoding, tokenize
    from ..text import Embedding

    text = DEFAULT_TEXT if args.text is None else _text(args.text)
    tokens = tokenize(text)
    if not tokens:
        raise CLIError(f"TEXT has no words to attend over, got {text!r}")
    for name in ("dim", "heads"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name} should be >= 1, got {getattr(args, name)}")
    if args.seed < 0:
        raise CLIError(f"--seed should be >= 0, got {args.seed}")
    if args.dim % args.heads:
        raise CLIError(f"--dim {args.dim} should be divisible by --heads {args.heads}")
    plots = None if args.no_plots else _plots_module()
    out_dir = None if args.no_plots else _out_dir(args.out)
    html_path = None if args.html is None else _html_path(args.html)

    L = len(tokens)
    if L > MAX_DEMO_TOKENS:  # every weight is kept, printed or drawn: 6,000 words took 7.4 GB and 2 minutes
        raise CLIError(f"TEXT has {L:,} tokens; the demo keeps, draws and can print every one of its {args.heads} heads' {L:,} x {L:,} weights "
                       f"({args.heads * L * L:,} numbers): give at most {MAX_DEMO_TOKENS:,} tokens (for a long text: qkv attention TEXT --html FILE.html)")  # fmt: skip
    if plots is not None and L > 50:
        print(f"qkv: {L} tokens: computing and drawing 4 pictures...", file=sys.stderr, flush=True)
    # One generator, drawn in a fixed order: the embedding table, then the layer.
    rng = np.random.default_rng(args.seed)
    vocab = Vocabulary.from_texts([text])
    ids = vocab.encode(tokens)  # (L,)
    emb = Embedding(len(vocab), args.dim, rng=rng)
    pe = sinusoidal_position_encoding(len(ids), args.dim)  # (L, E)
    x = (emb(ids) + pe).astype(np.float32)  # (L, E)
    mha = MultiHeadAttention(args.dim, args.heads, rng=rng)
    out, trace = mha(x, is_causal=args.causal, return_trace=True)  # (L, E)
    after = x + out  # a transformer block adds attention's output to its input (the residual)
    weights = trace.weights  # (H, L, L)
    keep = None if trace.mask is None else np.broadcast_to(trace.mask, weights.shape[-2:])

    files = []
    mode = "causal" if args.causal else "bidirectional"
    if plots is not None:
        from ..scaling import score_statistics

        figures = {
            "attention.png": plots.plot_attention(weights, tokens, mask=keep, title=f"{mode} self-attention weights per head (seed {args.seed})", scale="log" if L > 50 else "linear"),
            "position_encoding.png": plots.plot_position_encoding(sinusoidal_position_encoding(max(64, len(ids)), args.dim)),
            "embeddings_pca.png": plots.plot_embedding_shift(x, after, tokens, title=f"Embeddings before and after {mode} attention (input + attention output; random weights)"),
            "score_variance.png": plots.plot_score_variance(score_statistics([2, 4, 8, 16, 32, 64, 128, 256, 512], rng=args.seed)),
        }
        files = [str(plots.save(fig, out_dir / name)) for name, fig in figures.items()]
    if html_path is not None:
        from .. import explorer

        title = f"qkv demo: {mode} self-attention, {args.heads} heads (seed {args.seed}, random weights)"
        files.append(str(explorer.write_html(html_path, weights, tokens, mask=keep, layer_names=["demo layer"], title=title)))

    return {
        "text": text,
        "tokens": tokens,
        "config": {"heads": args.heads, "dim": args.dim, "head_dim": args.dim // args.heads, "causal": args.causal, "seed": args.seed},
        "shapes": {"embeddings": list(x.shape), "queries": list(trace.query.shape), "weights": list(weights.shape), "output": list(out.shape)},
        "weights": weights.tolist(),
        "keep": None if keep is None else keep.tolist(),
        "files": files,
    }


def _print_demo(result: dict, full_tables: bool = False) -> None:
    c, s, tokens = result["config"], result["shapes"], result["tokens"]
    mode = "causal" if c["causal"] else "bidirectional"
    print(f"text:    {result['text']}")
    print(f"tokens:  {tokens}")
    print(f"embeddings {tuple(s['embeddings'])} = word vectors + sinusoidal positions")
    print(f"{mode} self-attention: {c['heads']} heads x head_dim {c['head_dim']} (seed {c['seed']})")
    print(f"queries per head {tuple(s['queries'])}, weights {tuple(s['weights'])}, output {tuple(s['output'])}")
    keep = None if result["keep"] is None else np.array(result["keep"])
    full = full_tables or len(tokens) <= MAX_TABLE_TOKENS
    for h, w in enumerate(np.array(result["weights"])):
        if full:
            print(f"\nhead {h}: row = query, column = key, each row sums to 1" + (f" ('{MASKED}' = masked)" if keep is not None else ""))
            print(_format_table(w, tokens, keep))
        else:
            print(f"\nhead {h}:")
            print(_summary(w, tokens))
    if not full:
        print(f"\n({len(tokens)} tokens: tables summarised; --full prints every weight, --format json gives them all)")
    if result["files"]:
        n = len(result["files"])
        print(f"\nwrote {n} file{'s' if n > 1 else ''}:")
        for f in result["files"]:
            print(f"  {f}")


TOY_OPTIONS = {"heads": 4, "dim": 32, "causal": False, "seed": 0}


def cmd_demo(args) -> int:
    given = [name for name in TOY_OPTIONS if getattr(args, name) not in (None, False)]
    if args.no_plots and args.out is not None:
        raise CLIError("--out has no effect with --no-plots (no pictures are written)")
    args.out = "qkv-demo" if args.out is None else args.out
    if args.model is not None:
        if given:
            raise CLIError(f"--{given[0]} has no effect with --model: a real model has its own heads, size and weights")
        if args.html is not None:
            raise CLIError("--html has no effect with --model; for a real model's attention in the browser use: qkv attention TEXT --model NAME --html FILE")
        if args.full:
            raise CLIError("--full has no effect with --model (it prints the toy demo's tables)")
        return _demo_model(args)
    for name, default in TOY_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)

    if args.full and args.format == "json":
        raise CLIError("--full has no effect with --format json (JSON always has every weight)")
    result = _demo(args)
    if args.format == "json":
        print(json.dumps(result))
    else:
        _print_demo(result, full_tables=args.full)
    return 0


def _unit(a: np.ndarray) -> np.ndarray:
    return a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), 1e-12)


def _cosine(a: np.ndarray) -> np.ndarray:
    a = _unit(a)
    return a @ a.T


def _demo_model(args) -> int:
    texts = DEFAULT_MODEL_TEXTS if args.text is None else [_text(args.text)]
    plots = None if args.no_plots else _plots_module()
    out_dir = None if args.no_plots else _out_dir(args.out)
    enc = _load(args.model)
    res = enc.encode_batch(texts)
    # Every word token of every text (no [CLS]/[SEP]): its static vector (the table row, the same
    # for a word anywhere) and its contextual vector (the last layer's output).
    labels, words, static, contextual = [], [], [], []
    for b, toks in enumerate(res.tokens):
        for i, t in enumerate(toks):
            if t in ("[CLS]", "[SEP]", "[PAD]"):
                continue
            words.append(t)
            labels.append(t if len(texts) == 1 else f"{t} ({b + 1})")
            static.append(enc.model.word[res.input_ids[b, i]])
            contextual.append(res.last_hidden_state[b, i])
    static, contextual = np.array(static), np.array(contextual)  # (N, E)
    pairs = []
    for word in sorted({w for w in words if words.count(w) > 1 and w.isalpha()}):
        i, j = [k for k, w in enumerate(words) if w == word][:2]
        pairs.append({"word": word, "tokens": [labels[i], labels[j]], "static_cosine": float(_cosine(static[[i, j]])[0, 1]), "contextual_cosine": float(_cosine(contextual[[i, j]])[0, 1])})
    files = []
    if plots is not None:
        # Directions, not lengths, carry meaning here (the two sets differ in scale): unit vectors before PCA.
        title = f"{enc.name}: static word vectors (blue) -> contextual, last layer (red); unit vectors, PCA"
        files.append(str(plots.save(plots.plot_embedding_shift(_unit(static), _unit(contextual), labels, title=title), out_dir / "embeddings_pca_model.png")))
    result = {"texts": texts, "model": str(enc.path), "tokens": res.tokens, "repeated_words": pairs, "files": files}
    if args.format == "json":
        print(json.dumps(result))
        return 0
    print(f"model: {enc!r}")
    for b, toks in enumerate(res.tokens):
        print(f"text {b + 1}: {texts[b]!r}\n  tokens: {toks}")
    if pairs:
        print("\nthe same word in two places: cosine similarity of its two vectors")
        print(f"{'word':12s}{'static':>10s}{'contextual':>12s}   tokens")
        for p in pairs:
            print(f"{p['word']:12s}{p['static_cosine']:10.3f}{p['contextual_cosine']:12.3f}   {p['tokens'][0]}, {p['tokens'][1]}")
    for f in files:
        print(f"\nwrote {f}")
    return 0

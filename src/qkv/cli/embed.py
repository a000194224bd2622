"""``qkv embed`` and ``qkv search``: sentence embeddings, a corpus streamed into a .npy (on Dask too), and searching it."""

from __future__ import annotations

import json
import sys

from pathlib import Path

import numpy as np

from .._files import write_atomic
from .common import CLIError, ENCODER_NAME, STDIN, _load, _model_path, _text
from .demo import _cosine


def _embed_input(args) -> int:
    """qkv embed --input FILE|-: stream a corpus into a .npy (qkv.models.corpus.embed_file)."""
    from ..models import embed_file

    if args.texts:
        raise CLIError("give TEXT arguments or --input, not both")
    if not args.output:
        raise CLIError("--input needs --output FILE.npy (where the embeddings go)")
    if args.json:
        raise CLIError("--json has no effect with --input (the embeddings go to --output)")
    if args.input != "-" and not Path(args.input).is_file():
        raise CLIError(f"--input {args.input!r} is not a file")
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

        from ..models.corpus.cluster import embed_corpus
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
    from ..models.engines.encoder import MAX_BATCH_SIZE

    if not 1 <= args.batch_size <= MAX_BATCH_SIZE:
        raise CLIError(f"--batch-size should be in [1, {MAX_BATCH_SIZE}], got {args.batch_size}")
    if args.input is not None:
        return _embed_input(args)
    for name in ("resume", "quiet", "workers", "scheduler"):
        if getattr(args, name) is not None and getattr(args, name) is not False:  # (a --workers of 0 too: 0 == False)
            raise CLIError(f"--{name} has no effect without --input")
    if not args.texts:
        raise CLIError("give TEXT arguments, or --input FILE (one text per line) with --output FILE.npy")
    if args.texts.count(STDIN) > 1:
        raise CLIError("'-' (standard input) can stand for one TEXT only: for one text per line use --input - --output FILE.npy")
    args.texts = [_text(t, f"TEXT {i + 1}" if len(args.texts) > 1 else "TEXT") for i, t in enumerate(args.texts)]
    if args.output and Path(args.output).suffix != ".npy":
        raise CLIError(f"--output should end in .npy, got {args.output!r}")
    enc = _load(args.model)
    vectors = enc.encode(args.texts, batch_size=args.batch_size)  # (N, E)
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
    from ..models import Index, iter_texts

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

"""``qkv serve``: an OpenAI-compatible server (:mod:`qkv.models.serving`)."""

from __future__ import annotations

import os
import sys

from .common import CLIError, DECODER_NAME, ENCODER_NAME, _load, _model_path

#: Environment variable read for --api-key (a key on the command line shows in `ps`).
API_KEY_ENV = "QKV_API_KEY"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a language model (and sentence embeddings) over an OpenAI-compatible HTTP API",
        description=(
            "Start an HTTP server whose /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models answer as OpenAI's do "
            "(the official openai client works unchanged), with continuous batching on a paged key/value cache, shared prompt "
            "prefixes, and answers that do not depend on what else is batched. See docs/serving.md."
        ),
    )
    p.add_argument("--model", metavar="NAME_OR_PATH", help=f"{DECODER_NAME!r} (the default), a .gguf file or a Hugging Face causal LM directory")
    p.add_argument("--model-name", metavar="NAME", help="the id clients use and /v1/models lists (default: --model's name)")
    p.add_argument("--embedding-model", metavar="NAME_OR_DIR", default=ENCODER_NAME, help=f"the /v1/embeddings model: {ENCODER_NAME!r} (the default, loaded at the first request), a directory, or 'none'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", metavar="KEY", help=f"require 'Authorization: Bearer KEY' on every request (or set {API_KEY_ENV})")
    p.add_argument("--allow-origin", metavar="ORIGIN", action="append", default=[], help="let pages from this web origin call the server from a browser (CORS), like http://localhost:3000; repeat for more, '*' for any page (default: none)")
    p.add_argument("--max-batch", type=int, default=16, help="requests generated together at most (default 16)")
    p.add_argument("--max-waiting", type=int, default=64, help="requests queued beyond those; more get 429 (default 64)")
    p.add_argument("--context", type=int, default=4096, help="tokens a request may hold, prompt + max_tokens (default 4096)")
    p.add_argument("--max-tokens", type=int, default=2048, help="largest max_tokens a request may ask (default 2048)")
    p.add_argument("--kv-tokens", type=int, default=16384, help="tokens the key/value pool holds over all requests (default 16384)")
    p.add_argument("--page-size", type=int, default=16, help="tokens a page (default 16)")
    p.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens a step at most, so a long prompt does not stall the others (default 128)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take before it is stopped (default 600)")
    p.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    p.add_argument("--batch-variant", action="store_true", help="steps of more than 32 tokens (a prompt's chunk beside others) through BLAS tiles, whose last bits depend on the batch (default: batch-invariant answers)")
    p.add_argument("--int8-activations", action="store_true", help="round each token's activations to int8 per block of 32 before the quantized products, as llama.cpp does: not exact (answers stay batch-invariant), and on the Intel Xeon measured no faster than the default (docs/benchmarks.md)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling of requests that give no seed (default 0)")
    p.add_argument("--sampling-defaults", choices=("model", "openai"), default="model",
                   help="the sampling of a request that does not set it: model (the default): what the model's files recommend (generation_config.json; a GGUF's "
                        "general.sampling.*), as vLLM and llama-server take it, and OpenAI's defaults for the rest; openai: OpenAI's (temperature 1) whatever the model says")  # fmt: skip
    p.add_argument("--read-timeout", type=float, default=15.0, help="seconds a request's head may take to arrive (from the connection, or the previous answer), and its body (from its head): closed, or 408, past them (default 15)")
    p.add_argument("--max-connections", type=int, default=512, help="open connections at most; one more is answered 503 (default 512)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"), help="uvicorn's log level (default info)")
    p.set_defaults(func=cmd_serve)


def exposure_note(host: str, key: str | None, origins=()) -> str | None:
    """What to tell someone serving beyond this machine, or to any web page, without an API key (None: nothing to tell)."""
    import ipaddress

    if key is not None:
        return None
    if "*" in origins:
        return "qkv: note: --allow-origin '*' without --api-key: any web page opened in a browser that can reach this port can use the model"
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve to any interface
        pass
    return f"qkv: note: listening on {host} without --api-key: anyone who can reach this port can use the model (and the machine's cores)"


def _listen(host: str, port: int):
    """A socket bound to ``host:port`` (as uvicorn binds one), for uvicorn to serve on. Bound here, the port
    can be named: ``--port 0`` takes a free one, which had been announced as port 0; and a port in use or an
    unknown host is qkv's error rather than a line of uvicorn's log."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def cmd_serve(args) -> int:
    try:
        import uvicorn  # noqa: F401 (the serve extra's: its absence is told here, before anything loads)

        from ..models.serving.api import Limits, check_origins
        from ..models.serving.http import config, server
        from ..models.serving.server import build
    except ImportError as exc:
        raise CLIError(f"qkv serve needs the serve extra ({exc.name} is missing): pip install 'qkv[serve]'") from None
    for name in ("port", "max_batch", "max_waiting", "context", "max_tokens", "kv_tokens", "page_size", "prefill_chunk", "max_body", "max_connections"):
        v = getattr(args, name)
        if v < (0 if name == "port" else 1):
            raise CLIError(f"--{name.replace('_', '-')} should be >= {0 if name == 'port' else 1}, got {v}")
    if args.port > 65535:
        raise CLIError(f"--port should be <= 65535, got {args.port}")
    if args.int8_activations:
        from ..models.formats.quants import kernel_available

        if not kernel_available():
            raise CLIError("--int8-activations needs the compiled products: pip install 'qkv[fast]'")
    for name in ("timeout", "read_timeout"):
        if not getattr(args, name) > 0:  # (NaN too)
            raise CLIError(f"--{name.replace('_', '-')} should be > 0 seconds, got {getattr(args, name)}")
    if args.kv_tokens < args.context + args.page_size:
        raise CLIError(f"--kv-tokens ({args.kv_tokens}) should hold at least one request of --context ({args.context}) tokens and a page")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise CLIError("--api-key is empty")
    try:
        origins = check_origins(args.allow_origin)
    except ValueError as e:
        raise CLIError(f"--allow-origin: {e}") from None
    sock = _listen(args.host, args.port)  # before the model loads: a port in use is said at once
    lm = _load(args.model, "decoder")
    if lm.config.max_positions and args.context > lm.config.max_positions:
        raise CLIError(f"--context ({args.context}) is past {lm.name}'s {lm.config.max_positions} positions")
    embedder, embedding_name = None, None
    if args.embedding_model != "none":
        path = _model_path(args.embedding_model, ENCODER_NAME)
        embedding_name = ENCODER_NAME if path is None else os.path.basename(os.path.normpath(args.embedding_model))
        loaded = []

        def embedder():  # the encoder, loaded at the first request
            if not loaded:
                loaded.append(_load(args.embedding_model))
            return loaded[0]

    name = args.model_name or (DECODER_NAME if args.model in (None, DECODER_NAME) else os.path.basename(os.path.normpath(args.model)))
    limits = Limits(max_body_bytes=args.max_body, max_tokens=args.max_tokens, max_context=args.context, timeout_s=args.timeout, read_timeout_s=args.read_timeout)
    scheduler, app = build(lm, model_name=name, api_key=key, embedder=embedder, embedding_name=embedding_name, kv_tokens=args.kv_tokens, page_size=args.page_size, max_batch=args.max_batch,
                           max_waiting=args.max_waiting, prefill_chunk=args.prefill_chunk, threads=args.threads, batch_invariant=not args.batch_variant, int8_activations=args.int8_activations, seed=args.seed, limits=limits, allow_origins=origins,
                           sampling_defaults=None if args.sampling_defaults == "model" else {})  # fmt: skip
    scheduler.start()
    where = f"http://{args.host if ':' not in args.host else '[' + args.host + ']'}:{sock.getsockname()[1]}/v1"  # (--port 0: the port the system gave)
    note = exposure_note(args.host, key, origins)
    if note:
        print(note, file=sys.stderr, flush=True)
    recommended = lm.sampling_defaults
    if args.sampling_defaults == "model" and (recommended.values or recommended.ignored):  # said, as vLLM says it: a request's own settings win
        print(f"qkv: the sampling of a request that does not set it follows the model's recommendation: {recommended.describe()}", file=sys.stderr, flush=True)
    print(f"qkv: serving {name!r} at {where} (KV pool {scheduler.pool.nbytes / 2**20:.0f} MiB, {args.kv_tokens} tokens; batch-{'variant' if args.batch_variant else 'invariant'}{'; int8 activations' if args.int8_activations else ''})", file=sys.stderr, flush=True)
    try:
        server(config(app, host=args.host, port=args.port, log_level=args.log_level, read_timeout=args.read_timeout, max_connections=args.max_connections), scheduler.close).run(sockets=[sock])
    finally:
        scheduler.close()
    return 0

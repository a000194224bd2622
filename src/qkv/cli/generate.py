"""``qkv generate`` and ``qkv chat``: a language model continues a prompt or holds a conversation; an encoder-decoder's target."""

from __future__ import annotations

import argparse
import json
import sys

from .. import _numba_cache
from .._files import open_input, read_bounded, readline_bounded
from .common import CLIError, _is_seq2seq, _load, _load_seq2seq, _seq2seq_source, _text


DEFAULT_PROMPT = "The capital of France is"


class _Stream:
    """Prints new tokens' text as it comes (:class:`~qkv.models.engines.text_stream.TextStream`: an incomplete
    UTF-8 character and the possible start of a stop string are held back, never shown then taken back)."""

    def __init__(self, tokenizer, stop=(), head: str = ""):
        from ..models.engines.text_stream import TextStream

        self.text = TextStream(tokenizer, stop)
        self.head = head  # the prompt, echoed with the first token: after whatever the prefill said on stderr

    def __call__(self, tok: int) -> None:
        delta = self.head + self.text.push(tok)
        self.head = ""
        if delta:
            sys.stdout.write(delta)
            sys.stdout.flush()

    def finish(self, text: str) -> None:
        """The rest of the final text (which a stop string may have cut), and the line's end."""
        print(self.head + self.text.finish(text))
        self.head = ""


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
    from ..models.engines.sampling import MAX_OPENAI_PENALTY, MAX_PENALTY

    if not 1 / MAX_PENALTY <= args.repetition_penalty <= MAX_PENALTY:  # (float32 logits break past it)
        raise CLIError(f"--repetition-penalty should be a number in [1e-6, 1e6] (1 = none), got {args.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -MAX_OPENAI_PENALTY <= getattr(args, name) <= MAX_OPENAI_PENALTY:
            raise CLIError(f"--{name.replace('_', '-')} should be a number in [-2, 2] (0 = none), got {getattr(args, name)}")
    bias = {}
    for tok, value in args.logit_bias or []:
        if tok in bias:
            raise CLIError(f"--logit-bias gives token {tok} twice")
        bias[tok] = value
    schema = None
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema)
        except ValueError as exc:
            raise CLIError(f"--json-schema should be a JSON schema written as JSON (like '{{\"type\": \"object\"}}'): {exc}") from None
        except RecursionError:
            raise CLIError("--json-schema is nested too deeply") from None
        if not isinstance(schema, dict):
            raise CLIError(f"--json-schema should be a JSON object (a schema), got {type(schema).__name__}")
    stop = [unescape(x) for x in args.stop or []]
    if any(not x for x in stop):
        raise CLIError("--stop should be a non-empty string")
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty, logit_bias=bias or None, json_schema=schema, stop=stop, seed=args.seed)  # fmt: skip


_said = [0.0]  # numba's compiling seconds at the last closing line


def _closing_line(out) -> str:
    t = out.timings
    rate = "" if t["decode_tokens_per_s"] is None else f"; decode {t['decode_tokens_per_s']:.1f} tokens/s"
    # Compiling since the last line, said once: generate leaves its seconds out of the times above.
    compiled, _said[0] = _numba_cache.compile_seconds() - _said[0], _numba_cache.compile_seconds()
    compiled = f"; and {compiled:.1f} s compiling kernels, once" if compiled >= 0.05 else ""
    return f"[{t['new_tokens']} tokens, stop: {out.stop_reason}; prefill {t['prompt_tokens']} prompt tokens in {t['prefill_s']:.2f} s{rate}{compiled}]"


def _recommendation_note(lm, args) -> None:
    """A greedy run of a model whose files recommend a sampling: say so, once, on stderr (qkv serve follows
    the recommendation; generate is greedy unless told)."""
    if args.temperature == 0 and lm.sampling_defaults.values:
        print(f"qkv: note: {lm.name}'s files recommend sampling with {lm.sampling_defaults.describe()}; this run is greedy "
              "(--temperature and the options of those names follow them)", file=sys.stderr, flush=True)  # fmt: skip


def _base_model_note(lm) -> None:
    """Chatting with a base model: say what to expect, once, on stderr."""
    if lm.instruction_tuned is False:
        print(f"qkv: note: {lm.name} carries no chat template: it is a base (pretrained) model, not instruction-tuned, so it "
              "continues text rather than answering; its turns are written in Gemma's turn format", file=sys.stderr, flush=True)  # fmt: skip


def _chat_model(lm):
    if lm.chat_template is None:
        raise CLIError(f"{lm.name} has no chat template ({lm.no_chat_template}): use qkv generate with plain text")


def _generate_seq2seq(args, prompt: str) -> int:
    """qkv generate with an encoder-decoder --model: the target for SOURCE, greedy or by beam search."""
    given = [flag for flag, on in (("--chat", args.chat), ("--temperature", args.temperature != 0), ("--repetition-penalty", args.repetition_penalty != 1.0), ("--frequency-penalty", args.frequency_penalty != 0),
                                   ("--presence-penalty", args.presence_penalty != 0), ("--logit-bias", bool(args.logit_bias)), ("--json-schema", args.json_schema is not None),
                                   ("--stop", bool(args.stop))) if on]  # fmt: skip
    if given:
        raise CLIError(f"{', '.join(given)}: not for an encoder-decoder --model, which decodes greedily or by beam search (--num-beams, --length-penalty, --early-stopping)")
    lm = _load_seq2seq(args.model, "generate")
    src = _seq2seq_source(lm, prompt, "SOURCE")
    whisper = lm.config.family == "whisper"
    if args.timestamps and not whisper:
        raise CLIError("--timestamps: only Whisper writes timestamps")
    # An option not given is the checkpoint's (its generation config's), as in Seq2SeqLM.generate
    options = dict(num_beams=args.num_beams, length_penalty=args.length_penalty, early_stopping=args.early_stopping, **({"return_timestamps": True} if args.timestamps else {}))
    out = lm.generate(src, max_new_tokens=args.max_new_tokens, **options)
    beams = lm.config.num_beams if args.num_beams is None else args.num_beams
    if args.json:
        print(json.dumps({"model": str(args.model), "source": prompt, "num_beams": beams, "text": out.text, "token_ids": out.token_ids, "source_ids": out.source_ids, "stop_reason": out.stop_reason, "score": out.score,
                          "timings": out.timings, **({"segments": out.segments} if out.segments is not None else {})}))  # fmt: skip
        return 0
    if out.segments is not None:  # Whisper with timestamps: a line a segment, timed in seconds
        for seg in out.segments:
            print(f"[{seg['start']:7.2f} -> {seg['end']:7.2f}] {seg['text'].strip()}")
    else:
        print(out.text)
    how = "greedy" if beams == 1 else f"{beams} beams" + ("" if out.segments is not None else f", score {out.score:.3f}")
    windows = f"; {out.timings['windows']} windows of 30 s" if "windows" in out.timings else ""
    print(f"[{out.timings['new_tokens']} tokens, stop: {out.stop_reason}; {how}{windows}; {out.timings['seconds']:.2f} s]", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    seq2seq = _is_seq2seq(args.model)
    beam_flags = [f for f, on in (("--num-beams", args.num_beams is not None), ("--length-penalty", args.length_penalty is not None), ("--early-stopping", args.early_stopping is not None)) if on]
    if args.timestamps and not seq2seq:
        raise CLIError("--timestamps: only a Whisper --model writes timestamps")
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
        if args.int8_activations:
            raise CLIError("--int8-activations is for a causal LM's quantized products (a GGUF --model); an encoder-decoder runs float32")
        return _generate_seq2seq(args, prompt)
    if args.max_new_tokens is None:
        args.max_new_tokens = DEFAULT_NEW_TOKENS
    with _activations(args):
        return _generate(args, prompt, options)


def _activations(args):
    """--int8-activations: llama.cpp's int8 activations in the quantized products (qkv.models.formats.quants.int8_activations)."""
    from ..models.formats.quants import int8_activations, kernel_available

    if args.int8_activations and not kernel_available():
        raise CLIError("--int8-activations needs the compiled products: pip install 'qkv[fast]'")
    return int8_activations(args.int8_activations)


def _generate(args, prompt: str, options: dict) -> int:
    lm = _load(args.model, "decoder")
    stream = None if args.json else _Stream(lm.tokenizer, options["stop"], head="" if args.chat else prompt)
    _recommendation_note(lm, args)
    if args.chat:
        _chat_model(lm)
        _base_model_note(lm)
        messages = ([{"role": "system", "content": _text(args.system, "--system")}] if args.system is not None else []) + [{"role": "user", "content": prompt}]
        out = lm.chat(messages, max_new_tokens=args.max_new_tokens, on_token=stream, **options)  # a template's ModelError: one line, as every ValueError
    else:
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
    with _activations(args):
        return _chat(args, options)


def _chat(args, options: dict) -> int:
    lm = _load(args.model, "decoder")
    _chat_model(lm)
    _base_model_note(lm)
    _recommendation_note(lm, args)
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


#: --max-new-tokens of a causal LM where not given (an encoder-decoder takes its generation config's length)
DEFAULT_NEW_TOKENS = 32


def early_stopping_option(text: str):
    """--early-stopping's value: true (also given alone), false or never, as transformers' early_stopping."""
    value = {"true": True, "false": False, "never": "never"}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"should be true, false or never, got {text!r}")
    return value


def logit_bias_option(text: str) -> tuple[int, float]:
    """--logit-bias's value: ``ID=BIAS``, a token id and the number added to its logit (in [-100, 100])."""
    tok, sep, value = text.partition("=")
    try:
        if not sep or not tok.strip().isascii() or not tok.strip().isdigit():
            raise ValueError
        tok, value = int(tok), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be ID=BIAS, a token id and a number (like 1234=-100), got {text!r}") from None
    if not -100 <= value <= 100:
        raise argparse.ArgumentTypeError(f"the bias should be a number in [-100, 100], got {text!r}")
    return tok, value


def _add_sampling(p, *, default_tokens: int | None) -> None:
    """The generation options generate and chat share (``default_tokens`` None: the model's, where it has one)."""
    told = f"default {default_tokens}" if default_tokens else f"default {DEFAULT_NEW_TOKENS}; an encoder-decoder's generation config's length where it sets one"
    p.add_argument("--max-new-tokens", type=int, default=default_tokens, help=f"most tokens to add ({told}); stops earlier at end of text or turn")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); above 0, sample")
    p.add_argument("--top-k", type=int, help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, help="sample among the most likely tokens holding probability P (0 < P <= 1)")
    p.add_argument("--min-p", type=float, help="sample among the tokens at least P times as likely as the most likely one (0 < P <= 1)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="above 1, tokens already seen are made less likely (default 1: none)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F", help="OpenAI's: a token's logit is lowered by F for each time it was generated (-2 <= F <= 2; default 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="F", help="OpenAI's: a token's logit is lowered by F once it was generated (-2 <= F <= 2; default 0)")
    p.add_argument("--json-schema", metavar="JSON", help="write JSON following this schema (a JSON schema as JSON text: '{\"type\": \"object\"}' for any object; needs qkv[structured])")
    p.add_argument("--logit-bias", type=logit_bias_option, action="append", metavar="ID=BIAS", help="add BIAS (-100 to 100) to token ID's logit: -100 all but bans it; may be given several times")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop when the new text contains TEXT (cut before it; escapes as llama.cpp reads them: \\n, \\t, \\xNN, ...); may be given several times")
    p.add_argument("--seed", type=int, help="seed of the sampling (default 0): the same seed gives the same text")
    p.add_argument("--int8-activations", action="store_true", help="round each token's activations to int8 per block of 32 before the quantized products, as llama.cpp does: not exact, and on the Intel Xeon measured no faster than the default (0.94-1.02x its decode rate: docs/benchmarks.md) (logits move by up to a few tenths; greedy text can part from the default's after some tokens)")

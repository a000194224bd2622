"""What every command shares: one rule for text arguments, the models --model names, tables and output paths."""

from __future__ import annotations

import os
import sys
import unicodedata

from pathlib import Path

import numpy as np

from .._files import read_bounded


DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


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
        from .. import viz
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
    from ..models import load_causal_lm, load_model

    loader, default = (load_model, ENCODER_NAME) if kind == "encoder" else (load_causal_lm, DECODER_NAME)
    path = _model_path(model_arg, default)
    if kind != "encoder":  # a language model takes seconds to load: say so, on stderr
        print(f"qkv: loading {default if path is None else path} ...", file=sys.stderr, flush=True)
    try:
        return loader(path)
    except ImportError as exc:
        raise CLIError(f"{exc}") from None


def _model_type(model_arg) -> str | None:
    """The model_type of the Hugging Face directory --model names, or None (no directory, no config.json)."""
    if model_arg is None or not model_arg.strip():
        return None
    cfg = Path(model_arg) / "config.json"
    if cfg.is_file():
        from ..models.formats.files import read_json

        found = read_json(cfg).get("model_type")
        return found if isinstance(found, str) else repr(found)
    return None


def _is_seq2seq(model_arg) -> bool:
    """Whether --model names an encoder-decoder directory (T5, BART, Marian, Whisper)."""
    from ..models.load import SEQ2SEQ_FAMILIES

    return _model_type(model_arg) in SEQ2SEQ_FAMILIES


def _seq2seq_source(lm, text: str, what: str):
    """An encoder-decoder's source: token ids of ``text``, or for Whisper the features of the .wav file it names."""
    if lm.config.family == "whisper":  # the source is a recording
        from ..models.families.whisper import read_wav

        if not Path(text).is_file():
            raise CLIError(f"a Whisper model listens: {what} should be a .wav file (16 kHz), got {text!r}")
        audio, rate = read_wav(text)
        return lm.features(audio, sampling_rate=rate)  # (1, n_mels, 3000)
    from ..models.formats.tokenizer import tokenizer_call

    return tokenizer_call(lm.tokenizer.backend.encode, text).ids  # the file's own special tokens (T5: text </s>)


def _load_seq2seq(model_arg, command: str):
    from ..models import load_seq2seq_lm

    print(f"qkv: loading {model_arg} ...", file=sys.stderr, flush=True)
    lm = load_seq2seq_lm(model_arg)
    if lm.tokenizer is None:
        raise CLIError(f"{model_arg}: no tokenizer.json: qkv {command} needs the model's tokenizer")
    return lm


def _is_causal_lm(model_arg) -> bool:
    """Whether --model names a causal LM (a .gguf file, or a directory of a decoder family)."""
    if model_arg is None or model_arg == ENCODER_NAME or not model_arg.strip():
        return False
    path = Path(model_arg)
    if path.is_file():
        return True
    cfg = path / "config.json"
    if path.is_dir() and cfg.is_file():
        from ..models.load import HF_FAMILIES
        from ..models.formats.files import read_json

        return read_json(cfg).get("model_type") in HF_FAMILIES
    return False


def _check_layer_head(args, n_layers: int, n_heads: int) -> None:
    """--layer and --head against the model's counts, before any work."""
    if args.layer is not None and not 0 <= args.layer < n_layers:
        raise CLIError(f"--layer should be in [0, {n_layers - 1}], got {args.layer}")
    if args.head is not None and not 0 <= args.head < n_heads:
        raise CLIError(f"--head should be in [0, {n_heads - 1}], got {args.head}")

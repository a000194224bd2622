"""Hostile files and inputs, busy machines, a user's own install: one clear answer every time.

Each test here failed (a hang, a silent wrong number, gigabytes eaten or a traceback) before the fix it
guards, and checks the class of input, not one case."""

import time

import numpy as np
import pytest

import gguf_writer
from qkv.models import ModelError, load_causal_lm
from qkv.models.formats.chat import MAX_RENDER_CHARS, RENDER_SECONDS, ChatTemplate

HI = [{"role": "user", "content": "hi"}]

# ------------------------------------------------------------------------------- chat templates
RUNAWAY = [
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "ran for more than"),
    ("{% for c in 'x' * 100000 %}{% for d in 'x' * 100000 %}{% endfor %}{% endfor %}", "ran for more than"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}", "ran for more than"),
    ("{{ 'a' * 10**10 }}", r"repetition \('\*'\) would hold 10,000,000,000"),
    ("{{ [1, 2] * 10**9 }}", r"repetition"),
    ("{{ 10**9 * 'ab' }}", r"repetition"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}", r"concatenation \('\+'\)"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", r"concatenation \('~'\)"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}", r"concatenation \('\+'\)"),
    ("{{ messages | tojson(indent=10**9) }}", "was given 1,000,000,000"),
    ("{{ messages | tojson(indent=100) }}", "indent 100"),
    ("{{ 2 ** 100000000 }}", r"power \('\*\*'\)"),
    ("{{ 3 ** 10000000000 }}", r"power \('\*\*'\)"),
    ("{% set n = 2 ** 4000 %}{{ n * n }}", r"product \('\*'\)"),
    ("{{ 'x'.center(10**9) }}", "a call of center was given"),
    ("{{ 'x' | center(9999999999) }}", "the filter center was given"),
    ("{{ ('a' * 1000) | replace('a', 'b' * 100000) }}", "the filter replace would hold 100,000,000"),
    ("{{ ('a' * 1000).replace('a', 'b' * 100000) }}", "a call of replace would hold"),
    ("{% set l = ['a' * 100000] * 1000 %}{{ l | join }}", "the filter join would hold"),
    ("{% set l = ['a' * 100000] * 1000 %}{{ ''.join(l) }}", "a call of join would hold"),
    ("{{ ('a\n' * 100000) | indent(1000) }}", "the filter indent would hold"),
    ("{{ '%0999999999d' % 1 }}", "a format asks for a width of 999999999"),
    ("{{ '%.999999999f' % 1.0 }}", "a format asks for a width"),
    ("{{ '%0999999999d' | format(1) }}", "a format asks for a width"),
    ("{{ '{:>999999999}'.format(1) }}", "a format asks for a width"),
    ("{{ '{0:{1}}'.format(1, 999999999) }}", "a call of format was given"),
    ("{{ range(10**9) }}", "a call of range was given"),
    ("{% for i in range(2000) %}{{ 'x' * 4000 }}{% endfor %}", "the rendered text would hold"),
]


@pytest.mark.parametrize("source, match", RUNAWAY, ids=range(len(RUNAWAY)))
def test_a_runaway_template_stops_with_one_clear_error(source, match):
    t0 = time.monotonic()
    with pytest.raises(ModelError, match="a file: the chat template went past qkv's bounds on a render: .*" + match):
        ChatTemplate(source, "a file").render(HI)
    assert time.monotonic() - t0 < RENDER_SECONDS + 3  # the deadline, not the machine's memory, ended it


@pytest.mark.parametrize("source, error", [("{{ 1/0 }}", "ZeroDivisionError"), ("{{ 10.0 ** 400 }}", "OverflowError"), ("{{ messages[5] }}{{ (1).bit_length(2) }}", "TypeError"), ("{{ 'abc'.index('z') }}", "ValueError")])
def test_a_failing_template_is_one_clear_error_naming_it(source, error):
    with pytest.raises(ModelError, match=f"a file: the chat template failed to render this conversation \\({error}"):
        ChatTemplate(source, "a file").render(HI)


def test_template_bounds_leave_real_templates_alone():
    """What real templates do (loops over messages, namespaces, joins, tojson, format, %) stays within the bounds."""
    source = ("{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% set ns.s = ns.s ~ m.content %}{% endfor %}"
              "{{ '%03d|%-5s|' % (ns.n, 'ab') }}{{ '{:>4}'.format(ns.n) }}|{{ messages | map(attribute='role') | join(',') }}|{{ messages | tojson(indent=2) }}"
              "{{ ns.s | replace('a', 'bb') | center(20) }}{{ 2 ** 64 }}{{ ('x' * 1000) | length }}")  # fmt: skip
    long = [{"role": "user", "content": "a" * (MAX_RENDER_CHARS // 4)}, {"role": "assistant", "content": "b"}]
    out = ChatTemplate(source, "t").render(long)
    assert out.startswith("002|ab   |   2|user,assistant|[") and out.endswith(str(2**64) + "1000")


def test_loading_computes_nothing_of_a_template(torch, tmp_path):
    """Jinja folds constant expressions while compiling: a template whose folding never ends must not
    stop a model from loading (or generating without chat); chat then fails with one clear error."""
    bpe = gguf_writer.byte_level_vocab()
    from test_gguf_families import _model

    model = _model("qwen2", torch, len(bpe[0]))
    for source in ("{% if false %}{{ 3 ** 10000000000 }}{% endif %}{{ 3 ** 10000000000 }}", "{{ 'a' | center(10**10) }}{{ 'b' * 10**12 }}"):
        path = tmp_path / "t.gguf"
        gguf_writer.write(model, path, arch="qwen2", vocab=bpe, chat_template=source)
        t0 = time.monotonic()
        lm = load_causal_lm(path)
        assert lm.generate("the cat", max_new_tokens=2).token_ids
        assert time.monotonic() - t0 < 30
        with pytest.raises(ModelError, match="t.gguf: tokenizer.chat_template: the chat template went past qkv's bounds"):
            lm.chat(HI, max_new_tokens=1)


# ------------------------------------------------------------------------------- the command line
def qkv_cli(*args, input=None, timeout=300):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, input=input, timeout=timeout)


def _one_error_line(r, match):
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err, err
    assert match in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("how", ["prompt-file", "stdin-generate", "stdin-demo", "embed-input", "embed-text", "chat", "search-texts"])
def test_every_read_is_bounded(how, tmp_path):
    """/dev/zero (no line ends, no end) through every way qkv reads text: one error, at 16 MiB, not memory gone."""
    big = b"\0" * ((1 << 24) + 10)
    if how == "prompt-file":
        r = qkv_cli("generate", "--prompt-file", "/dev/zero")
        _one_error_line(r, "--prompt-file '/dev/zero' is longer than 16 MiB")
    elif how == "stdin-generate":
        _one_error_line(qkv_cli("generate", "-", input=big), "PROMPT from standard input is longer than 16 MiB")
    elif how == "stdin-demo":
        _one_error_line(qkv_cli("demo", "-", "--no-plots", input=big), "TEXT from standard input is longer than 16 MiB")
    elif how == "embed-input":
        _one_error_line(qkv_cli("embed", "--input", "-", "--output", str(tmp_path / "e.npy"), input=b"fine\n" + big), "standard input: line 2 is longer than 16 MiB")
    elif how == "embed-text":
        _one_error_line(qkv_cli("embed", "-", input=big), "TEXT from standard input is longer than 16 MiB")
    elif how == "chat":
        _one_error_line(qkv_cli("chat", input=big), "a chat turn is longer than 16 MiB")
    else:
        np.save(tmp_path / "i.npy", np.ones((3, 384), np.float32))
        (tmp_path / "t.txt").write_bytes(b"one\n" + big)
        _one_error_line(qkv_cli("search", "x", "--index", str(tmp_path / "i.npy"), "--texts", str(tmp_path / "t.txt")), "t.txt: line 2 is longer than 16 MiB")


def test_a_fifo_nobody_writes_to_does_not_block(tmp_path):
    import os

    fifo = tmp_path / "prompt.fifo"
    os.mkfifo(fifo)
    _one_error_line(qkv_cli("generate", "--prompt-file", str(fifo), timeout=60), "--prompt-file is empty")


def test_iter_texts_reads_a_line_at_a_time_bounded(tmp_path):
    from qkv.models import iter_texts

    p = tmp_path / "c.txt"
    p.write_bytes(b"a\n" + b"x" * ((1 << 24) + 1) + b"\nb\n")
    texts = iter_texts(p)
    assert next(texts) == "a"
    with pytest.raises(ValueError, match="c.txt: line 2 is longer than 16 MiB"):
        next(texts)


@pytest.mark.parametrize("typo, want", [("--temprature", "--temperature"), ("--max-new-tokns", "--max-new-tokens"), ("--promt-file", "--prompt-file")])
def test_a_typo_names_the_closest_option_of_the_command(typo, want):
    r = qkv_cli("generate", "hi", typo, "1")
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("usage: qkv generate")
    assert f"unrecognized argument '{typo}': did you mean {want}?" in err
    r = qkv_cli("embed", "hi", "--zzzzzz")
    assert r.returncode == 2 and r.stderr.decode().startswith("usage: qkv embed") and "qkv embed --help lists its options" in r.stderr.decode()


@pytest.mark.parametrize("exc, code, match", [
    (RuntimeError("boom"), 3, "qkv: internal error in qkv demo: RuntimeError: boom (at test_hardening.py:"),
    (RecursionError("maximum recursion depth exceeded"), 3, "this is a bug in qkv"),
    (ZeroDivisionError("division by zero"), 3, "ZeroDivisionError"),
    (MemoryError(), 2, "qkv: error: out of memory during qkv demo: the machine could not give it more"),
    (MemoryError("Unable to allocate 8 GiB"), 2, "out of memory during qkv demo (Unable to allocate 8 GiB)"),
])  # fmt: skip
def test_no_exception_reaches_the_user_as_a_traceback(exc, code, match, monkeypatch, capsys):
    import qkv.cli as cli

    def fail(args):
        raise exc

    monkeypatch.setattr(cli, "cmd_demo", fail)
    monkeypatch.delenv("QKV_TRACEBACK", raising=False)
    assert cli.main(["demo"]) == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err


@pytest.mark.parametrize("given, want", [(r"\n", "\n"), (r"\n\nQ:", "\n\nQ:"), (r"\t|\r", "\t|\r"), (r"\\n", "\\n"), (r"\x41\"", 'A"'), (r"C:\path", "C:\\path"), ("é\\n", "é\n")])
def test_stop_takes_escapes_as_llama_cpp_does(given, want):
    from qkv.cli import build_parser
    from qkv.cli.generate import _sampling

    args = build_parser().parse_args(["generate", "hi", "--stop", given])
    assert _sampling(args)["stop"] == [want]


def test_stop_newline_stops_at_the_first_line_end():
    r = qkv_cli("generate", "Write three lines about cats:\n1.", "--max-new-tokens", "40", "--stop", r"\n", "--json")
    import json

    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["stop_reason"] == "stop" and "\n" not in out["text"]


def test_search_never_returns_a_blank_line(tmp_path):
    lines = ["", "The river bank was steep.", "   ", "I deposited cash at the bank.", ""]
    (tmp_path / "c.txt").write_text("\n".join(lines) + "\n")
    r = qkv_cli("embed", "--input", str(tmp_path / "c.txt"), "--output", str(tmp_path / "c.npy"))
    assert r.returncode == 0, r.stderr
    import json

    r = qkv_cli("search", "money", "--index", str(tmp_path / "c.npy"), "--texts", str(tmp_path / "c.txt"), "-k", "5", "--json")
    got = json.loads(r.stdout)["results"]
    assert [g["line"] for g in got] == [4, 2] and all(g["text"].strip() for g in got)


# ------------------------------------------------------------------------------- GGUF files
def raw_gguf(path, metadata, tensors=(("token_embd.weight", (8, 4), 0, 0),), data=None, alignment=32):
    """A GGUF file byte by byte, as the format's spec lays it out, so that it can say what no writer
    would: ``metadata`` is ``[(key, type code, value)]`` (8 string, 9 array as (element type, items),
    4 uint32, 6 float32, 10 uint64, 11 int64 ...), ``tensors`` ``[(name, dims fastest first... as NumPy
    shape, ggml type, offset)]``; the data is zeros unless given."""
    import struct

    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t, v):
        if t == 8:
            b = v.encode()
            return struct.pack("<Q", len(b)) + b
        if t == 9:
            et, items = v
            return struct.pack("<IQ", et, len(items)) + b"".join(value(et, x) for x in items)
        return struct.pack("<" + fmt[t], v)

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, t, v in metadata:
        out += value(8, key) + struct.pack("<I", t) + value(t, v)
    for name, shape, qtype, offset in tensors:
        out += value(8, name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape)) + struct.pack("<IQ", qtype, offset)
    out += b"\0" * (-len(out) % alignment)
    size = max((off + 4 * int(np.prod(shape)) for _, shape, _, off in tensors), default=0)
    path.write_bytes(out + (data if data is not None else b"\0" * size))
    return path


LLAMA_KEYS = [("general.architecture", 8, "llama"), ("llama.embedding_length", 4, 4), ("llama.block_count", 4, 1), ("llama.attention.head_count", 4, 2), ("llama.feed_forward_length", 4, 8)]


def _with(keys, **changes):
    """LLAMA_KEYS with some keys' (type, value) changed or added."""
    out = [(k, t, v) for k, t, v in keys if k.split(".", 1)[1] not in changes]
    return out + [(f"llama.{k}" if not k.startswith("general") else k, t, v) for k, (t, v) in changes.items()]


def _nest(depth):
    v = (4, [1])
    for _ in range(depth):
        v = (9, [v])
    return v


@pytest.mark.parametrize("metadata, tensors, match", [
    ([("general.alignment", 4, 0)] + LLAMA_KEYS, None, r"general.alignment should be a positive power of two, got 0"),
    ([("general.alignment", 4, 7)] + LLAMA_KEYS, None, r"general.alignment should be a positive power of two, got 7"),
    ([("general.alignment", 4, 48)] + LLAMA_KEYS, None, r"general.alignment should be a positive power of two, got 48"),
    ([("general.alignment", 8, "32")] + LLAMA_KEYS, None, r"general.alignment should be a positive power of two, got '32'"),
    ([("general.alignment", 6, 32.0)] + LLAMA_KEYS, None, r"general.alignment should be a positive power of two, got 32.0"),
    (LLAMA_KEYS, [("a", (4,), 0, 0), ("a", (4,), 0, 32)], r"tensor 'a' is listed twice"),
    (LLAMA_KEYS, [("a", (8,), 0, 0), ("b", (4,), 0, 0)], r"tensors '[ab]' and '[ab]' overlap"),
    (LLAMA_KEYS, [("a", (16,), 0, 0), ("b", (4,), 0, 32)], r"tensors 'a' and 'b' overlap"),
    (LLAMA_KEYS, [("a", (4,), 0, 4)], r"tensor 'a' starts at offset 4, not a multiple of general.alignment 32"),
    ([("deep", 9, _nest(9))] + LLAMA_KEYS, None, "metadata 'deep' nests arrays more than 8 deep"),
])  # fmt: skip
def test_a_corrupt_gguf_layout_is_refused_by_name(metadata, tensors, match, tmp_path):
    from qkv.models.formats.gguf import GGUFFile

    path = raw_gguf(tmp_path / "bad.gguf", metadata, *(() if tensors is None else (tensors,)))
    with pytest.raises(ModelError, match="bad.gguf: " + match):
        GGUFFile(path)


def test_metadata_nested_thousands_deep_is_no_recursion_error(tmp_path):
    from qkv.models.formats.gguf import GGUFFile

    import struct

    path = raw_gguf(tmp_path / "deep.gguf", LLAMA_KEYS)
    raw = path.read_bytes()
    nested = b"".join(struct.pack("<IQ", 9, 1) for _ in range(5000)) + struct.pack("<IQ", 4, 0)
    key = b"deep"
    header = raw[:16] + struct.pack("<Q", len(LLAMA_KEYS) + 1)
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<I", 9) + nested
    (tmp_path / "deep.gguf").write_bytes(header + entry + raw[24:])
    with pytest.raises(ModelError, match="nests arrays more than 8 deep"):
        GGUFFile(tmp_path / "deep.gguf")


@pytest.mark.parametrize("change, match", [
    (dict(block_count=(4, 1 << 28)), r"llama.block_count' should be in \[0, 1\] \(the file has that many tensors\), got 268,435,456"),
    (dict(block_count=(10, 1 << 30)), r"llama.block_count' should be in \[0, 1\]"),
    (dict(block_count=(11, -1)), r"llama.block_count' should be in \[0, 1\]"),
    (dict(**{"attention.head_count": (6, 4.5)}), r"llama.attention.head_count' should be a whole number, got 4.5"),
    (dict(**{"attention.head_count": (7, True)}), r"llama.attention.head_count' should be a number, got True"),
    (dict(embedding_length=(6, float("nan"))), r"llama.embedding_length' should be a whole number, got nan"),
    (dict(**{"rope.freq_base": (6, 0.0)}), r"llama.rope.freq_base' should be a positive number, got 0.0"),
    (dict(**{"rope.freq_base": (6, -10000.0)}), r"llama.rope.freq_base' should be a positive number"),
    (dict(**{"attention.layer_norm_rms_epsilon": (6, float("inf"))}), r"llama.attention.layer_norm_rms_epsilon' should be a positive number"),
])  # fmt: skip
def test_gguf_numbers_are_checked_at_load_naming_file_and_key(change, match, tmp_path):
    path = raw_gguf(tmp_path / "m.gguf", _with(LLAMA_KEYS, **change))
    t0 = time.monotonic()
    with pytest.raises(ModelError, match="m.gguf: metadata '" + match):
        load_causal_lm(path)
    assert time.monotonic() - t0 < 5  # checked before anything is sized by it (2**28 layers once took 17 s and 4 GB)


@pytest.mark.parametrize("key, value, match", [("attention.query_pre_attn_scalar", 0.0, "query_pre_attn_scalar' should be a positive number"), ("attention.sliding_window", -4, "sliding_window' should be in")])
def test_gemma_numbers_are_checked_at_load(key, value, match, tmp_path):
    keys = [("general.architecture", 8, "gemma3"), ("gemma3.embedding_length", 4, 4), ("gemma3.block_count", 4, 1), ("gemma3.attention.head_count", 4, 2),
            ("gemma3.feed_forward_length", 4, 8), ("tokenizer.ggml.tokens", 9, (8, ["a", "b"])), (f"gemma3.{key}", 6 if isinstance(value, float) else 5, value)]  # fmt: skip
    with pytest.raises(ModelError, match=match):
        load_causal_lm(raw_gguf(tmp_path / "g.gguf", keys))


class _Fields:
    """The metadata face of a GGUFFile (``field``, ``architecture``), for tokenizer tests."""

    def __init__(self, **fields):
        self.fields, self.architecture = {k.replace("__", "."): v for k, v in fields.items()}, "llama"

    def field(self, key, default=None, *, required=False):
        return self.fields.get(key, default)


@pytest.mark.parametrize("change, match", [
    (dict(merges=["a q"]), r"merges entry 'a q' makes or uses 'q', which is not in tokenizer.ggml.tokens"),
    (dict(merges=["a b", "zz b"]), r"merges entry 'zz b' makes or uses 'zz'"),
    (dict(merges=["b a"]), r"merges entry 'b a' makes or uses 'ba'"),  # the merged token is missing
    (dict(tokens=[], types=[], merges=[]), r"tokenizer.ggml.tokens is empty"),
])  # fmt: skip
def test_a_vocabulary_that_cannot_encode_is_refused_at_load(change, match):
    from qkv.models.formats.tokenizer import from_gguf

    fields = dict(tokens=["a", "b", "ab"], token_type=[1, 1, 1], merges=["a b"]) | {("token_type" if k == "types" else k): v for k, v in change.items()}
    gguf = _Fields(tokenizer__ggml__model="gpt2", **{f"tokenizer__ggml__{k}": v for k, v in fields.items()})
    with pytest.raises(ModelError, match="f.gguf: .*" + match):
        from_gguf(gguf, source="f.gguf")
    assert from_gguf(_Fields(tokenizer__ggml__model="gpt2", tokenizer__ggml__tokens=["a", "b", "ab"], tokenizer__ggml__token_type=[1, 1, 1], tokenizer__ggml__merges=["a b"]), source="f.gguf").encode("ab") == [2]


@pytest.fixture(scope="module")
def tiny_q8(torch, tmp_path_factory):
    """A tiny llama written as llama.cpp writes it (Q8_0 matrices, F32 norms), and its bytes."""
    from test_gguf_families import _model

    bpe = gguf_writer.byte_level_vocab()
    path = tmp_path_factory.mktemp("q8") / "q8.gguf"
    gguf_writer.write(_model("llama", torch, len(bpe[0])), path, arch="llama", outtype="Q8_0", vocab=bpe)
    return path


@pytest.mark.parametrize("tensor, at, value", [
    ("blk.0.attn_q.weight", 0, np.float16("inf")),  # the first block's scale
    ("blk.1.ffn_down.weight", 34 * 3, np.float16("nan")),  # a later block's
    ("output_norm.weight", 8, np.float32("nan")),  # a norm
    ("blk.0.attn_norm.weight", 0, np.float32("-inf")),
])  # fmt: skip
@pytest.mark.parametrize("keep_quantized", [True, False])
def test_nan_or_inf_weights_are_refused_by_name_not_decoded_to_text(tensor, at, value, keep_quantized, tiny_q8, tmp_path):
    from qkv.models.formats.gguf import GGUFFile

    assert load_causal_lm(tiny_q8, keep_quantized=keep_quantized).generate("the", max_new_tokens=2).token_ids
    g = GGUFFile(tiny_q8)
    offset = g.tensors[tensor][2]
    g.close()
    raw = bytearray(tiny_q8.read_bytes())
    raw[offset + at : offset + at + value.itemsize] = value.tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ModelError, match=f"bad.gguf.*{tensor}.*NaN or infinite"):
        load_causal_lm(bad, keep_quantized=keep_quantized)


# ------------------------------------------------------------------------------- attention numerics
def _sink_reference(q, k, v, sinks, keep):  # float64 softmax over [scores, sink], the sink's weight dropped
    s = np.einsum("bhld,bhsd->bhls", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[-1])
    s = np.where(keep, s, -np.inf)
    sk = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (*s.shape[:-1], 1))
    full = np.concatenate([s, sk], -1)
    top = full.max(-1, keepdims=True)
    e = np.exp(full - np.where(np.isfinite(top), top, 0))
    p = e / np.where(e.sum(-1, keepdims=True) == 0, 1, e.sum(-1, keepdims=True))
    return np.einsum("bhls,bhsd->bhld", p[..., :-1], v.astype(np.float64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("implementation", ["direct", "tiled"])
@pytest.mark.parametrize("value", [-np.inf, -1e30, -1e4, -3.0, 0.0, 50.0])
def test_sinks_of_any_size_match_the_float64_reference(value, implementation, dtype):
    """A sink used to start the online softmax's shift: -1e30 cancelled every score (0.42 off on the
    tiled path, in float64 too) and -inf gave NaN there, 0.55 off on the direct path."""
    from qkv import scaled_dot_product_attention as sdpa

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 3, 40, 16), (2, 3, 50, 16), (2, 3, 50, 16)))
    sinks = np.array([value, -np.inf, 1.5], dtype)
    keep = np.tril(np.ones((40, 50), bool), 10)
    out = sdpa(q, k, v, is_causal=True, sinks=sinks, implementation=implementation)
    ref = _sink_reference(q, k, v, sinks, keep)
    assert np.abs(out - ref).max() <= (1e-12 if dtype == np.float64 else 2e-6)
    if value == -np.inf:  # exactly no sink, on each path
        plain = sdpa(q[:, :2], k[:, :2], v[:, :2], is_causal=True, implementation=implementation)
        np.testing.assert_array_equal(out[:, :2], plain)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_sinks_of_nan_or_plus_inf_are_an_error(bad):
    from qkv import scaled_dot_product_attention as sdpa

    x = np.ones((2, 4, 8), np.float32)
    for impl in ("direct", "tiled"):
        with pytest.raises(ValueError, match="sinks should be finite, or -inf for no sink"):
            sdpa(x, x, x, sinks=np.array([0.0, bad], np.float32), implementation=impl)


@pytest.mark.parametrize("option", ["scale", "softcap"])
@pytest.mark.parametrize("value, dtype", [(1e300, np.float32), (1e39, np.float32), (1e39, np.float16), (1e308 * 10, np.float64)])
def test_a_scale_or_softcap_that_overflows_the_dtype_is_an_error(option, value, dtype):
    from qkv import scaled_dot_product_attention as sdpa

    x = np.ones((2, 4, 8), dtype)
    with pytest.raises(ValueError, match=f"{option} .* does not fit in|{option} should be a finite number"):
        sdpa(x, x, x, **{option: value})
    assert np.isfinite(sdpa(x, x, x, **{option: 1e30})).all()  # float16 computes in float32: 1e30 fits


@pytest.mark.parametrize("axis", ["b", "h"])
def test_a_block_mask_shared_over_an_axis_its_mod_uses_is_refused(axis):
    from qkv import mods

    lengths = np.array([5, 9])

    def by_b(b, h, q, kv):
        return kv < lengths[b]

    def by_h(b, h, q, kv):
        return (kv <= q) | (h == 1)

    mod = by_b if axis == "b" else by_h
    with pytest.raises(ValueError, match=f"mask_mod '{mod.__name__}' depends on {axis}"):
        mods.create_block_mask(mod, None, None, 16, 16, block=4)
    bm = mods.create_block_mask(mod, 2, 2, 16, 16, block=4)  # named: fine
    assert bm.shape == (2, 2, 16, 16)
    mods.create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 16, 16, block=4)  # shared for real: fine


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.uint8, bool, np.longdouble, "U3"])
def test_a_paged_cache_of_a_non_float_dtype_is_refused(dtype):
    from qkv import PagedKVCache

    with pytest.raises(TypeError, match="dtype should be a floating dtype"):
        PagedKVCache(num_pages=2, page_size=4, num_kv_heads=1, head_dim=8, dtype=dtype)


def test_dtypes_that_do_not_mix_or_are_not_computed_in_are_clear_errors():
    import ml_dtypes

    from qkv import scaled_dot_product_attention as sdpa

    b, h = np.ones((2, 4, 8), ml_dtypes.bfloat16), np.ones((2, 4, 8), np.float16)
    with pytest.raises(TypeError, match="inputs of dtypes bfloat16, float16 do not mix"):
        sdpa(b, h, h)
    x = np.ones((2, 4, 8), np.longdouble)
    with pytest.raises(TypeError, match="dtype float128 is not supported"):
        sdpa(x, x, x)


def test_bfloat16_sinks_and_alibi_slopes_are_accepted_like_bias():
    import ml_dtypes

    from qkv import scaled_dot_product_attention as sdpa

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 8)).astype(ml_dtypes.bfloat16)
    sinks, slopes = np.array([0.5, -1.0], ml_dtypes.bfloat16), np.array([0.25, 0.5], ml_dtypes.bfloat16)
    got = sdpa(x, x, x, sinks=sinks, alibi_slopes=slopes, is_causal=True)
    want = sdpa(x.astype(np.float32), x.astype(np.float32), x.astype(np.float32), sinks=sinks.astype(np.float32), alibi_slopes=slopes.astype(np.float32), is_causal=True)
    np.testing.assert_allclose(got.astype(np.float32), want, atol=1e-2)


def _mask_with_and(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx and kv_idx > 0  # Python `and` on arrays: ambiguous truth value


def _score_with_if(score, b, h, q_idx, kv_idx):
    return score if q_idx > kv_idx else score - 1


@pytest.mark.parametrize("call", ["sdpa_mask_mod", "create_block_mask", "sdpa_score_mod", "vjp_score_mod"])
def test_a_mod_written_for_scalars_is_named_with_the_fix(call):
    import qkv
    from qkv import mods

    x = np.ones((1, 2, 4, 8), np.float32)
    run = {
        "sdpa_mask_mod": lambda: qkv.scaled_dot_product_attention(x, x, x, mask_mod=_mask_with_and),
        "create_block_mask": lambda: mods.create_block_mask(_mask_with_and, 1, 2, 4, 4),
        "sdpa_score_mod": lambda: qkv.scaled_dot_product_attention(x, x, x, score_mod=_score_with_if),
        "vjp_score_mod": lambda: qkv.scaled_dot_product_attention_vjp(x, x, x, score_mod=_score_with_if, implementation="tiled"),
    }[call]
    name = "_score_with_if" if "score" in call else "_mask_with_and"
    with pytest.raises(ValueError, match=rf"'{name}' failed .*use &, \|, np.where, not and/or/if"):
        run()


@pytest.mark.parametrize("make", ["alibi", "relative_position_bias", "returns_bfloat16"])
def test_bfloat16_is_accepted_wherever_a_float_is(make):
    import ml_dtypes

    from qkv import mods, scaled_dot_product_attention_vjp as sdpa_vjp

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6, 8)).astype(np.float32)
    param = rng.standard_normal({"alibi": (2,), "relative_position_bias": (2, 7), "returns_bfloat16": (1,)}[make]).astype(bf16)

    def build(p):
        if make == "alibi":
            return mods.alibi(p)
        if make == "relative_position_bias":
            return mods.relative_position_bias(p, 3)
        return mods.ScoreMod(lambda s, b, h, i, j: (s * p.astype(np.float32)[0]).astype(p.dtype), lambda s, b, h, i, j: np.full_like(s, float(p[0])))

    d_out = rng.standard_normal((2, 6, 8)).astype(bf16)
    out, vjp = sdpa_vjp(x, x, x, score_mod=build(param))
    grads = vjp(d_out)  # a bfloat16 d_output, as the bfloat16 output a bfloat16 forward returns
    out32, vjp32 = sdpa_vjp(x, x, x, score_mod=build(param.astype(np.float32)))
    grads32 = vjp32(d_out.astype(np.float32))
    np.testing.assert_allclose(out, out32, atol=1e-2)
    for name in ("d_query", "d_key", "d_value"):
        np.testing.assert_allclose(getattr(grads, name), getattr(grads32, name), atol=2e-2)
    for name, g in grads.d_score_mod.items():
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(grads32.d_score_mod[name], np.float32), atol=2e-2)


# ------------------------------------------------------------------------------- generation bounds
@pytest.fixture(scope="module")
def tiny_t5(torch, tmp_path_factory):
    from test_seq2seq import _tiny_t5

    from qkv.models import load_seq2seq_lm

    return load_seq2seq_lm(_tiny_t5(torch, tmp_path_factory.mktemp("t5"))[1])


@pytest.mark.parametrize("options, error, match", [
    (dict(num_beams=10**6), ValueError, "num_beams should be at most 256, got 1,000,000"),
    (dict(num_beams=10**12), ValueError, "num_beams should be at most 256"),
    (dict(num_beams=3, length_penalty=float("nan")), ValueError, "length_penalty should be a finite number"),
    (dict(num_beams=3, length_penalty=1e308), ValueError, r"length_penalty should be a number in \[-10, 10\]"),
    (dict(num_beams=3, length_penalty=-11.0), ValueError, r"length_penalty should be a number in"),
])  # fmt: skip
def test_beam_search_options_are_bounded_before_work(options, error, match, tiny_t5):
    t0 = time.monotonic()
    with pytest.raises(error, match=match):
        tiny_t5.generate([5, 6, 7], max_new_tokens=4, **options)
    assert time.monotonic() - t0 < 5
    assert tiny_t5.generate([5, 6, 7], max_new_tokens=4, num_beams=3, length_penalty=2.0).token_ids


def test_a_ragged_batch_says_so(tiny_t5):
    with pytest.raises(ValueError, match=r"input_ids rows have different lengths \(3, 1\): pad them to one length and pass attention_mask"):
        tiny_t5.encode([[5, 6, 7], [8]])


def test_a_truncated_wav_names_the_path(tmp_path):
    import wave

    from qkv.models.families.whisper import read_wav

    with wave.open(str(tmp_path / "a.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(b"\x01\x00" * 16000)
    raw = (tmp_path / "a.wav").read_bytes()
    for cut, match in ((5001, "truncated: its header says 16,000 frames, the file holds 2,478"), (5000, "truncated"), (30, "not a PCM WAV file qkv can read")):
        (tmp_path / "t.wav").write_bytes(raw[:cut])
        with pytest.raises(ValueError, match=f"t.wav: {match}"):
            read_wav(tmp_path / "t.wav")


def test_a_wav_past_two_hours_is_refused_before_it_is_read(tmp_path):
    """A header may claim any number of frames: past 2 h of 16 kHz stereo, refused before reading (a long
    recording up to that is read: Whisper transcribes it window after window)."""
    import struct
    import wave

    from qkv.models.families.whisper import read_wav

    with wave.open(str(tmp_path / "a.wav"), "wb") as w:
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(16000), w.writeframes(b"\x01\x00" * 2 * 16000)
    raw = bytearray((tmp_path / "a.wav").read_bytes())
    at = raw.index(b"data") + 4
    raw[at : at + 4] = struct.pack("<I", 2 * 2 * (16000 * 7200 + 1))  # one frame past 2 h
    (tmp_path / "b.wav").write_bytes(raw)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"b.wav: 115,200,001 frames of 2 channels, past the 7,200 s of 16 kHz stereo qkv reads at once"):
        read_wav(tmp_path / "b.wav")
    assert time.monotonic() - t0 < 5
    audio, rate = read_wav(tmp_path / "a.wav")
    assert audio.dtype == np.float32 and audio.shape == (16000,) and rate == 16000 and np.allclose(audio, 1 / 32768)


def test_a_wav_whose_chunk_points_past_its_end_is_a_value_error(tmp_path):
    """Python's wave module raises a bare RuntimeError when a chunk's size points past the file."""
    import struct
    import wave

    from qkv.models.families.whisper import read_wav

    with wave.open(str(tmp_path / "a.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(b"\x01\x00" * 160)
    raw = bytearray((tmp_path / "a.wav").read_bytes())
    raw[16:20] = struct.pack("<I", 2**31)  # the fmt chunk's size
    (tmp_path / "b.wav").write_bytes(raw)
    with pytest.raises(ValueError, match="b.wav: not a PCM WAV file qkv can read"):
        read_wav(tmp_path / "b.wav")
    with pytest.raises(ValueError, match="cannot read"):
        read_wav(tmp_path)  # a directory


def test_a_missing_seq2seq_directory_says_so():
    from qkv.models import load_seq2seq_lm

    with pytest.raises(ModelError, match="missing-dir: no such file or folder"):
        load_seq2seq_lm("missing-dir")


# ------------------------------------------------------------------------------- the user's install
def test_every_extra_brings_what_its_code_imports():
    """[gemma] is the README's generate line: without numba it decoded at 0.2 tokens/s; numba's np.dot
    needs SciPy's BLAS, so [fast] without SciPy failed inside the first tiled product."""
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {k: {d.split(">")[0].split("=")[0].split("[")[0] for d in v} | {x for d in v if d.startswith("qkv[") for x in d[4:-1].split(",")} for k, v in extras.items()}
    assert {"numba", "scipy"} <= names["fast"]
    assert "fast" in names["gemma"] and "models" in names["gemma"]
    assert "llguidance" in names["structured"] and {"structured", "gemma"} <= names["serve"]  # response_format
    assert {"fast", "dask", "gemma", "models", "viz", "structured", "serve"} <= names["all"]


def test_without_the_compiled_kernels_products_fall_back_and_say_so_once(monkeypatch):
    import warnings

    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    import qkv.flash
    from qkv.models.formats import quants
    monkeypatch.setattr(qkv.flash, "compiled_available", lambda: False)
    monkeypatch.setattr(qkv.flash, "KERNEL", "numpy")
    monkeypatch.setattr(quants, "_told", [])
    w = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    m = quants.QuantizedMatrix(quantize(w, T.Q8_0), "Q8_0", (64, 96))
    x = np.ones((1, 96), np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b = m.matmul(x), m.matmul(x)
    said = [str(c.message) for c in caught]
    assert len(said) == 1 and "pip install 'qkv[fast]'" in said[0]
    np.testing.assert_allclose(a, x @ m.dequantize(kernel="numpy").T, rtol=1e-6)
    assert np.array_equal(a, b)


def test_a_long_string_array_is_checked_at_open_and_decoded_when_asked(tmp_path):
    """A vocabulary (more than 4,096 strings) is stepped over at open, every length checked against the
    file, and decoded when first asked for; asked for after the file is closed, it is a clear error."""
    from qkv.models.formats.gguf import GGUFFile

    words = [f"w{i}" for i in range(5000)] + ["caf\u00e9", ""]
    path = raw_gguf(tmp_path / "v.gguf", [*LLAMA_KEYS, ("tokenizer.ggml.tokens", 9, (8, words))])
    g = GGUFFile(path)
    assert g.length("tokenizer.ggml.tokens") == len(words)
    assert g.field("tokenizer.ggml.tokens") == words
    with pytest.raises(ModelError, match="metadata 'general.architecture' should be an array, got 'llama'"):
        g.length("general.architecture")
    assert g.length("tokenizer.ggml.merges") is None
    g.close()
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: data.index(b"w4000")])  # the file ends inside the array
    with pytest.raises(ModelError, match="cut.gguf: truncated GGUF header in tokenizer.ggml.tokens"):
        GGUFFile(tmp_path / "cut.gguf")
    at = data.index(b"w2500") - 8  # one string claims more bytes than the file has
    (tmp_path / "long.gguf").write_bytes(data[:at] + (2**40).to_bytes(8, "little") + data[at + 8 :])
    with pytest.raises(ModelError, match="long.gguf: truncated GGUF header in tokenizer.ggml.tokens"):
        GGUFFile(tmp_path / "long.gguf")
    g = GGUFFile(path)
    g.close()
    with pytest.raises(ModelError, match="v.gguf: metadata 'tokenizer.ggml.tokens' was not read before the file was closed"):
        g.field("tokenizer.ggml.tokens")


def test_every_lookup_by_id_refuses_what_would_wrap_or_truncate(tiny_q8):
    """Token ids reach rows through six public doors; each refuses a negative id (NumPy and Python would
    count it from the end), an id past the end, and a float (int() would truncate it), with one message."""
    from qkv.models.engines.decoder import check_token_ids
    from qkv.text import Embedding, Vocabulary

    lm = load_causal_lm(tiny_q8)
    V = lm.config.vocab_size
    vocab = Vocabulary.from_texts(["a b c"])
    assert not isinstance(lm.embed, np.ndarray)  # kept quantized: take() is its own door
    doors = [  # (the name its message gives, rows it indexes, a call with an array of ids)
        ("input_ids", V, lambda ids: check_token_ids(ids, V)),
        ("ids", V, lambda ids: lm.tokenizer.decode(ids.tolist())),
        (f"{lm.embed.name}: ids", V, lambda ids: lm.embed.take(ids)),
        ("ids", len(vocab), lambda ids: vocab.decode(ids)),
        ("ids", 5, lambda ids: Embedding(5, 2, rng=0)(ids)),
    ]
    for name, n, call in doors:
        call(np.array([0, n - 1]))  # the ends are ids
        for bad in ([-1], [n], [2, -3, n + 5]):
            first = min(b for b in bad if not 0 <= b < n)
            with pytest.raises(ValueError, match=rf"{name} should lie in \[0, {n - 1}\], got \[?{first}"):
                call(np.array(bad))
        with pytest.raises(TypeError, match="should be integers"):
            call(np.array([1.0]))
    # many bad ids: the first 8 named, and how many in all
    with pytest.raises(ValueError, match=r"ids should lie in \[0, 4\], got \[-12, -11, .*, -5, \.\.\. \(12 in all\)\]"):
        Embedding(5, 2, rng=0)(np.arange(-12, 0))
    with pytest.raises(TypeError, match="ids should be integers, got float 1.0"):
        lm.tokenizer.token(1.0)
    with pytest.raises(TypeError, match="ids should be integers, got bool True"):
        lm.tokenizer.token(True)  # Python would index with it as 1
    with pytest.raises(ValueError, match=rf"ids should lie in \[0, {V - 1}\], got -1"):
        lm.tokenizer.token(-1)


# ------------------------------------------------------------------ a Hugging Face config.json is a file from anyone


@pytest.fixture(scope="module")
def hf_dirs(torch, tmp_path_factory):
    from test_decoder import _tiny

    base = tmp_path_factory.mktemp("hf")
    return {family: _tiny(family, torch, base)[1] for family in ("llama", "gemma3", "bloom")}


def _hf_with(hf_dirs, family, changes, tmp_path):
    import json
    import shutil

    d = tmp_path / family
    shutil.copytree(hf_dirs[family], d)
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    return d


@pytest.mark.parametrize("family, changes, match", [
    ("llama", {"bos_token_id": -1}, r"field 'bos_token_id' should be a token id in \[0, 97\), got -1"),  # had failed at generate, blaming the prompt
    ("llama", {"bos_token_id": 1.5}, r"field 'bos_token_id' should be a token id in \[0, 97\), got 1.5"),  # it had been truncated to 1
    ("llama", {"eos_token_id": [2, 2**31]}, r"field 'eos_token_id' should be a token id or a list of them in \[0, 97\)"),
    ("llama", {"eos_token_id": float("inf")}, "field 'eos_token_id'"),  # had been an OverflowError
    ("llama", {"pad_token_id": {}}, "field 'pad_token_id'"),
    ("llama", {"bos_token_id": "<s>"}, "field 'bos_token_id'"),  # had been int()'s own message, naming nothing
    ("llama", {"num_key_value_heads": 3}, "num_heads 4 should be a multiple of num_kv_heads 3"),
    ("llama", {"rope_theta": 1.0}, r"the RoPE base should be a finite number > 1, got \[1.0\]"),  # had been an error of the first forward pass
    ("llama", {"num_hidden_layers": 10**30}, r"field 'num_hidden_layers' is 1,000,000,000,000,000,000,000,000,000,000, more layers than model.safetensors holds tensors"),
    ("llama", {"head_dim": 2**31}, r"field 'head_dim' is 2,147,483,648, larger than any tensor of model.safetensors \(3,104\)"),
    ("gemma3", {"sliding_window": 10**30}, r"a sliding window should be a whole number of tokens in \[1, 2\*\*62\]"),  # had failed inside numba
    ("gemma3", {"rope_parameters": "fast"}, "field 'rope_parameters' should be an object, got 'fast'"),  # had been an AttributeError
    ("gemma3", {"rope_parameters": {"full_attention": 5}}, "rope_parameters: field 'full_attention' should be an object, got 5"),
    ("bloom", {"n_layer": None}, "missing field 'num_hidden_layers'"),  # had been a TypeError of None
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),  # had run causally: logits 0.44 off transformers
])  # fmt: skip
def test_a_config_json_is_checked_at_load_and_its_errors_name_it(family, changes, match, hf_dirs, tmp_path):
    d = _hf_with(hf_dirs, family, changes, tmp_path)
    with pytest.raises(ModelError, match=match) as e:
        load_causal_lm(d)
    assert str(e.value).startswith(f"{d / 'config.json'}: ")


def test_a_config_json_pad_of_minus_one_means_none(hf_dirs, tmp_path):
    """Old Llama conversions say ``"pad_token_id": -1`` for "no padding token": read as none, never as an id."""
    lm = load_causal_lm(_hf_with(hf_dirs, "llama", {"pad_token_id": -1}, tmp_path))
    assert lm.tokenizer.pad_id is None
    a, b = lm.generate(["w3 w5 w7", "w9"], max_new_tokens=3), lm.generate("w9", max_new_tokens=3)  # padding still works
    assert a[1].token_ids == b.token_ids


def test_an_encoder_decoder_config_checks_its_token_ids(torch, tmp_path):
    import json

    from test_seq2seq import _tiny_t5

    from qkv.models import load_seq2seq_lm

    d = _tiny_t5(torch, tmp_path)[1]
    c = json.loads((d / "config.json").read_text())
    for key, value in [("decoder_start_token_id", -1), ("decoder_start_token_id", 1.7), ("eos_token_id", [1, 2]), ("pad_token_id", 10**9)]:
        (d / "config.json").write_text(json.dumps({**c, key: value}))
        with pytest.raises(ModelError, match=rf"^{d / 'config.json'}: field '{key}' should be a token id in \[0, 64\), got "):
            load_seq2seq_lm(d)


def test_a_missing_token_id_whose_default_is_not_in_the_vocabulary_is_named(torch, tmp_path):
    """A Whisper config.json without decoder_start_token_id: Whisper's default, 50258, is not an id of a
    64-token vocabulary; the error had come at generate, blaming decoder_input_ids."""
    import json

    from test_seq2seq import _tiny_whisper

    from qkv.models import load_seq2seq_lm

    d = _tiny_whisper(torch, tmp_path)[1]
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in c.items() if k != "decoder_start_token_id"}))
    with pytest.raises(ModelError, match=rf"^{d / 'config.json'}: field 'decoder_start_token_id' is missing, and its default, 50258, is not a token id in \[0, 64\)"):
        load_seq2seq_lm(d)


def test_a_tokenizer_that_panics_is_a_value_error_not_a_base_exception(hf_dirs, tmp_path):
    """A tokenizer.json whose split pattern backtracks past Oniguruma's limit makes the Rust library panic:
    pyo3's PanicException is a BaseException, which ``except Exception`` (a server's stepping thread) lets pass."""
    import json

    d = _hf_with(hf_dirs, "llama", {}, tmp_path)
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    lm = load_causal_lm(d)
    assert lm.tokenizer.encode("w3 w5") == lm.tokenizer.encode("w3 w5")  # short texts are fine
    with pytest.raises(ValueError, match="the model's tokenizer failed on this text"):
        lm.generate("a" * 40 + "b", max_new_tokens=1)


def test_a_tokenizer_with_bpe_dropout_is_refused_not_run_at_random(hf_dirs, tmp_path):
    """BPE dropout (a training-time regularizer) skips each merge at random: the same text would get
    other ids at each call, with no seed to fix them. Such a tokenizer.json is refused by name."""
    from tokenizers import Tokenizer, models

    d = _hf_with(hf_dirs, "llama", {}, tmp_path)
    vocab = {"a": 3, "b": 4, "ab": 5, "abab": 6}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "ab")], dropout=0.5))
    assert len({tuple(tok.encode("ab" * 16).ids) for _ in range(20)}) > 1  # the library's own encoding is random
    tok.save(str(d / "tokenizer.json"))
    with pytest.raises(ModelError, match=rf"^{d / 'tokenizer.json'}: model.dropout is 0.5: BPE dropout makes the ids of a text random"):
        load_causal_lm(d)
    tok.model.dropout = None
    tok.save(str(d / "tokenizer.json"))
    assert load_causal_lm(d).tokenizer.encode("ab" * 16) == [6] * 8

"""Hostile files and inputs, busy machines, a user's own install: one clear answer every time.

Each test here failed (a hang, a silent wrong number, gigabytes eaten or a traceback) before the fix it
guards, and checks the class of input, not one case."""

import time

import numpy as np
import pytest

import gguf_writer
from qkv.models import ModelError, load_causal_lm
from qkv.models.chat import MAX_RENDER_CHARS, RENDER_SECONDS, ChatTemplate

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
    from qkv.cli import build_parser, _sampling

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

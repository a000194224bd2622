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

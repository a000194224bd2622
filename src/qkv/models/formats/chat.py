"""Chat templates: a conversation as the text a chat model was trained on.

An instruction-tuned model expects each turn wrapped in its own markers
(Gemma: ``<start_of_turn>user ... <end_of_turn>``; ChatML: ``<|im_start|>``);
the file carries the recipe as a Jinja template (GGUF:
``tokenizer.chat_template``; a Hugging Face directory: ``tokenizer_config.json``
or ``chat_template.jinja``). It is rendered here as transformers'
``apply_chat_template`` renders it, with the same Jinja settings (blocks
trimmed, ``loopcontrols``, the ``generation`` tag, ``tojson`` without HTML
escaping, ``raise_exception``, ``strftime_now``), so the text is the same.

A template is text from whoever made the file: it runs in Jinja's
``ImmutableSandboxedEnvironment``, where a template cannot reach Python's
internals (``''.__class__.__mro__`` and the like raise ``SecurityError``), as
transformers runs it. Any failure is one :class:`ModelError` naming the
template's source.

A file without a template is, almost always, a base (pretrained) model: it
continues text; it was never taught to answer. For Gemma files qkv then uses
Gemma's turn format (:data:`GEMMA_TEMPLATE`, as llama.cpp falls back on an
architecture's format) and says so.
"""

from __future__ import annotations

import json
import math
import re
from datetime import datetime

from ..errors import ModelError

__all__ = ["ChatTemplate", "GEMMA_TEMPLATE", "check_messages"]

#: Gemma's turn format (text only): a system message joins the first user turn, roles alternate,
#: the assistant is called "model", and a generation prompt opens the model's turn.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

#: The longest template qkv renders (characters): a longer one in a file is refused, not compiled.
MAX_TEMPLATE_CHARS = 1 << 20
#: A render's bounds. A template from a file is untrusted code: every value it builds (string, list) and
#: its whole output stay under MAX_RENDER_CHARS, checked before the value is made; integers stay under
#: MAX_INT_BITS bits; the render stops after RENDER_SECONDS. Real chat templates stay far inside these
#: (a conversation filling a 128k-token context is about half a million characters).
MAX_RENDER_CHARS = 1 << 22
MAX_INT_BITS = 1 << 12
RENDER_SECONDS = 2.0


class TemplateLimitError(Exception):
    """A render went past one of the bounds above (raised inside the render, reported as a ModelError)."""


def check_messages(messages) -> list[dict]:
    """A conversation: a non-empty list of ``{"role": str, "content": str}`` (other keys pass through)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages should be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: give at least one {'role': 'user', 'content': ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] should be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}][{key!r}] should be a string, got {m.get(key)!r}")
        out.append(dict(m))
    return out


def _size(x) -> int:
    """How many characters (or items) a value holds, for the bounds; 0 for what does not grow."""
    if isinstance(x, (str, bytes, list, tuple, dict)):
        return len(x)
    return 0


def _check_size(n: int, what: str) -> None:
    if n > MAX_RENDER_CHARS:
        raise TemplateLimitError(f"{what} would hold {n:,} characters or items, more than qkv renders ({MAX_RENDER_CHARS:,})")


def _check_int(x, what: str) -> None:
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"{what} gives an integer of {x.bit_length():,} bits, more than qkv computes ({MAX_INT_BITS:,})")


def _repeat(left, right):
    """``*``: repetition of a string or list sized before it is made; numbers bounded in bits."""
    for seq, n in ((left, right), (right, left)):
        if _size(seq) and isinstance(n, int):
            _check_size(_size(seq) * max(n, 0), "a repetition ('*')")
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"a product ('*') would have up to {left.bit_length() + right.bit_length():,} bits, more than qkv computes ({MAX_INT_BITS:,})")
    return left * right


def _power(left, right):
    """``**``: an integer power sized before it is computed (``2 ** 100000000`` would take minutes)."""
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        bits = right * math.log2(abs(left))
        if bits > MAX_INT_BITS:
            raise TemplateLimitError(f"a power ('**') of {right:,} would have about {bits:,.0f} bits, more than qkv computes ({MAX_INT_BITS:,})")
    return left**right


def _add(left, right):
    """``+``: a concatenation sized before it is made."""
    if _size(left) and _size(right):
        _check_size(_size(left) + _size(right), "a concatenation ('+')")
    out = left + right
    _check_int(out, "a sum ('+')")
    return out


_PRINTF_WIDTH = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d*))?")
_BRACE_WIDTH = re.compile(r"\d+")


def _check_format(text: str, style: str) -> None:
    """The widths and precisions a format string asks for, bounded (``'%999999999d' % 1`` or
    ``'{:>999999999}'.format(1)`` would allocate a gigabyte)."""
    if style == "%":
        numbers = [d for pair in _PRINTF_WIDTH.findall(text) for d in pair if d]
    else:
        import string

        numbers = [d for _, _, spec, _ in string.Formatter().parse(text) if spec for d in _BRACE_WIDTH.findall(spec)]
    for digits in numbers:
        if len(digits) > 7 or int(digits) > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"a format asks for a width of {digits} characters, more than qkv renders ({MAX_RENDER_CHARS:,})")


def _modulo(left, right):
    """``%``: printf-style formatting, its widths bounded."""
    if isinstance(left, str):
        _check_format(left, "%")
    return left % right


def _check_arguments(args, kwargs, what: str) -> None:
    """No argument of a call or filter may ask for more than the bounds (a width, a count, an indent)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_RENDER_CHARS:
            raise TemplateLimitError(f"{what} was given {a:,}, more than qkv renders ({MAX_RENDER_CHARS:,})")


def _estimate(func, args, kwargs, what: str) -> None:
    """What a growing string method or filter would make, checked before it is made: a replace, a
    join, an indent (the others grow by at most their bounded arguments)."""
    name = getattr(func, "__name__", "")
    strings = [a for a in args if isinstance(a, str)]
    if name in ("replace", "do_replace") and len(strings) >= 3:
        text, old, new = strings[:3]
        count = text.count(old) if old else len(text) + 1
        _check_size(len(text) + count * max(len(new) - len(old), 0), what)
    elif name in ("join", "do_join"):
        sep = max((len(a) for a in strings), default=0)
        for seq in (a for a in args if isinstance(a, (list, tuple))):
            _check_size(sum(len(x) if isinstance(x, str) else 32 for x in seq) + len(seq) * sep, what)
    elif name == "do_format" and strings:
        _check_format(strings[0], "%")
    elif name in ("format", "format_map") and strings:
        _check_format(strings[0], "{}")
    elif name == "do_indent" and strings:
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width
        if isinstance(width, int):
            _check_size(len(strings[0]) + (strings[0].count("\n") + 1) * width, what)


def _bounded(func, what: str):
    """``func`` (a filter) with its arguments and result checked against the bounds."""
    import functools

    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marks
    def call(*args, **kwargs):
        _check_arguments(args, kwargs, what)
        _estimate(func, args, kwargs, what)
        out = func(*args, **kwargs)
        _check_size(_size(out), what)
        return out

    return call


class _Deadline:
    """Stops a render after ``seconds``: a trace on the template's own code checks the clock at each line
    it runs (a loop with an empty body included), and nothing outside the template is traced."""

    def __init__(self, seconds: float, filename: str):
        self.seconds, self.filename = seconds, filename

    def __enter__(self):
        import sys
        import time

        self._clock = time.monotonic
        self.end = self._clock() + self.seconds
        self._old = sys.gettrace()
        sys.settrace(self._enter)
        return self

    def __exit__(self, *exc):
        import sys

        sys.settrace(self._old)
        return False

    def _enter(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == self.filename else None

    def _line(self, frame, event, arg):
        if self._clock() > self.end:
            raise TemplateLimitError(f"the render ran for more than {self.seconds:g} s")
        return self._line


#: The filename Jinja gives the code a template compiles to: how the deadline finds template frames.
_TEMPLATE_FILE = "<qkv chat template>"


def _environment():
    try:
        import jinja2
        from jinja2.compiler import CodeGenerator
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'qkv[models]'") from None

    class Generation(Extension):  # {% generation %} ... {% endgeneration %}: marks an assistant's part; rendered as its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class BoundedCode(CodeGenerator):
        """``a ~ b`` goes through the environment's sized join (Jinja writes it as a plain join)."""

        def visit_Concat(self, node, frame):
            self.write("environment.concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox transformers renders in, with every operation that can grow a value bounded
        before it runs: ``*``, ``**``, ``+``, ``%``, ``~``, calls (``'x'.center(n)``, ``s.replace``) and
        filters. Intercepted operators are also never folded at compile time, so loading a template
        computes nothing of it."""

        code_generator_class = BoundedCode
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.binop_table = {**self.binop_table, "*": _repeat, "**": _power, "+": _add, "%": _modulo}

        def concat(self, parts):
            strings = [str(p) for p in parts]
            _check_size(sum(map(len, strings)), "a concatenation ('~')")
            return "".join(strings)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            name = getattr(__obj, "__name__", type(__obj).__name__)
            what = f"a call of {'range' if name == 'safe_range' else name}"
            _check_arguments(args, kwargs, what)
            bound = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)  # the sandbox wraps str.format
            if isinstance(bound, str):  # a string method: its receiver is the first argument to size
                _estimate(__obj, (bound, *args), kwargs, what)
            out = super().call(__context, __obj, *args, **kwargs)
            _check_size(_size(out), what)
            return out

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        if isinstance(indent, int) and indent > 64:
            raise TemplateLimitError(f"tojson's indent {indent:,} is more than qkv renders (64)")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded(f, f"the filter {name}") for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, jinja2


class ChatTemplate:
    """A chat template, compiled in the sandbox the first time it renders (loading a model computes
    nothing of its template: a hostile one fails where it is used, with one clear error).

    Parameters
    ----------
    source : str
        The Jinja template.
    origin : str
        Where it came from, for messages (a file and its field).
    bos_token, eos_token : str
        What ``{{ bos_token }}`` and ``{{ eos_token }}`` render as.

    Examples
    --------
    >>> from qkv.models.formats.chat import ChatTemplate, GEMMA_TEMPLATE
    >>> t = ChatTemplate(GEMMA_TEMPLATE, "Gemma's turn format", bos_token="<bos>")
    >>> print(t.render([{"role": "user", "content": "Hi!"}]))
    <bos><start_of_turn>user
    Hi!<end_of_turn>
    <start_of_turn>model
    <BLANKLINE>

    A render is bounded in time, output and the size of every value it builds:

    >>> ChatTemplate("{{ 'ab' * 10**9 }}", "a file").render([{"role": "user", "content": "Hi!"}])
    Traceback (most recent call last):
    ...
    qkv.models.errors.ModelError: a file: the chat template went past qkv's bounds on a render: a repetition ('*') would hold 2,000,000,000 characters or items, more than qkv renders (4,194,304)
    """

    def __init__(self, source: str, origin: str, *, bos_token: str = "", eos_token: str = ""):
        if not isinstance(source, str):
            raise ModelError(f"{origin}: the chat template should be text, got {type(source).__name__}")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ModelError(f"{origin}: the chat template is {len(source):,} characters, more than qkv reads ({MAX_TEMPLATE_CHARS:,})")
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.origin!r}, {len(self.source)} characters)"

    def _compiled(self):
        if self._template is None:
            env, jinja2 = _environment()
            self._jinja = jinja2
            try:
                with _Deadline(RENDER_SECONDS, _TEMPLATE_FILE):
                    code = env.compile(self.source, filename=_TEMPLATE_FILE)
                    self._template = env.template_class.from_code(env, code, env.make_globals(None))
            except jinja2.exceptions.TemplateError as exc:
                raise ModelError(f"{self.origin}: the chat template does not compile: {exc}") from None
            except TemplateLimitError as exc:
                raise ModelError(f"{self.origin}: the chat template went past qkv's bounds while compiling: {exc}") from None
            except (RecursionError, MemoryError) as exc:
                raise ModelError(f"{self.origin}: the chat template does not compile ({type(exc).__name__}: nested too deep or too large)") from None
        return self._template

    def render(self, messages, *, add_generation_prompt: bool = True, **extra) -> str:
        """The conversation as text, ending with the assistant's turn opened (``add_generation_prompt``).

        Raises :class:`ModelError` naming the template for anything the template does: a forbidden
        operation, a failure, or going past :data:`RENDER_SECONDS`, :data:`MAX_RENDER_CHARS` or
        :data:`MAX_INT_BITS`."""
        messages = check_messages(messages)
        template = self._compiled()
        jinja = self._jinja
        parts, size = [], 0
        try:
            with _Deadline(RENDER_SECONDS, _TEMPLATE_FILE):
                for part in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token, eos_token=self.eos_token, **extra):
                    size += len(part)
                    _check_size(size, "the rendered text")
                    parts.append(part)
        except jinja.exceptions.SecurityError as exc:
            raise ModelError(f"{self.origin}: the chat template tried something the sandbox forbids ({exc}): it is not rendered") from None
        except TemplateLimitError as exc:
            raise ModelError(f"{self.origin}: the chat template went past qkv's bounds on a render: {exc}") from None
        except jinja.exceptions.TemplateError as exc:
            raise ModelError(f"{self.origin}: the chat template failed to render this conversation: {exc}") from None
        except Exception as exc:  # the template is code from a file: whatever it raises is its failure, one line
            raise ModelError(f"{self.origin}: the chat template failed to render this conversation ({type(exc).__name__}: {exc})") from None
        return "".join(parts)

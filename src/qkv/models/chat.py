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
from datetime import datetime

from .errors import ModelError

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


def _environment():
    try:
        import jinja2
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

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, jinja2


class ChatTemplate:
    """A chat template, compiled once in the sandbox.

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
    >>> from qkv.models.chat import ChatTemplate, GEMMA_TEMPLATE
    >>> t = ChatTemplate(GEMMA_TEMPLATE, "Gemma's turn format", bos_token="<bos>")
    >>> print(t.render([{"role": "user", "content": "Hi!"}]))
    <bos><start_of_turn>user
    Hi!<end_of_turn>
    <start_of_turn>model
    <BLANKLINE>
    """

    def __init__(self, source: str, origin: str, *, bos_token: str = "", eos_token: str = ""):
        if not isinstance(source, str):
            raise ModelError(f"{origin}: the chat template should be text, got {type(source).__name__}")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ModelError(f"{origin}: the chat template is {len(source):,} characters, more than qkv reads ({MAX_TEMPLATE_CHARS:,})")
        env, jinja2 = _environment()
        self._jinja = jinja2
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ModelError(f"{origin}: the chat template does not compile: {exc}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.origin!r}, {len(self.source)} characters)"

    def render(self, messages, *, add_generation_prompt: bool = True, **extra) -> str:
        """The conversation as text, ending with the assistant's turn opened (``add_generation_prompt``)."""
        messages = check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except self._jinja.exceptions.SecurityError as exc:
            raise ModelError(f"{self.origin}: the chat template tried something the sandbox forbids ({exc}): it is not rendered") from None
        except self._jinja.exceptions.TemplateError as exc:
            raise ModelError(f"{self.origin}: the chat template failed to render this conversation: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            raise ModelError(f"{self.origin}: the chat template failed to render this conversation ({type(exc).__name__}: {exc})") from None

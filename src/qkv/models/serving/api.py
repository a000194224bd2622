"""The OpenAI-compatible HTTP side of ``qkv serve``: Starlette routes, pydantic validation, server-sent events.

Every request body is read with a size bound, parsed and validated here
(pydantic), then handed to the :class:`~.scheduler.Scheduler` as one
:class:`~.scheduler.Request` per choice. A bad request gets OpenAI's error
shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx status;
an unexpected failure a 500 with no traceback (that goes to the server's log).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engines.sampling import MAX_OPENAI_PENALTY, MAX_PENALTY, check_logit_bias, check_penalty, check_sampling
from .http import READ_TIMEOUT
from .scheduler import Closed, Request

__all__ = ["Limits", "check_origins", "create_app"]

log = logging.getLogger("qkv.serve")


@dataclass(frozen=True)
class Limits:
    """What one request may ask (``qkv serve``'s options)."""

    max_body_bytes: int = 1 << 20
    max_tokens: int = 2048  # per choice
    max_context: int = 4096  # prompt + max_tokens
    max_n: int = 8
    max_prompts: int = 16  # a completion request's prompts
    max_top_logprobs: int = 20
    timeout_s: float = 600.0  # a request's deadline
    read_timeout_s: float = READ_TIMEOUT  # a request body's deadline, from its head (the head's own: serving.http)
    max_embedding_inputs: int = 256


#: The error code of a request the engine ended, by the HTTP status it gives (the scheduler's payload).
_ERROR_CODES = {503: "shutting_down", 504: "timeout", 500: "internal_error"}
#: ... and its type (a 400 from the engine: a JSON schema's matcher reached one of llguidance's limits mid-answer).
_ERROR_KINDS = {504: "timeout_error", 400: "invalid_request_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = status, message, param, code, kind, headers


def error_response(status: int, message: str, *, param=None, code=None, kind="invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status, headers=headers)


# ------------------------------------------------------------ request bodies


#: The sampling of a request that sets none, where the model recommends none: OpenAI's (temperature 1).
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": None, "top_k": None, "min_p": None, "repetition_penalty": 1.0}


class _Strict(BaseModel):
    """A request object: an unknown field is refused; a field given as null takes its default.

    OpenAI's arguments are nullable (``"temperature": null`` asks for the default), and some clients
    send every argument they have, null where unset."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}
        return data


class _Body(_Strict):
    # An argument qkv does not know is refused, as OpenAI refuses one (an option dropped without a word
    # would change the answer without a word). Each field below is honoured, or changes nothing here,
    # or is one of OpenAI's that qkv does not implement: accepted only at the value that asks for
    # nothing, refused otherwise (:data:`_UNSUPPORTED`).

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # temperature, top_p, top_k, min_p and repetition_penalty: None (not given) is the model's recommendation
    # where its files make one (:attr:`CausalLM.sampling_defaults`, as vLLM and llama-server take them), else OpenAI's
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    # beyond OpenAI's arguments, as vLLM and llama-server name them: qkv generate's options of the same names
    top_k: int | None = Field(default=None, ge=1)
    min_p: float | None = Field(default=None, gt=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=1 / MAX_PENALTY, le=MAX_PENALTY)  # (float32 logits break past it)
    # OpenAI's penalties and bias, as qkv generate's options of the same names (0 and none by default)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY)
    presence_penalty: float = Field(default=0.0, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY)
    logit_bias: dict | None = None  # {"token id": bias}: JSON's keys are strings
    response_format: dict | None = None  # text, json_object or json_schema (_response_format)
    # OpenAI's, changing nothing here
    user: str | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or several (OpenAI's batch: n choices each)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


#: The roles a chat message may have here ("developer" is given to the template as "system"; a tool's are refused).
_ROLES = ("system", "developer", "user", "assistant")


class _Part(BaseModel):
    type: str
    text: str | None = None


class _Message(_Strict):
    role: str
    content: str | list[_Part] | None = None
    name: str | None = None  # given to the chat template with the message (a template may show it)
    # what the openai client echoes back of an assistant's message, and a tool's answer: tool calls are not
    # implemented (_UNSUPPORTED), so these are accepted empty only
    tool_calls: list | None = None
    function_call: dict | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: dict | None = None
    annotations: list | None = None


class ChatBody(_Body):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    # OpenAI's, changing nothing here
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # qkv shares every prompt's cached pages with whoever asks: no key needed
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    parallel_tool_calls: bool | None = None  # (about tools, which are refused)
    # OpenAI's, not implemented (_UNSUPPORTED)
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: list | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    moderation: object = None


class EmbeddingBody(_Strict):
    model: str | None = None
    input: str | list[str]
    encoding_format: str = "float"
    dimensions: int | None = None  # the model's own only: a vector is not cut
    user: str | None = None


#: OpenAI's arguments that qkv does not implement, each with the values that ask for nothing (what
#: clients send by default): any other value gets a 400 naming the argument, never an answer that
#: quietly ignored it. Messages' fields are checked the same way (``messages``).
_UNSUPPORTED = {
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "moderation": (None,),
    "tool_calls": (None, []),
    "tool_call_id": (None,),
    "refusal": (None,),
    "annotations": (None, []),
}


def _refuse_unsupported(body: BaseModel, where: str = "") -> None:
    fields = type(body).model_fields
    for name in (n for n in _UNSUPPORTED if n in fields):  # in the table's order: the same one named every time
        value = getattr(body, name)
        if value not in _UNSUPPORTED[name]:
            raise APIError(400, f"{where}{name} is not supported by qkv serve (got {json.dumps(value)[:80]}); leave it out", param=f"{where}{name}")


def _param(err: ValidationError) -> tuple[str, str]:
    e = err.errors()[0]
    loc = ".".join(str(x) for x in e["loc"] if not str(x).startswith(("function-", "list[", "str", "int")))
    if e["type"] == "extra_forbidden":  # OpenAI's own answer to an argument it does not know
        return loc, f"unrecognized request argument supplied: {loc} (qkv serve refuses what it does not implement rather than ignore it)"
    return loc or None, f"{loc or 'body'}: {e['msg']}"


async def _read_json(request: HTTPRequest, limits: Limits, model):
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
        raise APIError(413, f"the request body is {int(size):,} bytes; the limit is {limits.max_body_bytes:,}", code="body_too_large")
    chunks = []

    async def read():
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limits.max_body_bytes:
                raise APIError(413, f"the request body is over the limit of {limits.max_body_bytes:,} bytes", code="body_too_large")
            chunks.append(chunk)

    try:  # a body trickling in (or never coming) would hold its connection for as long as its client liked
        await asyncio.wait_for(read(), limits.read_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.read_timeout_s:g} s", code="request_timeout") from None
    try:
        data = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # "[[[[..." a few thousand deep: the parser's recursion limit, the client's fault
        raise APIError(400, "the body's JSON is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body should be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        param, msg = _param(exc)
        raise APIError(400, msg, param=param) from None


# ------------------------------------------------------------ the app


class _Mailbox:
    """Events from the engine thread to the event loop, delivered once a step, all together.

    Posted one by one (``call_soon_threadsafe`` an event), each event woke the loop, which then held
    the GIL while the engine thread wanted it back to go on with its step: a server's steps of 8
    requests spent 2.5-2.8 ms outside the model against 1.4-1.6 in one process without HTTP."""

    def __init__(self, loop):
        self.loop = loop
        self.items: list = []  # put and flushed by the engine thread alone: no lock

    def put(self, queue, item) -> None:  # the engine thread, during a step
        self.items.append((queue, item))

    def flush(self) -> None:  # the engine thread, after each step (Scheduler.after_step)
        items, self.items = self.items, []
        if items:
            try:
                self.loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass


def _deliver(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)


async def _after(first, gen):
    """``first``, then the rest of ``gen`` (its first event was awaited before the response began)."""
    yield first
    async for event in gen:
        yield event


class _Server:
    def __init__(self, scheduler, lm, model_name: str, limits: Limits, api_key: str | None, embedder, embedding_name: str | None, sampling_defaults: dict):
        self.scheduler, self.lm, self.model_name, self.limits, self.api_key = scheduler, lm, model_name, limits, api_key
        self.sampling_defaults = sampling_defaults  # what a request that sets none of them gets
        self._embedder, self.embedding_name = embedder, embedding_name
        self.created = int(time.time())
        self._mailbox: _Mailbox | None = None
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self.registry.register(_Figures(scheduler))

    def _mailbox_for(self, loop) -> _Mailbox:
        if self._mailbox is None or self._mailbox.loop is not loop:  # one loop for a server's life, as a rule
            self._mailbox = _Mailbox(loop)
            self.scheduler.after_step.append(self._mailbox.flush)
        return self._mailbox

    def check_key(self, request: HTTPRequest) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key", kind="authentication_error")

    # -------------------------------------------------------- generation
    def _check_model(self, name: str | None, kind: str = "text") -> None:
        want = self.model_name if kind == "text" else self.embedding_name
        if name is not None and name != want:
            raise APIError(404, f"model {name!r} is not served here; {kind} model: {want!r}", param="model", code="model_not_found", kind="not_found_error")

    def _sampling(self, body) -> dict:
        _refuse_unsupported(body)
        if body.n > self.limits.max_n:
            raise APIError(400, f"n should be at most {self.limits.max_n}, got {body.n}", param="n")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not x for x in stop):
            raise APIError(400, "stop should be up to 4 non-empty strings", param="stop")
        out = {key: self.sampling_defaults[key] if getattr(body, key) is None else getattr(body, key) for key in OPENAI_SAMPLING}
        out["top_p"] = None if out["top_p"] is None or out["top_p"] >= 1 else out["top_p"]
        return {**out, "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty, "logit_bias": self._logit_bias(body.logit_bias), "stop": tuple(stop)}

    async def _response_format(self, given: dict | None):
        """OpenAI's ``response_format``: None for text, else the :class:`~..engines.structured.JsonSchema` the answer
        follows (``json_object``: any JSON object). Compiled off the event loop: the model's first schema builds
        llguidance's vocabulary (2 to 4 s for Gemma 3's)."""
        if given is None or given == {"type": "text"}:
            return None
        kind = given.get("type")
        if kind == "json_object" and set(given) == {"type"}:
            schema = {"type": "object"}
        elif kind == "json_schema" and set(given) == {"type", "json_schema"} and isinstance(given["json_schema"], dict):
            spec = given["json_schema"]
            unknown = set(spec) - {"name", "schema", "strict", "description"}
            if unknown:
                raise APIError(400, f"response_format.json_schema: unknown fields {sorted(unknown)} (it takes name, schema, strict and description)", param="response_format")
            if not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(400, "response_format.json_schema should have a string name and a schema object", param="response_format")
            schema = spec.get("schema", {})  # OpenAI's default: no constraint beyond JSON
        else:
            raise APIError(400, 'response_format should be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, '
                                f"got {json.dumps(given)[:120]}", param="response_format")  # fmt: skip
        from ..engines.structured import JsonSchema

        try:
            return await asyncio.to_thread(JsonSchema, self.lm, schema)
        except (TypeError, ValueError) as exc:
            raise APIError(400, f"response_format: {exc}", param="response_format") from None
        except ImportError as exc:
            raise APIError(400, f"response_format: this server cannot follow a JSON schema ({exc})", param="response_format") from None

    def _logit_bias(self, given: dict | None):
        """OpenAI's ``logit_bias`` (``{"token id": bias}``) as :func:`~..engines.sampling.check_logit_bias` gives it."""
        if given is None:
            return None
        ids = {}
        for key, bias in given.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12 and str(int(key)) == key):  # "05" and "5" would be one token
                raise APIError(400, f"logit_bias: a key should be a token id in decimal digits (no leading zero), got {key[:40]!r}", param="logit_bias")
            ids[int(key)] = bias
        try:
            return check_logit_bias(ids, self.lm.config.vocab_size)
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc), param="logit_bias") from None

    def _max_tokens(self, asked: int | None, prompt_len: int, default: int) -> int:
        lim = self.limits
        if asked is not None and asked > lim.max_tokens:
            raise APIError(400, f"max_tokens should be at most {lim.max_tokens}, got {asked}", param="max_tokens")
        if prompt_len >= lim.max_context:
            raise APIError(400, f"the prompt is {prompt_len} tokens; this server's context is {lim.max_context} tokens (prompt + max_tokens)", param="messages", code="context_length_exceeded")
        room = lim.max_context - prompt_len
        if asked is None:
            return min(default, room)
        if asked > room:
            raise APIError(400, f"the prompt ({prompt_len} tokens) and max_tokens ({asked}) exceed this server's context of {lim.max_context} tokens", param="max_tokens", code="context_length_exceeded")
        return asked

    async def _run(self, request: HTTPRequest, prompts: list, n: int, max_tokens: int, sampling: dict, seed, top_logprobs, schema):
        """Submit ``n`` choices of each prompt (choice ``p * n + j``: OpenAI's order); yield (choice index, kind,
        payload) as the engine sends them; cancel on exit."""
        if len(prompts) * n > self.scheduler.max_waiting:  # never queued whole: a 429 would be retried for ever
            raise APIError(400, f"{len(prompts)} prompt(s) x n {n} = {len(prompts) * n} completions; this server queues at most {self.scheduler.max_waiting} a request", param="n")
        mailbox = self._mailbox_for(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()
        deadline = time.monotonic() + self.limits.timeout_s
        reqs = []

        def emitter(i):
            def emit(kind, payload):
                mailbox.put(queue, (i, kind, payload))

            return emit

        matchers = [None if schema is None else schema.matcher() for _ in range(len(prompts) * n)]  # each choice its own place in the grammar
        for i in range(len(prompts) * n):
            r = Request(prompt=list(prompts[i // n]), max_tokens=max_tokens, emit=emitter(i), seed=None if seed is None else seed + i, top_logprobs=top_logprobs, deadline=deadline,
                        matcher=matchers[i], **sampling)  # fmt: skip
            try:
                queued = self.scheduler.submit(r)
            except Closed:
                queued = None
            if not queued:  # the choices already queued go back: none of them is answered
                for q in reqs:
                    q.cancel()
                if queued is None:
                    raise APIError(503, "the server is shutting down", code="shutting_down", kind="server_error")
                raise APIError(429, f"the server is busy: {self.scheduler.max_waiting} requests are waiting; try again shortly", code="queue_full", kind="rate_limit_error", headers={"Retry-After": "1"})
            reqs.append(r)
        open_ = set(range(len(prompts) * n))
        checked = time.monotonic()
        try:
            while open_:
                try:
                    i, kind, payload = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    i = kind = payload = None
                if time.monotonic() - checked > 0.5:  # a client gone (waiting for a whole answer too): stop its work
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if kind is None:
                    continue
                if kind != "token":
                    open_.discard(i)
                yield i, kind, payload
        finally:
            for r in reqs:
                r.cancel()  # a no-op for finished ones; a client gone or an error: free the pages now

    def _token_text(self, tok: int) -> str:
        return self.lm.tokenizer.decode([tok])

    def _chat_logprob(self, info) -> dict:
        text = self._token_text(info["token"])
        entry = {"token": text, "logprob": info["logprob"], "bytes": list(text.encode("utf-8"))}
        entry["top_logprobs"] = [{"token": (t := self._token_text(tok)), "logprob": lp, "bytes": list(t.encode("utf-8"))} for tok, lp in info.get("top", [])]
        return entry

    def _usage(self, dones: dict, per_prompt: int) -> dict:
        """Choices ``p * per_prompt + j`` share prompt ``p``: its tokens count once, and its cached ones as its best choice's."""
        groups = {}
        for i, d in dones.items():
            groups.setdefault(i // per_prompt, []).append(d)
        prompt = sum(g[0]["prompt_tokens"] for g in groups.values())
        completion = sum(d["completion_tokens"] for d in dones.values())
        cached = sum(max(d["cached_tokens"] for d in g) for g in groups.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    async def completions(self, request: HTTPRequest) -> Response:
        body = await _read_json(request, self.limits, CompletionBody)
        self._check_model(body.model)
        if body.logprobs is not None and body.logprobs > 5:
            raise APIError(400, f"logprobs should be at most 5, got {body.logprobs}", param="logprobs")
        sampling = self._sampling(body)
        several = isinstance(body.prompt, list) and bool(body.prompt) and isinstance(body.prompt[0], (str, list))
        given = body.prompt if several else [body.prompt]
        if len(given) > self.limits.max_prompts:
            raise APIError(400, f"prompt: at most {self.limits.max_prompts} prompts a request, got {len(given)}", param="prompt")
        prompts = []
        for i, p in enumerate(given):
            try:
                prompts.append(self.lm._prompt_ids(p, f"prompt[{i}]" if several else "prompt"))
            except (TypeError, ValueError) as exc:
                raise APIError(400, str(exc), param="prompt") from None
        max_tokens = self._max_tokens(body.max_tokens, max(map(len, prompts)), 16)
        schema = await self._response_format(body.response_format)
        return await self._respond(request, "text_completion", body, prompts, max_tokens, sampling, body.logprobs, schema)

    async def chat(self, request: HTTPRequest) -> Response:
        body = await _read_json(request, self.limits, ChatBody)
        self._check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if (body.top_logprobs or 0) > self.limits.max_top_logprobs:
            raise APIError(400, f"top_logprobs should be at most {self.limits.max_top_logprobs}, got {body.top_logprobs}", param="top_logprobs")
        sampling = self._sampling(body)
        messages = []
        for i, m in enumerate(body.messages):
            _refuse_unsupported(m, f"messages[{i}].")
            if m.role in ("tool", "function"):
                raise APIError(400, f"messages[{i}].role {m.role!r}: a tool's answer needs tool calls, which qkv serve does not implement", param=f"messages[{i}].role")
            if m.role not in _ROLES:
                raise APIError(400, f"messages[{i}].role should be one of {', '.join(map(repr, _ROLES))}, got {m.role!r}", param=f"messages[{i}].role")
            content = m.content
            if content is None and m.role != "assistant":  # (an assistant's reply echoed back may carry none)
                raise APIError(400, f"messages[{i}].content: a {m.role} message needs content, got null", param=f"messages[{i}].content")
            if isinstance(content, list):
                if any(p.type != "text" or p.text is None for p in content):
                    raise APIError(400, "only text content parts are supported", param="messages")
                content = "".join(p.text for p in content)
            # "developer" is OpenAI's newer name for the system message: templates know "system" (llama.cpp maps it too)
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": content or "", **({} if m.name is None else {"name": m.name})})
        if self.lm.chat_template is None:
            raise APIError(400, f"{self.model_name} has no chat template ({self.lm.no_chat_template}): use /v1/completions", param="messages")
        try:
            text = self.lm.apply_chat_template(messages)
        except Exception as exc:  # a template's own error (raise_exception), or the sandbox refusing: the client's messages
            raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None
        prompt = self.lm.tokenizer.encode(text, add_bos=False)
        if body.max_tokens is not None and body.max_completion_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise APIError(400, f"max_tokens ({body.max_tokens}) and max_completion_tokens ({body.max_completion_tokens}) disagree: give one", param="max_completion_tokens")
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self._max_tokens(asked, len(prompt), self.limits.max_tokens)
        top = (body.top_logprobs or 0) if body.logprobs else None
        schema = await self._response_format(body.response_format)
        return await self._respond(request, "chat.completion", body, [prompt], max_tokens, sampling, top, schema)

    async def _respond(self, request, kind, body, prompts, max_tokens, sampling, top, schema) -> Response:
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        gen = self._run(request, prompts, body.n, max_tokens, sampling, body.seed, top, schema)
        n = len(prompts) * body.n  # choices
        first = await gen.__anext__()  # a 429 is raised here, before any byte of the response
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._sse(rid, kind, gen, first, n, body.n, include_usage), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        pieces, logprobs, finish, dones = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n, {}
        async for i, ev, payload in _after(first, gen):
            if ev == "token":
                pieces[i].append(payload["text"])  # joined once at the end (adding to a string copies it each time)
                if payload.get("token") is not None and "logprob" in payload:
                    logprobs[i].append(payload)
            elif ev == "done":
                finish[i], dones[i] = payload["finish_reason"], payload
            else:
                await gen.aclose()
                status = payload.get("status", 500)
                return error_response(status, payload["message"], code=_ERROR_CODES.get(status), kind=_ERROR_KINDS.get(status, "server_error"), headers={"Retry-After": "1"} if status == 503 else None)
        created = int(time.time())
        texts = ["".join(p) for p in pieces]
        if kind == "chat.completion":
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": {"content": [self._chat_logprob(x) for x in logprobs[i]]} if top is not None else None, "finish_reason": finish[i]} for i in range(n)]
        else:
            choices = [{"index": i, "text": texts[i], "logprobs": self._completion_logprobs(logprobs[i]) if top is not None else None, "finish_reason": finish[i]} for i in range(n)]
        return JSONResponse({"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": choices, "usage": self._usage(dones, body.n)})

    def _completion_logprobs(self, entries) -> dict:
        tokens = [self._token_text(e["token"]) for e in entries]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries], "top_logprobs": [{self._token_text(t): lp for t, lp in e.get("top", [])} for e in entries], "text_offset": offsets}

    async def _sse(self, rid, kind, gen, first, n, per_prompt, include_usage):
        created = int(time.time())
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        dones = {}

        def chunk(choices, usage=None):
            out = {"id": rid, "object": chunk_kind, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n"

        try:
            if kind == "chat.completion":
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in range(n)])
            async for i, ev, payload in _after(first, gen):
                if ev == "token":
                    lp = None
                    if payload.get("token") is not None and "logprob" in payload:
                        lp = {"content": [self._chat_logprob(payload)]} if kind == "chat.completion" else self._completion_logprobs([payload])
                    if not payload["text"] and lp is None:
                        continue
                    if kind == "chat.completion":
                        yield chunk([{"index": i, "delta": {"content": payload["text"]}, "logprobs": lp, "finish_reason": None}])
                    else:
                        yield chunk([{"index": i, "text": payload["text"], "logprobs": lp, "finish_reason": None}])
                elif ev == "done":
                    dones[i] = payload
                    if kind == "chat.completion":
                        yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": payload["finish_reason"]}])
                    else:
                        yield chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": payload["finish_reason"]}])
                else:
                    yield f"data: {json.dumps({'error': {'message': payload['message'], 'type': _ERROR_KINDS.get(payload.get('status'), 'server_error'), 'param': None, 'code': _ERROR_CODES.get(payload.get('status'))}})}\n\n"
                    return
            if include_usage:
                yield chunk([], self._usage(dones, per_prompt))
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()  # a client gone mid-stream: its requests are cancelled, their pages freed

    # -------------------------------------------------------- the rest
    async def embeddings(self, request: HTTPRequest) -> Response:
        body = await _read_json(request, self.limits, EmbeddingBody)
        if self.embedding_name is None:
            raise APIError(404, "no embedding model is served (start qkv serve with --embedding-model)", param="model", code="model_not_found", kind="not_found_error")
        self._check_model(body.model, "embedding")
        if body.encoding_format not in ("float", "base64"):
            raise APIError(400, f"encoding_format should be 'float' or 'base64', got {body.encoding_format!r}", param="encoding_format")
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts or len(texts) > self.limits.max_embedding_inputs:
            raise APIError(400, f"input should be 1 to {self.limits.max_embedding_inputs} strings, got {len(texts)}", param="input")
        enc = await asyncio.to_thread(self._embedder)
        size = enc.model.config.hidden_size
        if body.dimensions is not None and body.dimensions != size:
            raise APIError(400, f"dimensions should be {size} (the model's own: vectors are not cut), got {body.dimensions}", param="dimensions")
        # A text past the model's length would be embedded by its beginning alone (the library warns and cuts it,
        # as sentence-transformers does): a client would get another text's vector without a word. OpenAI refuses.
        encodings = await asyncio.to_thread(enc.tokenizer.encode_batch, texts)
        long = next((i for i, e in enumerate(encodings) if e.overflowing), None)
        if long is not None:
            raise APIError(400, f"input[{long}] is longer than the {enc.max_seq_length} tokens {self.embedding_name} reads; split it", param="input", code="context_length_exceeded")
        try:
            vectors = await asyncio.to_thread(enc.encode, texts)
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc), param="input") from None
        tokens = sum(sum(e.attention_mask) for e in encodings)  # the padding of a batch not counted
        if body.encoding_format == "base64":  # what the openai client asks for: little-endian float32, as OpenAI sends it
            data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(np.asarray(v, "<f4").tobytes()).decode()} for i, v in enumerate(vectors)]
        else:
            data = [{"object": "embedding", "index": i, "embedding": [float(x) for x in v]} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": self.embedding_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _model_list(self) -> list:
        names = [self.model_name] + ([self.embedding_name] if self.embedding_name is not None else [])
        return [{"id": name, "object": "model", "created": self.created, "owned_by": "qkv"} for name in names]

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": self._model_list()})

    async def model(self, request: HTTPRequest) -> Response:  # GET /v1/models/{model}: the openai client's models.retrieve
        name = request.path_params["model"]
        for m in self._model_list():
            if m["id"] == name:
                return JSONResponse(m)
        raise APIError(404, f"the model {name!r} does not exist: this server has {[m['id'] for m in self._model_list()]}", param="model", code="model_not_found")

    async def health(self, request: HTTPRequest) -> Response:
        if self.scheduler.failed is not None:
            return JSONResponse({"status": "degraded", "detail": "the engine failed on a step (see the server's log)"})
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: HTTPRequest) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _Figures:
    """The scheduler's figures as Prometheus metrics, read when scraped (prometheus_client's custom collector)."""

    def __init__(self, scheduler):
        self.s = scheduler

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.s
        gauges = (
            ("qkv_requests_running", "Requests being generated", len(s.running)),
            ("qkv_requests_waiting", "Requests queued for admission", len(s.waiting)),
            ("qkv_kv_pages_in_use", "Key/value pages held by running requests", s.pool.pages_in_use),
            ("qkv_kv_pages_cached", "Published pages nobody holds (the prefix cache)", s.pool.cached_pages),
            ("qkv_kv_pages_total", "Pages in the pool", s.pool.num_pages),
            ("qkv_generation_tokens_per_second", "Generated tokens a second over the last 10 s", s.tokens_per_s()),
            ("qkv_time_to_first_token_seconds", "Mean time to first token over the last 1,000 requests", sum(s.ttft) / len(s.ttft) if s.ttft else 0.0),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = (
            ("qkv_generation_tokens", "Tokens generated", s.generated_tokens),
            ("qkv_prompt_tokens", "Prompt tokens admitted", s.prompt_tokens),
            ("qkv_prompt_tokens_cached", "Prompt tokens read from shared pages", s.cached_prompt_tokens),
            ("qkv_preemptions", "Requests preempted for want of pages (recomputed later)", s.preempted),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class _Guard:
    """ASGI middleware: the API key on every request, OpenAI-shaped errors, never a traceback to a client."""

    def __init__(self, app, server: _Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            self.server.check_key(HTTPRequest(scope))
            await self.app(scope, receive, tracked)
        except APIError as e:
            if not started:
                await error_response(e.status, e.message, param=e.param, code=e.code, kind=e.kind, headers=e.headers)(scope, receive, send)
        except ClientDisconnect:  # gone before its body was read: no one to answer, nothing wrong here
            log.debug("client gone during %s %s", scope.get("method"), scope.get("path"))
        except Exception:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await error_response(500, "internal server error", kind="server_error")(scope, receive, send)


_ORIGIN = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")


def check_origins(origins) -> tuple:
    """The web origins allowed to call the server from a page (CORS), checked: ``"*"`` (any page) or each
    ``scheme://host[:port]`` exactly as a browser sends it (no path, no trailing slash: such an entry
    would never match, and no page could call)."""
    if isinstance(origins, str):
        raise TypeError(f"allow_origins should be a list of origins, got the string {origins!r}")
    out = tuple(origins)
    for o in out:
        if not isinstance(o, str) or not (o == "*" or _ORIGIN.fullmatch(o)):
            raise ValueError(f"an allowed origin should be '*' or scheme://host[:port] as a browser sends it (like http://localhost:3000: no path, no trailing slash), got {o!r}")
    return out


def check_sampling_defaults(lm, sampling_defaults: dict | None) -> dict:
    """The sampling of a request that sets none, checked as generate checks each option: ``sampling_defaults``
    (None: ``lm``'s recommendation) over OpenAI's defaults."""
    given = lm.sampling_defaults.values if sampling_defaults is None else sampling_defaults
    unknown = set(given) - set(OPENAI_SAMPLING)
    if unknown:
        raise ValueError(f"sampling_defaults should set only {sorted(OPENAI_SAMPLING)}, got {sorted(unknown)}")
    d = {**OPENAI_SAMPLING, **given}
    check_sampling(0, d["temperature"], d["top_k"], d["top_p"])
    check_penalty(d["repetition_penalty"], d["min_p"])
    return d


def create_app(scheduler, lm, *, model_name: str, limits: Limits = Limits(), api_key: str | None = None, embedder=None, embedding_name: str | None = None, allow_origins=(),
               sampling_defaults: dict | None = None) -> Starlette:  # fmt: skip
    """The ASGI app of ``qkv serve`` over a started :class:`~.scheduler.Scheduler`.

    ``sampling_defaults``: the sampling of a request that does not set it (``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``repetition_penalty``); None: the model's recommendation
    (``lm.sampling_defaults.values``), and OpenAI's defaults (temperature 1, no top-p) for the rest.

    ``embedder``: a callable returning the sentence encoder (called at the first embeddings request).
    ``allow_origins``: web origins whose pages may call the server (:func:`check_origins`); none by default,
    so a page the user happens to open cannot use a server on their machine.
    """
    origins = check_origins(allow_origins)
    server = _Server(scheduler, lm, model_name, limits, api_key, embedder, embedding_name, check_sampling_defaults(lm, sampling_defaults))

    async def not_found(request, exc):
        return error_response(404, f"no route {request.method} {request.url.path}", code="not_found", kind="not_found_error")

    async def bad_method(request, exc):
        return error_response(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")

    routes = [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/embeddings", server.embeddings, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ]
    middleware = [Middleware(_Guard, server=server)]
    if origins:  # outermost: a browser's preflight (OPTIONS, no key) is answered here, and errors carry the headers too
        from starlette.middleware.cors import CORSMiddleware

        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"], max_age=600))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={404: not_found, 405: bad_method})
    app.state.server = server
    return app


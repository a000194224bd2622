"""``qkv serve`` as users run it: a real server process, the official openai client, raw HTTP for the rest."""

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")  # the test extra installs it: CI runs these

KEY = "test-key-123"
PREFIX = " ".join(f"Item {i}: the {['red', 'green', 'blue', 'old', 'new'][i % 5]} house number {i * 7}." for i in range(60))  # about 600 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args):
        self.port = free_port()
        env = {**os.environ, "QKV_NUM_THREADS": "2"}
        self.proc = subprocess.Popen([sys.executable, "-m", "qkv", "serve", "--port", str(self.port), "--log-level", "warning", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log = []
        self.reader = threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("qkv serve exited:\n" + "".join(self.log))
            try:
                if self.get("/health")[0] in (200, 401):
                    return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("qkv serve did not start:\n" + "".join(self.log))

    def request(self, method, path, body=None, *, key=KEY, headers=None, raw=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
        try:  # closed on errors too (a server still starting): an unclosed socket warns later, in another test
            c.request(method, path, body=raw if raw is not None else (None if body is None else json.dumps(body)), headers=h)
            r = c.getresponse()
            data = r.read()
        finally:
            c.close()
        try:
            return r.status, json.loads(data), dict(r.getheaders())
        except ValueError:
            return r.status, data.decode(), dict(r.getheaders())

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def metric(self, name) -> float:
        text = self.get("/metrics")[1]
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY, max_retries=0, timeout=300)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=10)
        self.proc.stdout.close()


PAGE_PORT = free_port()  # a web page's server (test_a_page_...): the origin the server lets call it
PAGE_ORIGIN = f"http://127.0.0.1:{PAGE_PORT}"


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--max-batch", "8", "--kv-tokens", "8192", "--context", "2048", "--max-tokens", "256", "--allow-origin", PAGE_ORIGIN)
    yield s
    s.stop()


def qkv_cli(*args):
    r = subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_greedy_completion_and_chat_equal_qkv_generate(server):
    c = server.client()
    prompt = "The capital of France is"
    ref = json.loads(qkv_cli("generate", prompt, "--max-new-tokens", "16", "--json"))
    got = c.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == ref["text"] and got.usage.completion_tokens == len(ref["token_ids"])
    assert got.usage.prompt_tokens == len(ref["prompt_ids"])
    question = "Name three colours."
    ref = json.loads(qkv_cli("generate", question, "--chat", "--max-new-tokens", "16", "--json"))
    got = c.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0)
    assert got.choices[0].message.content == ref["text"] and got.usage.completion_tokens == len(ref["token_ids"])
    assert got.choices[0].finish_reason == {"length": "length", "eos": "stop", "stop": "stop"}[ref["stop_reason"]]


def test_streaming_equals_not_streaming(server):
    c = server.client()
    kw = dict(model="gemma3-270m", messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=24, temperature=0, logprobs=True, top_logprobs=3)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    lps = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert text == whole.choices[0].message.content
    assert [(x.token, x.logprob, [t.logprob for t in x.top_logprobs]) for x in lps] == [(x.token, x.logprob, [t.logprob for t in x.top_logprobs]) for x in whole.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    s = c.completions.create(model="gemma3-270m", prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=7, stream=True)
    assert "".join(ch.choices[0].text for ch in s) == c.completions.create(model="gemma3-270m", prompt="Once upon a time", max_tokens=20, temperature=0.8, seed=7).choices[0].text


def _ask(c, i, n_tokens):
    r = c.completions.create(model="gemma3-270m", prompt=f"Story {i}: " + "once " * (i * 3) + "there was", max_tokens=n_tokens, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    return r.choices[0].text, lp.token_logprobs, lp.top_logprobs


def test_concurrent_requests_each_equal_the_same_request_alone_bit_for_bit(server):
    c = server.client()
    lengths = [12, 5, 20, 9, 16, 3, 14, 7]  # different prompts, different lengths: they join and leave the batch
    alone = [_ask(c, i, n) for i, n in enumerate(lengths)]
    together = [None] * 8
    threads = [threading.Thread(target=lambda i=i, n=n: together.__setitem__(i, _ask(c, i, n))) for i, n in enumerate(lengths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone, together):
        assert a == b  # the text, every token's log-probability and its top 2, as floats: the same bits
    assert server.metric("qkv_kv_pages_in_use") == 0


def test_a_shared_prefix_is_computed_once(server):
    c = server.client()

    def ttft(question):
        t0 = time.perf_counter()
        stream = c.chat.completions.create(model="gemma3-270m", messages=[{"role": "system", "content": PREFIX}, {"role": "user", "content": question}], max_tokens=3, temperature=0,
                                           stream=True, stream_options={"include_usage": True})  # fmt: skip
        first = None
        for ch in stream:
            if first is None and ch.choices and ch.choices[0].delta.content:
                first = time.perf_counter() - t0
            usage = ch.usage
        return first, usage

    t1, u1 = ttft("What colour is house 7?")
    t2, u2 = ttft("What colour is house 14?")
    assert u1.prompt_tokens > 550
    assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens - 32  # all but the last page or two
    assert t2 < t1


BAD = [
    ("POST", "/v1/chat/completions", b"{not json", 400, None),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("POST", "/v1/chat/completions", b"[" * 100_000, 400, None),  # nested past the parser's recursion limit
    ("POST", "/v1/chat/completions", {"model": "gemma3-270m"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 99}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("POST", "/v1/completions", {"prompt": "word " * 3000, "max_tokens": 10}, 400, "messages"),
    ("POST", "/v1/completions", {"prompt": [-5, 3]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("POST", "/v1/completions", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', 413, None),
    ("POST", "/v1/embeddings", {"input": []}, 400, "input"),
    # an option qkv does not implement is refused where it would change the answer, never ignored
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tools"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400, "response_format"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}, 400, "response_format"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400, "response_format"),  # OpenAI's name is required
    ("POST", "/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object", "schema": {}}}, 400, "response_format"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}, 400, "reasoning_effort"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}]}, 400, "messages[0].tool_calls"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temprature": 0}, 400, "temprature"),  # a typo: not a default quietly used
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": 0}, 400, "top_k"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 9}, 400, "max_completion_tokens"),
    ("POST", "/v1/chat/completions", {"messages": None}, 400, "messages"),  # null is a default, and messages have none
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "unheard_of": None}, 400, "unheard_of"),
    ("POST", "/v1/completions", {"prompt": "hi", "suffix": " the end."}, 400, "suffix"),
    ("POST", "/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 5}}, 400, "logit_bias"),  # never wraps to the last token
    ("POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"262144": 5}}, 400, "logit_bias"),  # Gemma's vocabulary ends at 262,143
    ("POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"the": 5}}, 400, "logit_bias"),
    ("POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1, "05": 2}}, 400, "logit_bias"),  # one token twice
    ("POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": "x"}}, 400, "logit_bias"),
    ("POST", "/v1/completions", {"prompt": "hi", "repetition_penalty": float("inf")}, 400, "repetition_penalty"),
    ("POST", "/v1/embeddings", {"input": "hi", "dimensions": 64}, 400, "dimensions"),
    ("POST", "/v1/embeddings", {"input": ["short", "word " * 400]}, 400, "input"),  # past MiniLM's 256 tokens: not embedded by its beginning
    ("POST", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, 400, "messages[0].role"),  # tools are not implemented
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}]}, 400, "messages[1].role"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),  # not a prompt of ""
    ("GET", "/v1/nothing", None, 404, None),
    ("GET", "/v1/chat/completions", None, 405, None),
]


@pytest.mark.parametrize("method,path,body,status,param", BAD, ids=[f"{i}-{b[1]}-{b[3]}" for i, b in enumerate(BAD)])
def test_every_bad_request_gets_its_status_and_an_openai_error(server, method, path, body, status, param):
    got, data, _ = server.request(method, path, None if isinstance(body, bytes) else body, raw=body if isinstance(body, bytes) else None)
    assert got == status, data
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"} and data["error"]["message"]
    assert "Traceback" not in data["error"]["message"]
    if param is not None:
        assert data["error"]["param"] == param
    ok = server.request("POST", "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0})
    assert ok[0] == 200 and ok[1]["choices"][0]["text"]


def test_several_prompts_in_one_completion_request_each_answer_as_alone(server):
    """OpenAI's batch: a list of prompts (text or token ids), n choices each, in order p * n + j; each the same
    bits as its prompt asked alone (logprobs too), the usage their sum."""
    c = server.client()
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    alone = [c.completions.create(model="gemma3-270m", prompt=p, max_tokens=5, temperature=0, logprobs=2) for p in prompts]
    both = c.completions.create(model="gemma3-270m", prompt=prompts, max_tokens=5, temperature=0, logprobs=2)
    assert [ch.index for ch in both.choices] == [0, 1, 2]
    for ch, one in zip(both.choices, alone):
        assert ch.text == one.choices[0].text and ch.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and both.usage.completion_tokens == 15
    sampled = c.completions.create(model="gemma3-270m", prompt=prompts[:2], n=2, max_tokens=6, temperature=1.0, seed=5)
    for i, ch in enumerate(sampled.choices):  # choice p * n + j samples with seed + its index, as n alone does
        one = c.completions.create(model="gemma3-270m", prompt=prompts[i // 2], max_tokens=6, temperature=1.0, seed=5 + i)
        assert ch.index == i and ch.text == one.choices[0].text
    status, data, _ = server.request("POST", "/v1/completions", {"prompt": [[2, 651, 6037], [2, 818]], "max_tokens": 3, "temperature": 0})
    assert status == 200 and len(data["choices"]) == 2 and data["usage"]["prompt_tokens"] == 5
    for body, param, says in (
        ({"prompt": ["a"] * 17}, "prompt", "at most 16 prompts"),
        ({"prompt": [[2, 651], []]}, "prompt", "prompt[1] is empty"),  # (the text "" is a prompt: its BOS)
        ({"prompt": ["a"] * 9, "n": 8}, "n", "queues at most 64"),
        ({"prompt": ["a", [5, 6]]}, "prompt", None),  # text and ids mixed: one or the other
    ):
        status, data, _ = server.request("POST", "/v1/completions", body)
        assert status == 400 and data["error"]["param"] == param and (says is None or says in data["error"]["message"]), data


def test_a_developer_message_is_the_system_message(server):
    """OpenAI's newer clients send a "developer" message where older ones sent "system": the template gets "system"."""
    c = server.client()
    answers = [c.chat.completions.create(model="gemma3-270m", messages=[{"role": role, "content": "Answer in one word."}, {"role": "user", "content": "What colour is the sky?"}], max_tokens=6, temperature=0) for role in ("developer", "system")]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens


def test_options_that_ask_for_nothing_change_nothing_and_sampling_options_are_generates(server):
    c = server.client()
    messages = [{"role": "user", "content": "Name three colours."}]
    plain = c.chat.completions.create(model="gemma3-270m", messages=messages, max_tokens=12, temperature=0)
    # what clients send by default, and a reply appended as the openai client returns it (its empty refusal,
    # tool calls, audio...): accepted, and the answer is the plain one
    same = c.chat.completions.create(model="gemma3-270m", messages=messages, max_tokens=12, temperature=0, user="u1", metadata={"k": "v"}, store=False, frequency_penalty=0,
                                     presence_penalty=0, logit_bias={}, tool_choice="none", response_format={"type": "text"}, parallel_tool_calls=True, prompt_cache_key="p")  # fmt: skip
    assert same.choices[0].message.content == plain.choices[0].message.content
    again = c.chat.completions.create(model="gemma3-270m", messages=[*messages, plain.choices[0].message, {"role": "user", "content": "And three more."}], max_tokens=4, temperature=0)
    assert again.choices[0].message.content
    # OpenAI's arguments are nullable: null is the default (clients that send every argument, null where unset)
    nulls = {k: None for k in ("n", "top_p", "stream", "stop", "seed", "logprobs", "top_logprobs", "user", "frequency_penalty", "tools", "response_format", "repetition_penalty", "top_k")}
    status, data, _ = server.request("POST", "/v1/chat/completions", {"model": "gemma3-270m", "messages": messages, "max_tokens": 12, "temperature": 0, **nulls})
    assert status == 200 and data["choices"][0]["message"]["content"] == plain.choices[0].message.content, data
    # top_k, min_p and repetition_penalty (vLLM's and llama-server's names) are qkv generate's options: the same tokens
    unpenalised = c.completions.create(model="gemma3-270m", prompt="Once upon a time", max_tokens=12, temperature=0)
    first = json.loads(qkv_cli("generate", "Once upon a time", "--max-new-tokens", "1", "--json"))["token_ids"][0]  # greedy's first
    for extra, seed in (({"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3}, 11), ({"repetition_penalty": 1.3}, None),  # sampled, then greedy
                        ({"frequency_penalty": 1.2, "presence_penalty": 0.7, "logit_bias": {str(first): -100}}, 5), ({"frequency_penalty": 1.5, "presence_penalty": -0.5}, None)):  # OpenAI's
        args = ["generate", "Once upon a time", "--max-new-tokens", "12", "--json"]
        for k, v in extra.items():
            args += [x for tok, bias in v.items() for x in ("--logit-bias", f"{tok}={bias}")] if k == "logit_bias" else [f"--{k.replace('_', '-')}", str(v)]
        ref = json.loads(qkv_cli(*args, *(["--temperature", "0.9", "--seed", str(seed)] if seed is not None else [])))
        got = c.completions.create(model="gemma3-270m", prompt="Once upon a time", max_tokens=12, temperature=0 if seed is None else 0.9, seed=seed, extra_body=extra)
        assert got.choices[0].text == ref["text"], (extra, got.choices[0].text, ref["text"])
        plain = unpenalised if seed is None else c.completions.create(model="gemma3-270m", prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=seed)
        assert plain.choices[0].text != got.choices[0].text, extra  # the options are applied, not dropped
        if "logit_bias" in extra:
            assert first not in ref["token_ids"]  # banned


def test_response_format_answers_json_as_qkv_generate_writes_it(server):
    with server.client() as c:
        _json_answers(c)


def _json_answers(c):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city", "country"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    ref = json.loads(qkv_cli("generate", "--chat", "Describe Paris as JSON.", "--json-schema", json.dumps(schema), "--max-new-tokens", "40", "--json"))
    got = c.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=40, temperature=0, response_format=fmt)
    assert got.choices[0].message.content == ref["text"] and got.choices[0].finish_reason == "stop"
    assert set(json.loads(ref["text"])) == {"city", "country"}
    with c.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=40, temperature=0, response_format=fmt, stream=True) as streamed:
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == ref["text"]
    # any object, sampled, n choices each its own place in the grammar; the completions route too
    many = c.completions.create(model="gemma3-270m", prompt="A JSON object describing a cat:", max_tokens=60, temperature=0.8, seed=3, n=3, extra_body={"response_format": {"type": "json_object"}})
    for choice in many.choices:
        assert choice.text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
    assert len({choice.text for choice in many.choices}) > 1


def test_the_api_key_is_required(server):
    assert server.get("/v1/models", key=None)[0] == 401
    status, data, _ = server.get("/v1/models", key="wrong")
    assert status == 401 and data["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in server.client().models.list().data] == ["gemma3-270m", "minilm"]


FETCH = """async ([url, key, body]) => {
    try {
        const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key}, body: JSON.stringify(body)});
        const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
        let text = "";
        for (let chunk; !(chunk = await reader.read()).done; ) text += chunk.value;
        return {status: r.status, text};
    } catch (e) {
        return {error: String(e)};
    }
}"""


def test_a_page_of_an_allowed_origin_streams_a_completion_and_other_pages_cannot_call(server, browser, tmp_path):
    """In Chromium: a page from --allow-origin's origin reads a streamed completion (docs/serving.md's fetch),
    and the same page from any other origin (localhost instead of 127.0.0.1: another origin) gets nothing."""
    import functools
    import http.server

    (tmp_path / "index.html").write_text("<!doctype html><title>a page</title>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    pages = http.server.ThreadingHTTPServer(("127.0.0.1", PAGE_PORT), handler)
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    body = {"model": "gemma3-270m", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stream": True}
    want = server.client().completions.create(**{**body, "stream": False}).choices[0].text
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    try:
        page = browser.new_page()
        page.goto(PAGE_ORIGIN + "/index.html")
        got = page.evaluate(FETCH, [url, KEY, body])
        assert got.get("status") == 200, got
        events = [line[len("data: "):] for line in got["text"].splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want
        refused = page.evaluate(FETCH, [url, "wrong", body])  # an error's body is readable too: the headers are on it
        assert refused["status"] == 401 and "API key" in refused["text"]
        page.goto(f"http://localhost:{PAGE_PORT}/index.html")
        other = page.evaluate(FETCH, [url, KEY, body])
        assert "error" in other and "Failed to fetch" in other["error"], other
        page.close()
    finally:
        pages.shutdown()
        pages.server_close()
    for origin, allowed in ((PAGE_ORIGIN, True), (f"http://localhost:{PAGE_PORT}", False)):  # the preflight, as curl sees it
        status, _, headers = server.request("OPTIONS", "/v1/completions", key=None, headers={"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"})
        assert (status == 200 and headers.get("access-control-allow-origin") == origin) if allowed else (status == 400 and "access-control-allow-origin" not in headers)


def test_models_retrieve(server):
    c = server.client()
    assert c.models.retrieve("gemma3-270m").id == "gemma3-270m" and c.models.retrieve("minilm").id == "minilm"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.models.retrieve("gpt-4")


def test_clients_gone_mid_stream_leave_no_pages_in_use(server):
    before = server.metric("qkv_generation_tokens_total")
    for i in range(20):
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps({"prompt": f"Count to one hundred, {i}:", "max_tokens": 200, "temperature": 0, "stream": True}), {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        r.fp.readline()  # the first event, then the client goes
        c.sock.close()
        c.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (server.metric("qkv_kv_pages_in_use") or server.metric("qkv_requests_running") or server.metric("qkv_requests_waiting")):
        time.sleep(0.2)
    assert server.metric("qkv_kv_pages_in_use") == 0 and server.metric("qkv_requests_running") == 0
    assert server.metric("qkv_generation_tokens_total") - before < 20 * 200 / 2  # cancelled, not run to the end
    ok = server.client().completions.create(model="gemma3-270m", prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_embeddings_equal_qkv_embed(server):
    texts = ["The cat sat on the mat.", "A dog slept by the door."]
    ref = np.array(json.loads(qkv_cli("embed", *texts, "--json"))["embeddings"], np.float32)
    got = server.client().embeddings.create(model="minilm", input=texts)  # the client asks for base64
    np.testing.assert_array_equal(np.array([d.embedding for d in got.data], np.float32), ref)
    # One text alone against `qkv embed` of that text alone: the encoder pads a batch to its longest
    # text, and BLAS's products for another number of rows may round the last bit otherwise (6e-8 seen).
    alone = np.array(json.loads(qkv_cli("embed", texts[0], "--json"))["embeddings"], np.float32)
    status, data, _ = server.request("POST", "/v1/embeddings", {"input": texts[0], "encoding_format": "float"})
    assert status == 200 and np.array_equal(np.array(data["data"][0]["embedding"], np.float32), alone[0])


def test_n_choices_and_the_metrics(server):
    r = server.client().completions.create(model="gemma3-270m", prompt="Colours:", max_tokens=6, temperature=1.0, seed=3, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and 3 <= r.usage.completion_tokens <= 18
    again = server.client().completions.create(model="gemma3-270m", prompt="Colours:", max_tokens=6, temperature=1.0, seed=3, n=3)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # a seed gives the same samples
    text = server.get("/metrics")[1]
    for name in ("qkv_requests_running", "qkv_requests_waiting", "qkv_kv_pages_in_use", "qkv_generation_tokens_per_second", "qkv_time_to_first_token_seconds", "qkv_generation_tokens_total"):
        assert name in text


def _open(port, send=b""):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)  # a server that never answers fails the test, not hangs it
    sock.sendall(send)
    return sock


def _closed_by_server(sock, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(4096) == b""  # nothing was ever asked, so nothing is answered: only the close
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_idle_and_slow_connections_are_closed_and_bounded():
    # uvicorn alone keeps a connection that never sends a whole request head open for ever: a few thousand
    # exhaust the server's file descriptors (slowloris)
    s = Server("--read-timeout", "2", "--max-connections", "8", "--embedding-model", "none")
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        idle = [_open(s.port) for _ in range(3)] + [_open(s.port, head) for _ in range(3)]
        trickle = _open(s.port, head + b'Content-Length: 60\r\n\r\n{"prompt": ')  # its head whole, half its body
        time.sleep(0.3)
        over = [_open(s.port) for _ in range(3)]  # the 8th is the last one let in
        refused = [sock.recv(4096) for sock in over[1:]]
        assert all(r.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in r for r in refused), refused
        t0 = time.monotonic()
        assert all(_closed_by_server(sock, 4) for sock in idle + over[:1])
        assert 1.5 < time.monotonic() - t0 < 4
        answer = trickle.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer, answer
        # the slots are free again; a stream longer than the read timeout is not cut by it, nor a kept-alive
        # connection's second request after a pause
        c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
        t0 = time.monotonic()
        c.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
        r = c.getresponse()
        events = [line for line in r if line.startswith(b"data: ")]
        assert r.status == 200 and events[-1].strip() == b"data: [DONE]" and time.monotonic() - t0 > 2
        time.sleep(1)
        c.request("POST", "/v1/completions", json.dumps({"prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0}), {"Content-Type": "application/json"})
        assert c.getresponse().status == 200
        c.close()
        gone = _open(s.port, head + b'Content-Length: 60\r\n\r\n{"pro')
        time.sleep(0.3)
        gone.close()  # a client gone during its body: nothing to answer, and nothing wrong to log
        for sock in idle + over + [trickle]:
            sock.close()
    finally:
        s.stop()
    log = "".join(s.log)
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]


@pytest.mark.parametrize("option,value", [("--read-timeout", "0"), ("--read-timeout", "nan"), ("--max-connections", "0"), ("--timeout", "-1")])
def test_a_bad_bound_is_refused_before_anything_loads(option, value):
    r = subprocess.run([sys.executable, "-m", "qkv", "serve", option, value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and option in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_port_0_serves_on_the_free_port_it_names_and_a_port_in_use_is_said_before_loading():
    import re

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "qkv", "serve", "--port", str(taken)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{taken}: Address already in use" in r.stderr and "loading" not in r.stderr, r.stderr
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "serve", "--port", "0", "--embedding-model", "none"], stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "serving" not in line:  # the announcement had said port 0
            line = proc.stderr.readline()
            assert line, "qkv serve exited before serving"
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1))
        assert port > 0
        for _ in range(100):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                c.request("GET", "/health")
                assert c.getresponse().status == 200
                c.close()
                break
            except ConnectionRefusedError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"nothing answered at the port named, {port}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()


def test_serving_beyond_this_machine_without_a_key_is_pointed_out():
    from qkv.cli.serve import exposure_note

    for host in ("0.0.0.0", "::", "192.168.1.5", "myhost.example"):
        assert "--api-key" in exposure_note(host, None)
        assert exposure_note(host, "k") is None
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_note(host, None) is None
        assert exposure_note(host, None, ["http://localhost:3000"]) is None
        assert "any web page" in exposure_note(host, None, ["*"]) and exposure_note(host, "k", ["*"]) is None


@pytest.mark.parametrize("origin", ["http://localhost:3000/", "localhost:3000", "http://a.test/page", "ftp://a.test", "", "http://a b"])
def test_an_origin_no_browser_would_send_is_refused_before_anything_loads(origin):
    from qkv.models.serving.api import check_origins

    r = subprocess.run([sys.executable, "-m", "qkv", "serve", "--allow-origin", "http://ok.test:8080", "--allow-origin", origin], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allow-origin: an allowed origin should be" in r.stderr and repr(origin) in r.stderr and "loading" not in r.stderr
    assert check_origins(["*", "http://[::1]:8000", "https://app.example.com"]) == ("*", "http://[::1]:8000", "https://app.example.com")
    with pytest.raises(TypeError, match="a list of origins"):
        check_origins("http://a.test")


def test_a_full_queue_gets_429_and_a_deadline_504():
    s = Server("--max-batch", "1", "--max-waiting", "1", "--timeout", "3", "--embedding-model", "none")
    try:
        results = []

        def ask():
            results.append(s.request("POST", "/v1/completions", {"prompt": "Count: 1, 2, 3,", "max_tokens": 256, "temperature": 0}, key=None))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        for t in threads:
            t.join()
        statuses = sorted(r[0] for r in results)
        assert 429 in statuses, statuses
        busy = next(r for r in results if r[0] == 429)
        assert busy[2].get("retry-after") == "1" and busy[1]["error"]["type"] == "rate_limit_error"
        assert 504 in statuses  # 256 tokens take longer than 3 s here
        assert s.get("/health")[1]["status"] == "ok"
        assert s.metric("qkv_kv_pages_in_use") == 0
    finally:
        s.stop()


def test_a_shutdown_ends_the_requests_under_way_whole():
    """SIGTERM: within the grace, a stream's last event says the server is shutting down (not a cut
    transfer), a whole answer is a 503, and the server exits cleanly, logging no error."""
    import signal

    from qkv.models.serving.http import SHUTDOWN_GRACE

    s = Server("--embedding-model", "none", "--log-level", "info")
    streamed, whole, started = [], [], threading.Event()

    def stream():
        try:
            for chunk in s.client().completions.create(model="gemma3-270m", prompt="Once upon a time", max_tokens=2000, temperature=0, stream=True):
                streamed.append(chunk.choices[0].text)
                started.set()
        except Exception as exc:  # noqa: BLE001 (what the client raised is the point)
            streamed.append(exc)

    threads = [threading.Thread(target=stream), threading.Thread(target=lambda: whole.append(s.request("POST", "/v1/completions", {"prompt": "Twice upon a time", "max_tokens": 2000, "temperature": 0})))]
    try:
        for t in threads:
            t.start()
        assert started.wait(60)
        time.sleep(0.5)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        # uvicorn raises the signal again once it has shut down, so that the exit says what ended it
        assert s.proc.wait(30) in (0, -signal.SIGTERM) and time.monotonic() - t0 < SHUTDOWN_GRACE + 5
    finally:
        s.stop()
    last = streamed[-1]
    assert isinstance(last, openai.APIError) and not isinstance(last, openai.APIConnectionError) and "shutting down" in str(last), repr(last)
    assert len(streamed) > 2 and all(isinstance(p, str) for p in streamed[:-1])
    status, body, headers = whole[0]
    assert status == 503 and body["error"]["code"] == "shutting_down" and headers.get("retry-after") == "1"
    log = "".join(s.log)
    assert "Shutting down" in log and "ERROR" not in log and "Traceback" not in log, log


def test_int8_activations_serve_what_qkv_generate_gives_with_them():
    s = Server("--int8-activations", "--embedding-model", "none")
    try:
        prompt = "The capital of France is"
        ref = json.loads(qkv_cli("generate", prompt, "--max-new-tokens", "12", "--json", "--int8-activations"))
        got = s.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3}, key=None)[1]
        from qkv.models import load_causal_lm

        lm = load_causal_lm()
        # The same tokens, up to a near-tie: the server's attention over pages and generate's over one
        # cache differ in their last bits, which int8 rounding of the next layer's inputs can magnify.
        served, tops = got["choices"][0]["logprobs"]["tokens"], got["choices"][0]["logprobs"]["top_logprobs"]
        expected = [lm.tokenizer.decode([t]) for t in ref["token_ids"]]
        parted = next((i for i, (a, b) in enumerate(zip(served, expected)) if a != b), None)
        if parted is None:
            assert got["choices"][0]["text"] == ref["text"]
        else:  # generate's token was the server's runner-up there, within 0.15 of its choice
            assert parted >= 6 and expected[parted] in tops[parted], (parted, served, expected)
            assert tops[parted][served[parted]] - tops[parted][expected[parted]] < 0.15
        # the first token's logprob without int8: the server's is near it, not it
        logits = lm.forward(np.array([ref["prompt_ids"]])).logits[0, -1].astype(np.float64)
        exact = logits[ref["token_ids"][0]] - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        first = got["choices"][0]["logprobs"]["token_logprobs"][0]
        assert 1e-4 < abs(first - exact) < 0.1  # float32 rounding alone moves it by some 1e-6
        assert any("int8 activations" in line for line in s.log)
    finally:
        s.stop()

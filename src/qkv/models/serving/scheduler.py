"""Continuous batching: requests join and leave between decode steps, all running ones decoded together.

One engine thread owns the model and the pages. Each step it

1. drops requests that were cancelled (a client gone) or ran past their
   deadline, and gives their pages back;
2. admits waiting requests, oldest first, while the pool has pages for
   their prompt (and one free page per running request to grow into). A
   prompt's beginning already in published pages (:class:`~.pages.PagePool`)
   is taken by reference, not computed;
3. when the pages run out all the same (every request grows), *preempts* the
   request admitted last: its pages go back (to the prefix cache: they are
   published as they fill), and it waits at the head of the queue to be
   admitted again with its prompt and the tokens it has made so far, most of
   them found again in the cache. Its answer does not change: its keys are
   the same bits, whoever computes them (vLLM's preemption by recomputation);
4. takes one token of every decoding request, and a chunk of the prompt of
   those still prefilling (at most ``prefill_chunk`` tokens a step in all,
   so that a long prompt does not stall the others);
5. runs them as one batch (:func:`~.engine.forward_step`), then samples each
   request's next token with its own generator, and sends it on.

Requests talk to the HTTP side through a callback: ``emit(event)`` is called
from the engine thread with ``("token", dict)``, then ``("done", dict)`` or
``("error", dict)``; after every step (and after the requests a failure or
shutdown ends) the engine thread calls each of :attr:`Scheduler.after_step`, for
whoever wants a step's events delivered together.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ...threads import set_num_threads
from ..engines.sampling import adjust, next_token
from ..engines.text_stream import TextStream
from .engine import Batch, forward_step, log_probabilities
from .pages import PagePool

__all__ = ["Request", "Scheduler", "Closed"]


class Closed(RuntimeError):
    """:meth:`Scheduler.submit` after :meth:`Scheduler.close`: nothing would ever run the request."""


@dataclass
class Request:
    """One sequence to generate (a choice of a completion: ``n`` choices are ``n`` requests).

    ``top_logprobs``: None (no log-probabilities), or how many alternatives to give beside each token's (0-20).
    """

    prompt: list
    max_tokens: int
    emit: object  # callable(kind, payload), called from the engine thread
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0  # as qkv generate's: the prompt's tokens and the new ones made less likely
    frequency_penalty: float = 0.0  # OpenAI's, as qkv generate's: over the new tokens
    presence_penalty: float = 0.0
    logit_bias: tuple | None = None  # (ids, biases), as sampling.check_logit_bias gives them
    matcher: object = None  # a JSON schema's state for this sequence (engines.structured.Matcher), if the request gave one
    seed: int | None = None
    stop: tuple = ()
    top_logprobs: int | None = None
    deadline: float = math.inf  # time.monotonic() after which it is stopped
    cancelled: bool = False
    # the engine's state
    tokens: list = field(default_factory=list)  # prompt + new
    pages: list = field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in pages
    published: int = 0  # leading pages offered to the prefix cache
    cached_tokens: int = 0
    admitted: int = 0  # times admitted (more than once: it was preempted)
    arrived: float = 0.0
    first_token_at: float | None = None
    new: list = field(default_factory=list)
    text: object = None  # its TextStream
    rng: object = None  # its generator, when sampled
    final_text: str | None = None  # the text cut before a stop string
    step_tokens: int = 0  # tokens it runs in the current step

    def cancel(self) -> None:
        """Stop it at the next step (its pages freed); safe from any thread."""
        self.cancelled = True


class Scheduler:
    """The engine: a thread running the model over every admitted request, a step at a time.

    Parameters
    ----------
    lm : qkv.models.engines.decoder.CausalLM
    num_pages, page_size : int
        The key/value pool: ``num_pages * page_size`` tokens over all requests.
    max_batch : int
        Requests running at once.
    max_waiting : int
        Requests queued beyond them; :meth:`submit` refuses more (the server answers 429).
    prefill_chunk : int
        Prompt tokens a step at most.
    threads : int, optional
        qkv's threads for the engine (``--threads``).
    batch_invariant : bool
        Products summed in an order that does not depend on the batch (the default).
    int8_activations : bool
        llama.cpp's int8 activations in the quantized products (``--int8-activations``): not exact;
        answers stay batch-invariant.
    seed : int
        Seeds the generators of sampled requests that give none.
    """

    def __init__(self, lm, *, num_pages: int = 1024, page_size: int = 16, max_batch: int = 16, max_waiting: int = 64, prefill_chunk: int = 128,
                 threads: int | None = None, batch_invariant: bool = True, int8_activations: bool = False, seed: int = 0):  # fmt: skip
        cfg = lm.config
        self.lm = lm
        self.pool = PagePool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.page_size, self.max_batch, self.max_waiting, self.prefill_chunk = page_size, max_batch, max_waiting, prefill_chunk
        self.threads, self.batch_invariant, self.int8_activations = threads, batch_invariant, int8_activations
        self.eos = set(lm.tokenizer.eos_ids if lm.tokenizer is not None else ())
        self._seeds = np.random.SeedSequence(seed)
        self.waiting: deque = deque()
        self.running: list = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="qkv-engine", daemon=True)
        self._warm, self._warmed, self._warm_error = True, threading.Event(), None
        # figures for /metrics
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.preempted = 0
        self.ttft: list = []  # seconds, the last ones
        self._recent: deque = deque()  # (time, tokens generated) of the last steps: tokens/s
        self.failed: BaseException | None = None
        #: Callables the engine thread calls after every step (the HTTP side delivers a step's events at once).
        self.after_step: list = []

    # ------------------------------------------------------------ the HTTP side
    def start(self, *, warm_up: bool = True) -> None:
        """Start the engine thread; return once it has run :meth:`warm_up` (unless ``warm_up=False``).

        The warm-up runs on the engine thread itself, which then calls numba's threads as it will for
        every request (warmed up on the main thread, a server's second and third short requests took
        0.17-0.21 s against 0.13-0.17).
        """
        self._warm = warm_up
        self._thread.start()
        self._warmed.wait()
        if self._warm_error is not None:
            self.close()
            raise self._warm_error

    def warm_up(self) -> None:
        """Run a few prompt tokens and one decoded token through the engine, on two pages of their own.

        A fresh server's first request had waited for what the first step of a process does once: the
        compiled code loaded from numba's cache, numba's threads started, the model file's pages read
        in. Here that happens before the server takes requests. Nothing is counted, cached or kept.
        """
        cfg = self.lm.config
        pool = PagePool(cfg.num_layers, 2, self.page_size, cfg.num_kv_heads, cfg.head_dim)
        n = min(4, self.page_size)  # the prompt on page 0, the decoded token on page 0 or 1
        table = np.array([[0, 1]], np.int64)
        with set_num_threads(self.threads) if self.threads else contextlib.nullcontext():
            for tokens, first in ((list(range(1, n + 1)), 0), ([1], n)):
                batch = Batch(tokens, [0] * len(tokens), list(range(first, first + len(tokens))), table, [len(tokens) - 1], self.page_size)
                logits = forward_step(self.lm, pool, batch, batch_invariant=self.batch_invariant, int8_activations=self.int8_activations)
                log_probabilities(logits, [1])
                next_token(logits[0])

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def submit(self, req: Request) -> bool:
        """Queue ``req``; False when the queue is full (nothing queued). Raises :class:`Closed` once closed."""
        with self._cv:
            if self._stop:
                raise Closed("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                return False
            req.arrived = time.monotonic()
            req.tokens = list(req.prompt)
            self.waiting.append(req)
            self._cv.notify()
        return True

    def tokens_per_s(self) -> float:
        """Generated tokens a second over the last 10 s of steps."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= 10]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent[1:]) / max(recent[-1][0] - recent[0][0], 1e-9)

    # ------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        with set_num_threads(self.threads) if self.threads else contextlib.nullcontext():
            try:
                if self._warm:
                    self.warm_up()
            except Exception as exc:  # start() raises it
                self._warm_error = exc
                return
            finally:
                self._warmed.set()
            while True:
                with self._cv:
                    while not self._stop and not self.waiting and not self.running:
                        self._cv.wait()
                    if self._stop:
                        break
                try:
                    self.step()
                except Exception as exc:  # a bug: every request gets an error, the server goes on
                    self.failed = exc
                    for req in list(self.running) + list(self.waiting):
                        self._finish(req, error="internal error in the engine", status=500)
                    with self._cv:
                        self.waiting.clear()
                    self.running = []
                    self._stepped()
        for req in list(self.running) + list(self.waiting):
            self._finish(req, error="the server is shutting down", status=503)
        self._stepped()

    def _stepped(self) -> None:
        for f in self.after_step:
            f()

    def _finish(self, req: Request, reason: str | None = None, *, error: str | None = None, status: int = 500) -> None:
        if req.pages:
            self.pool.release(req.pages)
            req.pages = []
        if req in self.running:
            self.running.remove(req)
        if error is not None:
            req.emit("error", {"message": error, "status": status})  # the HTTP status a whole answer gets
            return
        req.emit("done", {"finish_reason": reason, "prompt_tokens": len(req.prompt), "completion_tokens": len(req.new), "cached_tokens": req.cached_tokens})

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            if req.cancelled:
                with self._cv:
                    self.waiting.popleft()
                self._finish(req, "cancelled")  # it holds no pages while it waits
                continue
            pages, covered = self.pool.lookup(req.tokens, limit=len(req.tokens) - 1)  # at least one token to compute: its logits
            need = self.pages_for(len(req.tokens)) - len(pages)
            if need + len(self.running) + 1 > self.pool.available:  # its prompt, and room for every running one to grow
                self.pool.release(pages)
                break  # wait for pages (first come, first served)
            with self._cv:
                self.waiting.popleft()
            req.pages, req.computed, req.published = pages, covered, len(pages)
            if not req.admitted:
                req.cached_tokens = covered
                self.prompt_tokens += len(req.prompt)
                self.cached_prompt_tokens += covered
                req.text = TextStream(self.lm.tokenizer, req.stop) if self.lm.tokenizer is not None else None
                if req.temperature > 0:
                    req.rng = np.random.default_rng(req.seed if req.seed is not None else self._seeds.spawn(1)[0])
            req.admitted += 1
            self.running.append(req)

    def _preempt(self, req: Request) -> None:
        """Give ``req``'s pages back and queue it first, to be computed again from what the cache still holds."""
        self.pool.release(req.pages)
        req.pages, req.computed, req.published = [], 0, 0
        self.running.remove(req)
        self.preempted += 1
        with self._cv:
            self.waiting.appendleft(req)

    def _plan(self) -> list:
        """Each running request's tokens this step (``step_tokens``), the pages they need taken from the pool."""
        budget = self.prefill_chunk
        for req in sorted(self.running, key=lambda r: len(r.tokens) - r.computed > 1):  # decoding ones first
            left = len(req.tokens) - req.computed
            req.step_tokens = 1 if left == 1 else min(left, budget)
            if left > 1:
                budget -= req.step_tokens
        while True:
            need = sum(max(0, self.pages_for(r.computed + r.step_tokens) - len(r.pages)) for r in self.running)
            if need <= self.pool.available or len(self.running) == 1:
                break
            self._preempt(self.running[-1])  # the last admitted
        for req in self.running:
            while len(req.pages) * self.page_size < req.computed + req.step_tokens:
                req.pages.append(self.pool.allocate())  # OutOfPages only if one request alone outgrows the pool
        return [r for r in self.running if r.step_tokens > 0]

    def step(self) -> None:
        """One step: drop, admit, run every running request one token (or a prompt chunk) further, send."""
        try:
            self._step()
        finally:
            self._stepped()

    def _step(self) -> None:
        now = time.monotonic()
        for req in list(self.running):
            if req.cancelled:
                self._finish(req, "cancelled")
            elif now > req.deadline:
                self._finish(req, error="the request ran past its deadline", status=504)
        with self._cv:
            expired = [r for r in self.waiting if now > r.deadline]
            for r in expired:
                self.waiting.remove(r)
        for r in expired:
            r.emit("error", {"message": "the request ran past its deadline while waiting", "status": 504})
        self._admit()
        if not self.running:
            return
        order = self._plan()
        tokens, rows, positions, logits_for, want = [], [], [], [], []
        for b, req in enumerate(order):
            n = req.step_tokens
            tokens += req.tokens[req.computed : req.computed + n]
            rows += [b] * n
            positions += range(req.computed, req.computed + n)
            if req.computed + n == len(req.tokens):
                logits_for.append(len(tokens) - 1)
                want.append(req)
        width = max(len(r.pages) for r in order)
        table = np.zeros((len(order), width), np.int64)
        for b, req in enumerate(order):
            table[b, : len(req.pages)] = req.pages
        batch = Batch(tokens, rows, positions, table, logits_for, self.page_size)
        logits = forward_step(self.lm, self.pool, batch, batch_invariant=self.batch_invariant, int8_activations=self.int8_activations)
        for req in order:
            req.computed += req.step_tokens
            req.step_tokens = 0
            full = req.computed // self.page_size
            while req.published < full:  # offer each newly full page to the prefix cache
                k = req.published
                self.pool.publish(req.pages[k], req.tokens[k * self.page_size : (k + 1) * self.page_size], parent=req.pages[k - 1] if k else None)
                req.published += 1
        now = time.monotonic()
        # All rows at once, each its own. A greedy request asking for log-probabilities has the top id found
        # there too (the first place of the maximum, as np.argmax takes it): no pass of its own over the logits.
        stats = log_probabilities(logits, [None if r.top_logprobs is None else max(r.top_logprobs, 1 if r.temperature == 0 else 0) for r in want])
        for req, lg, (log_z, top) in zip(want, logits, stats):
            self._sample(req, lg, now, log_z, top)
        self._recent.append((now, len(want)))
        while self._recent and now - self._recent[0][0] > 10:
            self._recent.popleft()

    def _sample(self, req: Request, logits: np.ndarray, now: float, log_z, top) -> None:
        plain = req.repetition_penalty == 1.0 and not req.frequency_penalty and not req.presence_penalty and req.logit_bias is None and req.matcher is None
        if req.temperature == 0 and plain and top is not None and len(top) and math.isfinite(log_z):
            tok = int(top[0])  # the argmax, from log_probabilities' search
        else:  # as generate samples (its log-probabilities stay the model's, before the schema, the penalties and the bias)
            try:
                lg = logits if req.matcher is None else req.matcher.mask(logits)
                lg = adjust(lg, req.prompt, req.new, repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
                            presence_penalty=req.presence_penalty, logit_bias=req.logit_bias)  # fmt: skip
                tok = next_token(lg, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, rng=req.rng)
                if req.matcher is not None:
                    req.matcher.advance(tok)
            except ValueError as exc:  # the schema's matcher failed (a limit of llguidance's): this request's error, not the server's
                self._finish(req, error=str(exc), status=400)
                return
        info = {"token": tok}
        if req.top_logprobs is not None:  # log_z and the top ids: engine.log_probabilities
            info["logprob"] = float(logits[tok]) - log_z
            if req.top_logprobs:
                info["top"] = [(int(t), float(logits[t]) - log_z) for t in top]
        if req.first_token_at is None:
            req.first_token_at = now
            self.ttft.append(now - req.arrived)
            del self.ttft[:-1000]
        req.new.append(tok)
        req.tokens.append(tok)
        self.generated_tokens += 1
        reason = None
        if tok in self.eos:
            reason = "stop"
            info["text"] = ""
        else:
            info["text"] = req.text.push(tok) if req.text is not None else ""
            if req.stop:  # (the stream's text: decoding all the new tokens at each one cost a long answer quadratic time)
                text = req.text.text if req.text is not None else self.lm.tokenizer.decode(req.new)
                hits = [text.find(x) for x in req.stop if x in text]
                if hits:
                    reason = "stop"
                    req.final_text = text[: min(hits)]
            if reason is None and len(req.new) >= req.max_tokens:
                reason = "length"
        req.emit("token", info)
        if reason is not None:
            if req.text is not None:
                final = req.final_text if req.final_text is not None else self.lm.tokenizer.decode(req.new)
                rest = req.text.finish(final)
                if rest:
                    req.emit("token", {"token": None, "text": rest})
            self._finish(req, reason)

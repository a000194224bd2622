"""A server put together: the scheduler, the app, and uvicorn (in the foreground for ``qkv serve``, or in a
background thread for a notebook or a test: :func:`start_server`)."""

from __future__ import annotations

import threading
import time

from .api import Limits, check_origins, check_sampling_defaults, create_app
from .http import MAX_CONNECTIONS, config, server
from .scheduler import Scheduler

__all__ = ["build", "start_server", "BackgroundServer"]


def build(lm, *, model_name: str, api_key: str | None = None, embedder=None, embedding_name: str | None = None, kv_tokens: int = 16384, page_size: int = 16, max_batch: int = 16,
          max_waiting: int = 64, prefill_chunk: int = 128, threads: int | None = None, batch_invariant: bool = True, int8_activations: bool = False, seed: int = 0, limits: Limits = Limits(), allow_origins=(),
          sampling_defaults: dict | None = None):  # fmt: skip
    """(scheduler, app) for ``lm``; start the scheduler before serving the app (see :func:`start_server`).
    ``sampling_defaults``: as :func:`~.api.create_app` (None: the model's recommendation)."""
    allow_origins = check_origins(allow_origins)  # before the pool is allocated
    check_sampling_defaults(lm, sampling_defaults)
    scheduler = Scheduler(lm, num_pages=-(-kv_tokens // page_size), page_size=page_size, max_batch=max_batch, max_waiting=max_waiting, prefill_chunk=prefill_chunk,
                          threads=threads, batch_invariant=batch_invariant, int8_activations=int8_activations, seed=seed)  # fmt: skip
    return scheduler, create_app(scheduler, lm, model_name=model_name, limits=limits, api_key=api_key, embedder=embedder, embedding_name=embedding_name, allow_origins=allow_origins,
                                 sampling_defaults=sampling_defaults)  # fmt: skip


class BackgroundServer:
    """uvicorn serving ``app`` on a thread of this process; ``url`` is its ``/v1`` base. A context manager."""

    def __init__(self, scheduler, app, *, host: str = "127.0.0.1", port: int = 0, max_connections: int = MAX_CONNECTIONS):
        self.scheduler = scheduler
        # a request's head has the time its body has (the app's limits): one setting for both, as qkv serve's --read-timeout
        read_timeout = app.state.server.limits.read_timeout_s
        self._server = server(config(app, host=host, port=port, read_timeout=read_timeout, max_connections=max_connections), scheduler.close)
        self._server.install_signal_handlers = lambda: None  # not the main thread: no signal handlers
        scheduler.start()
        self._thread = threading.Thread(target=self._server.run, name="qkv-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                scheduler.close()
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.02)
        sock = self._server.servers[0].sockets[0].getsockname()
        self.port = sock[1]
        self.url = f"http://{host}:{self.port}/v1"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.scheduler.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def start_server(lm, *, model_name: str = "model", host: str = "127.0.0.1", port: int = 0, **options) -> BackgroundServer:
    """Serve ``lm`` from this process, in the background: ``port=0`` takes a free port (``.url`` says which).

    ``options``: :func:`build`'s. Examples: docs/serving.md.
    """
    scheduler, app = build(lm, model_name=model_name, **options)
    return BackgroundServer(scheduler, app, host=host, port=port)

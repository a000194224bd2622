"""uvicorn, bounded: connections that send nothing are closed, and there are at most so many of them.

uvicorn (0.54) keeps a connection open for as long as its client likes
before the head of a request has arrived: one that connects and sends
nothing, or half a header line, holds a file descriptor and a protocol
object for ever (checked: 3,000 such connections were all still open after
70 s, and each more that arrived took another descriptor). That is the
"slowloris" attack: a few thousand idle sockets exhaust the process's
descriptors (1,024 by default on Linux) and no one else is served. Its
keep-alive timer only runs between two requests, and any byte stops it.

So :func:`config` gives uvicorn its own h11 protocol with two bounds:

- a request's **head** must arrive within ``read_timeout`` seconds of the
  connection (or of the previous response on a kept-alive one); otherwise
  the connection is closed. (The body has its own deadline in the app:
  :func:`qkv.models.serving.api._read_json`, a 408.)
- at most ``max_connections`` open connections: one more is answered 503 in
  OpenAI's error shape and closed at once.

Both are ``qkv serve`` options (``--read-timeout``, ``--max-connections``).
Past that, a server open to the internet belongs behind a reverse proxy
that limits each client.

And a shutdown (Ctrl-C, SIGTERM) ends what is under way cleanly
(:func:`server`): uvicorn stops accepting connections and waits
:data:`SHUTDOWN_GRACE` seconds for the open requests, then cancels their
tasks, which cut a stream mid-chunk (the client read a broken transfer,
and the server logged an error). Here, a second before that, the engine is
closed: every request still running ends with "the server is shutting
down", a stream's last event, or a 503 for a whole answer, so each
response is complete when uvicorn looks again.
"""

from __future__ import annotations

import asyncio
import json

__all__ = ["config", "server", "READ_TIMEOUT", "MAX_CONNECTIONS", "SHUTDOWN_GRACE"]

READ_TIMEOUT = 15.0  #: seconds for a request's head (here) and for its body (``api.Limits.read_timeout_s``)
MAX_CONNECTIONS = 512  #: open connections at most
SHUTDOWN_GRACE = 5.0  #: seconds the requests under way may go on once a shutdown begins


def _protocol(read_timeout: float, max_connections: int):
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    body = json.dumps({"error": {"message": f"the server has {max_connections} connections open, its limit; try again shortly", "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    refusal = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    class BoundedH11(H11Protocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:  # this one included
                transport.write(refusal)
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has the same time to arrive

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(read_timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            # Still waiting for a request's head (their IDLE, half a header line included): close. A request
            # under way (its body, its answer) is the app's to bound.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return BoundedH11


def config(app, *, host: str, port: int, log_level: str = "warning", read_timeout: float = READ_TIMEOUT, max_connections: int = MAX_CONNECTIONS):
    """uvicorn's ``Config`` for ``app`` with the bounded h11 protocol (see the module's docstring)."""
    import uvicorn

    if not read_timeout > 0:
        raise ValueError(f"read_timeout should be > 0 seconds, got {read_timeout}")
    if max_connections < 1:
        raise ValueError(f"max_connections should be >= 1, got {max_connections}")
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE, http=_protocol(read_timeout, max_connections))


def server(cfg, on_shutdown):
    """A ``uvicorn.Server`` for ``cfg`` (:func:`config`) that calls ``on_shutdown()`` (on a thread: the
    scheduler's ``close``) a second before its grace for open requests runs out, so they end whole."""
    import uvicorn

    class Draining(uvicorn.Server):
        async def shutdown(self, sockets=None):
            loop = asyncio.get_running_loop()
            timer = loop.call_later(max(0.0, self.config.timeout_graceful_shutdown - 1.0), loop.run_in_executor, None, on_shutdown)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Draining(cfg)

"""Connections a client cannot hoard: deadlines for reading a request, and a cap on connections.

uvicorn closes a connection that stays idle after a response (timeout_keep_alive) but waits forever for
the first request's headers and for a body, so a few hundred sockets that send nothing, or a byte now
and then, hold the server's file descriptors (slowloris). GuardedH11 is uvicorn's h11 protocol with:

- a header deadline: from the connection (or the first byte of its next request) to the end of the
  request's head, ServeConfig.header_timeout seconds;
- a body deadline: from the head to the end of the body, ServeConfig.body_timeout seconds;
- at most ServeConfig.max_connections: one more closes the connection that has waited longest for a request
  (a request in progress is never dropped); when every connection has a request, the new one is closed.

uvicorn's own limit_concurrency answers 503 once that many connections are open, idle ones included:
a thousand idle sockets would turn every real client away, which is what the cap here avoids.
"""

from __future__ import annotations

import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ServeConfig

log = logging.getLogger("gpt2numba.serve")


class Sparse:
    """A warning that may repeat thousands of times a second, logged at most once per ``every`` seconds,
    with the count of those not logged."""

    def __init__(self, every: float = 60.0):
        self.every, self._last, self._skipped = every, -float("inf"), 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last < self.every:
            self._skipped += 1
            return
        more = f" (and {self._skipped} more like it since the last)" if self._skipped else ""
        log.warning(message + more, *args)
        self._last, self._skipped = now, 0


_TIMEOUTS, _FULL = Sparse(), Sparse()


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and a cap on connections (guarded_h11 sets them)."""

    settings = ServeConfig()  # its header_timeout, body_timeout, max_connections (H11Protocol's config: uvicorn's)

    def connection_made(self, transport) -> None:
        self._deadline = None
        self._phase = "head"
        self.waiting_since: float | None = time.monotonic()  # None while a request is in progress
        full = len(self.connections) >= self.settings.max_connections
        super().connection_made(transport)
        if full and not self._evict_idlest():
            _FULL.warning("%d connections, each with a request in progress (--max-connections): a new one is "
                          "closed", self.settings.max_connections)
            transport.close()
            return
        self._arm(self.settings.header_timeout)

    def _evict_idlest(self) -> bool:
        idle = [c for c in self.connections if c is not self and getattr(c, "waiting_since", None) is not None]
        if not idle:
            return False
        _FULL.warning("%d connections (--max-connections): the one idle longest is closed",
                      self.settings.max_connections)
        victim = min(idle, key=lambda c: c.waiting_since)
        victim.waiting_since = None
        victim.transport.close()
        return True

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:  # the first byte of a next request
            self._phase = "head"
            self._arm(self.settings.header_timeout)
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._phase == "head":
            self._phase, self.waiting_since = "body", None
            self._arm(self.settings.body_timeout)
        elif state is not h11.IDLE and state is not h11.SEND_BODY:  # the request is in (or the connection ends)
            self._phase, self.waiting_since = "answer", None
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # keep-alive: idle until the next request (uvicorn's timer)
            self._phase, self.waiting_since = "head", time.monotonic()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.waiting_since = None
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        what = "headers" if self._phase == "head" else "body"
        seconds = self.settings.header_timeout if what == "headers" else self.settings.body_timeout
        flag = "--header-timeout" if what == "headers" else "--body-timeout"
        _TIMEOUTS.warning("a request's %s did not arrive within %g s (%s): connection closed", what, seconds, flag)
        self.transport.close()


def guarded_h11(config: ServeConfig) -> type[GuardedH11]:
    """GuardedH11 with the deadlines and the cap of ``config``, as uvicorn's ``http`` protocol class."""
    return type("GuardedH11", (GuardedH11,), {"settings": config})

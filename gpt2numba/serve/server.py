"""Running the application: uvicorn with guarded connections (connections.py), file descriptors for them,
quiet accept errors, and a shutdown that answers every request.

Shutdown (Ctrl-C or SIGTERM): stop listening and take no new request; requests that have not started get
503 at once; those under way have ``shutdown_grace`` seconds to finish; then each one left ends with an
error (a stream: an error event and [DONE]; a response: 503 in OpenAI's shape); the exit status is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import resource
import signal
import threading

import uvicorn

from ..model.weights import GPT2Weights
from ..text.tokenizer import Tokenizer
from .app import create_app
from .config import ServeConfig
from .connections import Sparse, guarded_h11

log = logging.getLogger("gpt2numba.serve")

WRITE_GRACE = 10  # seconds, after the shutdown grace, for the error responses to be written
SPARE_FDS = 64  # file descriptors kept beyond the connections (model files, pipes, the listening socket)


def run(w: GPT2Weights, tokenizer: Tokenizer, config: ServeConfig | None = None, **settings) -> None:
    """Serve until Ctrl-C or SIGTERM (then shut down as the module says). config: every setting, the
    application's and the connections'; or ServeConfig's defaults with ``settings`` (its fields) over them."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = ServeConfig.made(config, settings)
    app = create_app(w, tokenizer, config)
    config = dataclasses.replace(config, max_connections=file_descriptors_for(config.max_connections))
    served = uvicorn.Config(app, host=config.host, port=config.port, access_log=False, log_level="info",
                            timeout_keep_alive=config.keep_alive_timeout,
                            timeout_graceful_shutdown=config.shutdown_grace + WRITE_GRACE, http=guarded_h11(config))
    Server(served, app.state.engine, config.shutdown_grace).run()


def file_descriptors_for(connections: int) -> int:
    """Raise this process's limit on open files to hold ``connections`` sockets and the rest; returns the
    connections that fit (fewer, with a warning, when the hard limit is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 32
    wanted = connections + in_use + SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    fit = connections if soft == resource.RLIM_INFINITY else min(connections, soft - in_use - SPARE_FDS)
    if fit < connections:
        log.warning("the limit on open files (%d, ulimit -n) leaves room for %d connections, not %d "
                    "(--max-connections)", soft, max(fit, 1), connections)
    return max(fit, 1)


class Server(uvicorn.Server):
    """uvicorn's Server with the shutdown above, quiet accept errors, and exit status 0 after a signal."""

    def __init__(self, config: uvicorn.Config, engine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    @contextlib.contextmanager
    def capture_signals(self):
        # as uvicorn's, without raising the signal again once shut down: a clean stop exits 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None):
        asyncio.get_running_loop().set_exception_handler(_quiet_accept_errors)
        await super().startup(sockets)

    async def shutdown(self, sockets=None):
        log.info("shutting down: no new requests; those under way have %g s (--shutdown-grace)", self.grace)
        self.engine.drain()
        stopper = asyncio.get_running_loop().create_task(_stop_after(self.engine, self.grace))
        try:
            await super().shutdown(sockets)
        finally:
            stopper.cancel()


async def _stop_after(engine, grace: float) -> None:
    """After the grace, every request still in flight ends with an error (the engine fails them)."""
    waited = 0.0
    while engine.busy and waited < grace:
        await asyncio.sleep(0.1)
        waited += 0.1
    if engine.busy:
        log.warning("shutdown grace over (%g s): the requests still in flight end with an error", grace)
    await asyncio.get_running_loop().run_in_executor(None, engine.stop)


_ACCEPT = Sparse()


def _quiet_accept_errors(loop, context: dict) -> None:
    """asyncio logs every failed accept with its traceback (out of file descriptors: thousands a second);
    here once a minute, in one line."""
    if context.get("message") == "socket.accept() out of system resource":
        _ACCEPT.warning("cannot accept connections: %s (ulimit -n, --max-connections)", context.get("exception"))
        return
    loop.default_exception_handler(context)

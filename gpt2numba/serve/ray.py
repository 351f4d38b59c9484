"""Replicas of the server on a Ray cluster, behind Ray Serve's HTTP proxy (the optional extra [ray]).

    import ray
    from ray import serve
    from gpt2numba.serve.ray import deployment

    ray.init(address="auto")                        # an existing cluster (or ray.init() for a local one)
    serve.start(http_options={"host": "0.0.0.0", "port": 8000})
    serve.run(deployment("/models/gpt2", replicas=4, threads=2, max_batch=16), route_prefix="/")
    # http://HEAD:8000/v1/completions: any OpenAI client, streaming too

Each replica is a Ray actor that loads the weights once and runs app.py's Starlette application, engine
thread and all: the same routes, limits, streams and errors as ``gpt2numba serve``. Ray Serve's proxy
takes the connections and hands each request to a replica (serve.ingress with a builder function, which
builds the app on the replica, not here). Nothing here serves or computes: it only packs the server for
Ray Serve. A replica that dies is replaced by Ray Serve; the requests it held end with an error (a stream
is cut before its [DONE], a response is a 5xx), never a wait. GET /metrics is the registry of the replica
that answers it (the X-Replica header names it).
"""

from __future__ import annotations

import inspect

from .. import checks
from ..compact import DTYPES
from ..errors import ConfigError

# The settings `gpt2numba serve` gives uvicorn: Ray Serve's proxy owns the connections (serve.start's
# http_options and its own timeouts), so they have no meaning for a replica.
PROXY_SETTINGS = ("host", "port", "shutdown_grace", "keep_alive_timeout", "header_timeout", "body_timeout",
                  "max_connections")
_COUNTS = ("max_batch", "max_step_tokens", "max_queue", "max_choices", "max_queued_choices", "max_body_bytes")


def deployment(model: str | None, *, replicas: int = 1, dtype: str = "float32", threads: int | None = None,
               name: str = "gpt2numba", options: dict | None = None, **server_settings):
    """A Ray Serve application (serve.run's argument) of ``replicas`` copies of gpt2numba's server.

    model: a checkpoint path on every node, a hub name, or None (models.resolve_model), kept as ``dtype``
    (compact.DTYPES); threads: each replica's Numba threads and the CPUs it reserves (default 1);
    server_settings: create_app's (model_name, max_batch, max_step_tokens, prefix_cache_mb, max_queue,
    api_key, max_body_bytes, max_choices, max_queued_choices, max_response_mb, kv_dtype), as the flags of
    ``gpt2numba serve`` set them; model_name defaults to the checkpoint's name. options: more of
    serve.deployment's (health_check_period_s, autoscaling_config, ...); its max_ongoing_requests, the
    requests Ray Serve hands a replica at once, defaults to max_batch + max_queue, so that the replica's own
    queue decides and answers 503 past it, as one server does. Every setting is checked here, before any
    replica starts: ConfigError naming it (the uvicorn settings of PROXY_SETTINGS are Ray Serve's proxy's).
    """
    from ray import serve

    settings = _checked(model, replicas, dtype, threads, options, server_settings)
    threads = 1 if threads is None else threads
    defaults = inspect.signature(_create_app()).parameters
    options = dict(options or {})
    options.setdefault("max_ongoing_requests",
                       sum(settings.get(key, defaults[key].default) for key in ("max_batch", "max_queue")))

    def build():  # on each replica, when it starts: the weights, the tokenizer, the app and its engine
        return _replica_app(model, dtype, threads, settings)

    server = serve.deployment(serve.ingress(build)(), name=name, num_replicas=replicas,
                              ray_actor_options={"num_cpus": threads}, **options)
    return server.bind()


def _checked(model, replicas, dtype, threads, options, settings: dict) -> dict:
    """The server settings with model_name filled in, once every argument has passed create_app's own checks
    (on a model of one layer, built here and never started) and the ranges the serve command's flags hold."""
    from ..config import GPT2Config
    from ..tokenizer import load_tokenizer
    from ..weights import random_weights

    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"options must be a dict of serve.deployment's settings, got {type(options).__name__}")
    if taken := [key for key in ("name", "num_replicas", "ray_actor_options") if key in (options or {})]:
        raise ConfigError(f"options may not set {taken[0]}: deployment's own arguments do (name, replicas, threads)")
    for label, value in (("replicas", replicas), ("threads", 1 if threads is None else threads),
                         *((key, settings[key]) for key in _COUNTS if key in settings)):
        if not checks.is_integer(value) or value < 1:
            raise ConfigError(f"{label} must be an integer >= 1, got {value!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if model is not None and not isinstance(model, str):
        raise ConfigError(f"model must be a path or a hub name (str) or None, got {type(model).__name__}")
    if given := [key for key in PROXY_SETTINGS if key in settings]:
        raise ConfigError(f"{given[0]} is the HTTP proxy's: Ray Serve sets it (serve.start(http_options=...)), "
                          "not a replica")
    known = [key for key in inspect.signature(_create_app()).parameters if key not in ("w", "tokenizer")]
    if unknown := sorted(set(settings) - set(known)):
        raise ConfigError(f"unknown server setting {unknown[0]!r}; a replica takes " + ", ".join(known))
    settings = dict(settings)
    settings.setdefault("model_name", model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".safetensors")
                        if model else "gpt2")
    trial = random_weights(GPT2Config(n_layer=1, n_head=1, n_embd=8, n_positions=64), seed=0)
    try:
        _create_app()(trial, load_tokenizer(), **settings)
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError: create_app's own messages
        raise ConfigError(str(e)) from None
    return settings


def _create_app():
    from .app import create_app

    return create_app


def _replica_app(model, dtype: str, threads: int, settings: dict):
    """The server's app as a replica runs it, with the X-Replica header on every response."""
    from ray import serve

    from ..forward import set_threads
    from ..models import resolve_model
    from ..tokenizer import load_tokenizer

    set_threads(threads)
    w, path, _ = resolve_model(model, dtype)
    app = _create_app()(w, load_tokenizer(path), **settings)
    return _Named(app, serve.get_replica_context().replica_id.to_full_id_str())


class _Named:
    """An ASGI app that adds ``X-Replica: <id>`` to each response of ``app``: which replica answered (its
    /metrics are that replica's). Lifespan and everything else pass through."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (b"x-replica", replica.encode())
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), self.header])
            await send(message)
        await self.app(scope, receive, named)

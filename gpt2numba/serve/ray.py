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

import dataclasses

from ..errors import ConfigError
from ..model import checks
from ..model.weights import check_dtype
from .config import CONNECTION_SETTINGS, ServeConfig

# The settings `gpt2numba serve` gives uvicorn: Ray Serve's proxy owns the connections (serve.start's
# http_options and its own timeouts), so they have no meaning for a replica.
PROXY_SETTINGS = CONNECTION_SETTINGS
REPLICA_SETTINGS = tuple(f.name for f in dataclasses.fields(ServeConfig) if f.name not in PROXY_SETTINGS)
_COUNTS = tuple(f.name for f in dataclasses.fields(ServeConfig) if f.name in REPLICA_SETTINGS and f.type == "int")


def deployment(model: str | None, *, replicas: int = 1, dtype: str = "float32", activations: str = "float32",
               threads: int | None = None, name: str = "gpt2numba", options: dict | None = None, **server_settings):
    """A Ray Serve application (serve.run's argument) of ``replicas`` copies of gpt2numba's server.

    model: a checkpoint path on every node, a hub name, or None (models.resolve_model), kept as ``dtype``
    (compact.DTYPES), its products taking ``activations`` (compact.ACTIVATIONS); threads: each replica's
    Numba threads and the CPUs it reserves (default 1);
    server_settings: ServeConfig's for a replica (REPLICA_SETTINGS: max_batch, max_step_tokens, prefix_cache_mb,
    max_queue, max_queued_choices, max_choices, max_response_mb, max_grammar_bytes, max_grammar_seconds, api_key,
    model_name, max_body_bytes, kv_dtype),
    as the flags of ``gpt2numba serve`` set them; model_name defaults to the checkpoint's name. options: more of
    serve.deployment's (health_check_period_s, autoscaling_config, ...); its max_ongoing_requests, the
    requests Ray Serve hands a replica at once, defaults to max_batch + max_queue, so that the replica's own
    queue decides and answers 503 past it, as one server does. Every setting is checked here, before any
    replica starts: ConfigError naming it (the uvicorn settings of PROXY_SETTINGS are Ray Serve's proxy's).
    """
    from ray import serve

    config = _checked(model, replicas, dtype, activations, threads, options, server_settings)
    threads = 1 if threads is None else threads
    options = dict(options or {})
    options.setdefault("max_ongoing_requests", config.max_batch + config.max_queue)

    def build():  # on each replica, when it starts: the weights, the tokenizer, the app and its engine
        return _replica_app(model, dtype, activations, threads, config)

    server = serve.deployment(serve.ingress(build)(), name=name, num_replicas=replicas,
                              ray_actor_options={"num_cpus": threads}, **options)
    return server.bind()


def _checked(model, replicas, dtype, activations, threads, options, settings: dict) -> ServeConfig:
    """The replicas' ServeConfig, model_name filled in, once every argument has passed its checks and the ranges
    the serve command's flags hold."""
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"options must be a dict of serve.deployment's settings, got {type(options).__name__}")
    if taken := [key for key in ("name", "num_replicas", "ray_actor_options") if key in (options or {})]:
        raise ConfigError(f"options may not set {taken[0]}: deployment's own arguments do (name, replicas, threads)")
    for label, value in (("replicas", replicas), ("threads", 1 if threads is None else threads),
                         *((key, settings[key]) for key in _COUNTS if key in settings)):
        if not checks.is_integer(value) or value < 1:
            raise ConfigError(f"{label} must be an integer >= 1, got {value!r}")
    check_dtype(dtype, activations=activations)
    if model is not None and not isinstance(model, str):
        raise ConfigError(f"model must be a path or a hub name (str) or None, got {type(model).__name__}")
    if given := [key for key in PROXY_SETTINGS if key in settings]:
        raise ConfigError(f"{given[0]} is the HTTP proxy's: Ray Serve sets it (serve.start(http_options=...)), "
                          "not a replica")
    if unknown := sorted(set(settings) - set(REPLICA_SETTINGS)):
        raise ConfigError(f"unknown server setting {unknown[0]!r}; a replica takes " + ", ".join(REPLICA_SETTINGS))
    try:
        return ServeConfig(**settings).named(model)
    except (ValueError, TypeError) as e:  # ConfigError is a ValueError: ServeConfig's own messages
        raise ConfigError(str(e)) from None


def _replica_app(model, dtype: str, activations: str, threads: int, config: ServeConfig):
    """The server's app as a replica runs it, with the X-Replica header on every response."""
    from ray import serve

    from ..model.forward import set_threads
    from ..model.models import resolve_model
    from ..text.tokenizer import load_tokenizer
    from .app import create_app

    set_threads(threads)
    w, path, _ = resolve_model(model, dtype, activations)
    app = create_app(w, load_tokenizer(path), config)
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

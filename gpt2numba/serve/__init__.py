"""An OpenAI-compatible HTTP server with continuous batching (the optional extra [serve]).

    gpt2numba serve --model PATH --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 16}'

The HTTP handlers only check, submit and await: one engine thread owns the weights
and runs one forward pass a step over every sequence in flight (batching.Batch), as
llama.cpp's server slots and vLLM's engine loop do. A request's sequences join at
the next step boundary, after their prefill; a client that goes away frees them at
the next step, and its caches go with them. Beyond --max-batch sequences, choices wait in a
queue (--max-queue requests, --max-queued-choices choices) and take free places round-robin across
requests; past that they get 503 with Retry-After.

No HTTP: config.py (ServeConfig: every setting and its default, the flags' too), engine.py (the thread,
steps, stop strings), jobs.py (what it works on: a request, its choices; the Watcher it tells; a fault's
status), events.py (what it hands each request: Text, Finish, Done, Failed), admission.py (limits, the
round-robin queue), logprobs.py (OpenAI's log-probabilities as JSON text), metrics.py (GET /metrics's
registry, prometheus-client: the engine tells it what happens through jobs.Watcher and imports none of it).
HTTP: requests.py (parsing), responses.py (the JSON of a response), app.py (the routes, server-sent events;
imports Starlette), connections.py and server.py (uvicorn: read deadlines, a cap on connections, the
shutdown). The package's names load their modules on first use, so importing the engine needs no web framework.
"""

import importlib
import importlib.util

# Every name loads its module on first use: the command line reads ServeConfig's flags for every command, and
# a command that serves nothing imports no engine, no asyncio, no web framework (0.07-0.1 s of its start).
_MODULE_OF = {"ServeConfig": ".config", "LOGPROB_ROWS": ".engine", "Engine": ".engine", "QueueFull": ".engine",
              "Completion": ".jobs", "Job": ".jobs", "Done": ".events", "Failed": ".events", "Finish": ".events",
              "Text": ".events", "run": ".server",
              **{name: ".app" for name in ("ApiError", "MAX_LOGPROBS", "MAX_STOPS", "Routes", "create_app",
                                           "parse_completion")}}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a module of the package, as once imported
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

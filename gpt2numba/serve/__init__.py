"""An OpenAI-compatible HTTP server with continuous batching (the optional extra [serve]).

    gpt2numba serve --model PATH --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 16}'

The HTTP handlers only check, submit and await: one engine thread owns the weights
and runs one forward pass a step over every sequence in flight (batching.Batch), as
llama.cpp's server slots and vLLM's engine loop do. A request's sequences join at
the next step boundary, after their prefill; a client that goes away frees them at
the next step. Beyond --max-batch sequences, requests wait in a queue of
--max-queue; past that they get 503 with Retry-After.

Two rooms: engine.py (the thread, admission, steps, stop strings, log-probabilities; no HTTP) and
app.py (request parsing, the routes, server-sent events; imports Starlette). The names below are
those gpt2numba.serve has always had; app.py's load on first use, so importing the engine needs no
web framework.
"""

from .engine import LOGPROB_ROWS, Completion, Engine, Job, QueueFull

_APP = ("ApiError", "MAX_LOGPROBS", "MAX_STOPS", "Routes", "create_app", "parse_completion", "run")

__all__ = ["Completion", "Engine", "Job", "QueueFull", "LOGPROB_ROWS", *_APP]


def __getattr__(name: str):
    if name in _APP:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

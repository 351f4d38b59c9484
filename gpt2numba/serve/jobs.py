"""What the engine thread works on and what it tells, as records: a checked request (Completion), the request
inside the server (Job) and each of its sequences (Choice); the Watcher it tells as it goes; and how a request's
fault is told to its client (failure: 400 for the client's own error, 500 for anything else). No thread and no
HTTP here: engine.py runs them, app.py answers with them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from ..decoding.batching import Sequence, SharedPrompt
from ..decoding.constraints import Constraint
from ..decoding.sample import Sampler
from ..errors import GrammarError, SamplingError
from .events import Event

__all__ = ["CLIENT_ERRORS", "Choice", "Completion", "Job", "Watcher", "failure"]

# What a request's own settings cause during its work: settings that leave its sampler no token, a constraint
# llguidance gives up on. Told to its client as they are (400); anything else is the server's (500).
CLIENT_ERRORS = (SamplingError, GrammarError)


@dataclasses.dataclass(frozen=True)
class Completion:
    """A checked POST /v1/completions body."""

    prompts: list[list[int]]  # token ids of each prompt
    max_tokens: int
    sampler: Sampler
    n: int  # choices returned per prompt
    best_of: int  # choices run per prompt (>= n): the n most likely of them (Choice.logprob) are returned
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token; None: no log-probabilities
    echo: bool
    ignore_eos: bool
    constraint: Constraint | None = None  # structured output: every choice's text kept inside it


class Watcher:
    """What the engine tells as it goes, on its own thread: metrics.py's Metrics counts it for GET /metrics;
    this one, the default, forgets it. Each call comes at most once a step or once a choice, never once a
    token, and before the events it concerns go out (a client that has its answer and then asks
    /metrics finds it counted)."""

    def started(self, prompt_tokens: int) -> None:
        """A choice started, with a prompt of so many tokens (each choice takes in its own prompt)."""

    def step(self, generated_tokens: int) -> None:
        """A step generated so many tokens (one for each sequence in it)."""

    def first_token(self, seconds: float) -> None:
        """A request's first token came out ``seconds`` after the request was submitted."""

    def choice_done(self, seconds_per_token: float) -> None:
        """A choice of two tokens or more ended: the mean time between its tokens."""

    def request_done(self, seconds: float) -> None:
        """Every choice of a request ended, ``seconds`` after the request was submitted."""


@dataclasses.dataclass(eq=False)
class Choice:
    """One sequence of a request, as the engine thread sees it from its start to its end."""

    index: int  # prompt index x best_of + j (OpenAI's choice index when best_of = n)
    prompt: int  # index into the request's prompts
    decode: object  # Tokenizer.stream_decoder(): id -> text, holding back split characters
    held: str = ""  # text held back: it may be the start of a stop string
    tokens: int = 0
    logprob: float = 0.0  # the sum of its tokens' log-probabilities, with best_of > n (which ranks by it)
    first: float = 0.0  # time.perf_counter() at its first token
    sequence: Sequence | None = None


class Job:
    """A request inside the server. The engine thread queues events in ``outbox``; the handler awaits them.

    Events (events.py): Text and Finish of each choice, then Done once every choice has finished, or Failed when the
    engine gives up on it. Its choices are counted, not built: choice i (prompt i // best_of) exists only from
    its start to its end. With best_of > n, every choice runs and finishes; the response keeps the n with the
    highest logprob of each prompt.
    """

    def __init__(self, request: Completion, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.choices = len(request.prompts) * request.best_of
        self.started = 0  # choices started, in index order (admission.Waiting counts them)
        self.unfinished = self.choices
        self.tokens = 0  # tokens out, over every choice
        self.since = time.perf_counter()
        self.outbox: list[Event] = []  # events not yet handed to the event loop (the engine thread's)
        self.echoed: dict[int, tuple] = {}  # prompt -> its echo (text, Piece), until its last choice starts
        self.shared: dict[int, SharedPrompt] = {}  # prompt -> its prefill shared by its choices, likewise


def failure(error: Exception) -> tuple[str, int]:
    """The message and HTTP status of a request failed by ``error`` in its own work: a client's error
    (CLIENT_ERRORS) with its message (400), anything else as an internal error that names it (500)."""
    if isinstance(error, CLIENT_ERRORS):
        return str(error), 400
    return f"internal error: {type(error).__name__}: {error}", 500

"""The events the engine thread hands a request's handler (jobs.Job.events): Text and Finish for each
choice, then Done, or Failed when the engine gives up on the request. Small typed records, matched by type
(isinstance) in app.py and responses.py; no HTTP here.
"""

from __future__ import annotations

import dataclasses

from .logprobs import Piece

__all__ = ["Done", "Event", "Failed", "Finish", "Text"]


@dataclasses.dataclass(frozen=True, slots=True)
class Text:
    """The next text of a choice: its echoed prompt, or what one token adds (empty while it may begin a stop
    string or a character is cut short), with its log-probabilities (None without logprobs)."""

    choice: int  # prompt index x best_of + j
    text: str
    logprobs: Piece | None


@dataclasses.dataclass(frozen=True, slots=True)
class Finish:
    """A choice has ended: why (OpenAI's finish_reason: "stop" or "length"), its tokens, and the sum of their
    log-probabilities (with best_of > n, which ranks by it; else 0)."""

    choice: int
    reason: str
    tokens: int
    logprob: float


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """Every choice of the request has finished."""


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """The engine gives up on the request: the error's message and its HTTP status (400: its own settings failed
    it during the work; 500; 503 at shutdown)."""

    message: str
    status: int


Event = Text | Finish | Done | Failed

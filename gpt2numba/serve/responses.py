"""Completions as JSON text: a whole response built choice by choice, and the chunks of a stream.

The log-probabilities arrive serialised (logprobs.Piece, from the engine thread), so nothing here
serialises them again: a finished choice becomes its JSON text at once and its pieces are dropped, and the
whole response is sent as those texts in order, never joined into one string. The work the event loop
does for a response is concatenation, a choice at a time.
"""

from __future__ import annotations

import json

from starlette.responses import Response, StreamingResponse

from .jobs import Completion
from .events import Finish, Text
from .logprobs import Piece, as_json


def json_response(content, status: int = 200, headers: dict | None = None) -> Response:
    """JSON with non-ASCII escaped: any string a client sent (a lone surrogate too) can be echoed back."""
    return Response(json.dumps(content), status_code=status, headers=headers, media_type="application/json")


def inspection_json(inspection, model: str) -> str:
    """POST /v1/inspect's answer: every token of a tokenview.Inspection, its perplexity and its count."""
    return json.dumps({"object": "inspection", "model": model, "tokens": inspection.tokens(),
                       "perplexity": inspection.perplexity, "usage": {"prompt_tokens": len(inspection.ids)}})


def usage(r: Completion, completion_tokens: int) -> dict:
    prompt_tokens = sum(map(len, r.prompts))  # once per prompt, whatever n
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_json(index: int, text: str, logprobs: str, reason: str | None) -> str:
    """One of OpenAI's choices; logprobs: its JSON text ("null" for none)."""
    return f'{{"index": {index}, "text": {json.dumps(text)}, "logprobs": {logprobs}, "finish_reason": {json.dumps(reason)}}}'


class Whole:
    """A response that is not streamed, assembled from the job's events. With best_of > n, once the best_of
    choices of a prompt have finished, the n with the highest sum of log-probabilities become its choices,
    the most likely first (as vLLM's), and the others are dropped; usage counts the tokens of all."""

    def __init__(self, r: Completion, head: dict):
        self.r, self.head = r, head
        self.tokens = 0
        self._text: dict[int, list[str]] = {}  # unfinished choice -> its text so far, in pieces
        self._pieces: dict[int, list[Piece]] = {}  # unfinished choice -> its log-probabilities so far
        self._done: list[bytes | None] = [None] * (len(r.prompts) * r.n)  # finished choices, as JSON
        self._ranked: dict[int, list[tuple]] = {}  # prompt -> its finished candidates, with best_of > n

    def add(self, event: Text | Finish) -> None:
        i = event.choice
        if isinstance(event, Text):
            self._text.setdefault(i, []).append(event.text)
            if event.logprobs is not None:
                self._pieces.setdefault(i, []).append(event.logprobs)
        else:
            self.tokens += event.tokens
            logprobs = as_json(self._pieces.pop(i, []), 0) if self.r.logprobs is not None else "null"
            text, (n, best_of), reason = "".join(self._text.pop(i, [])), (self.r.n, self.r.best_of), event.reason
            if best_of == n:
                self._done[i] = choice_json(i, text, logprobs, reason).encode()
                return
            prompt = i // best_of
            ranked = self._ranked.setdefault(prompt, [])
            ranked.append((-event.logprob, i, text, logprobs, reason))
            if len(ranked) == best_of:  # most likely first; a tie: the earlier choice
                for rank, (_, _, text, logprobs, reason) in enumerate(sorted(self._ranked.pop(prompt))[:n]):
                    self._done[prompt * n + rank] = choice_json(prompt * n + rank, text, logprobs, reason).encode()

    @property
    def complete(self) -> bool:
        return all(choice is not None for choice in self._done)

    def response(self) -> StreamingResponse:
        """The response, sent a choice at a time (with its length: no chunked encoding)."""
        head = json.dumps(self.head)[:-1].encode()
        tail = f'], "usage": {json.dumps(usage(self.r, self.tokens))}}}'.encode()
        parts = [head, b', "choices": [', *_commas(self._done), tail]
        self._done = []

        async def body():
            while parts:
                yield parts.pop(0)

        return StreamingResponse(body(), media_type="application/json",
                                 headers={"content-length": str(sum(map(len, parts)))})


def _commas(items: list[bytes]) -> list[bytes]:
    out = []
    for item in items:
        if out:
            out.append(b", ")
        out.append(item)
    return out


class Chunks:
    """A streamed response: each event of the job as one server-sent event."""

    def __init__(self, r: Completion, head: dict):
        self.r = r
        self._head = json.dumps(head)[:-1]  # '{"id": ..., "model": "..."' (the object left open)
        self.tokens = 0
        self._sent: dict[int, int] = {}  # choice -> characters of text sent: where its next token's offset starts

    def event(self, event: Text | Finish) -> str:
        i = event.choice
        if isinstance(event, Text):
            logprobs = "null"
            if self.r.logprobs is not None:
                logprobs = as_json([event.logprobs] if event.logprobs is not None else [], self._sent.get(i, 0))
            self._sent[i] = self._sent.get(i, 0) + len(event.text)
            choice = choice_json(i, event.text, logprobs, None)
        else:  # a stream has best_of = n: nothing to rank
            self.tokens += event.tokens
            self._sent.pop(i, None)
            choice = choice_json(i, "", "null", event.reason)
        return f'data: {self._head}, "choices": [{choice}]}}\n\n'

    def usage(self) -> str:
        return f'data: {self._head}, "choices": [], "usage": {json.dumps(usage(self.r, self.tokens))}}}\n\n'

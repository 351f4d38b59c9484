"""What a request may cost, and the order in which waiting requests get places in the batch.

The limits (ServeConfig's max_queue, max_choices, max_queued_choices and max_response_mb) count what costs:
the choices a request runs (prompts x best_of, which is n unless asked), the choices waiting in the queue,
and the size of the response. A request over a per-request limit is
refused (400) whatever the load; one that would overfill the queue is turned away for now (503,
Retry-After). Every refusal names the limit and the command-line flag that sets it.

Waiting requests take free places in the batch round-robin, one choice at a time: a request of one
choice that arrives behind one of 128 starts at the next free place, not after the 128 (llama.cpp's
server gives each request a slot, vLLM's scheduler a budget per step; this is the same fairness for a
batch of whole sequences). The engine calls these under its lock; no HTTP here.
"""

from __future__ import annotations

import collections

from .config import ServeConfig


# Bytes of JSON per token of a response, generous: the text, and with log-probabilities the token, its
# log-probability, its offset, and each alternative ("token": -1.2345678901234567). Measured with
# GPT-2 small: 610 bytes a token with 20 alternatives, against 8 + 48 + 20 x 40 = 856 here.
TEXT_BYTES, LOGPROB_BYTES, ALTERNATIVE_BYTES = 8, 48, 40


class Refused(Exception):
    """A request over a limit: status 400 (never acceptable) or 503 (not now); param: the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class QueueFull(Refused):
    def __init__(self, message: str = "the queue is full"):
        super().__init__(503, message)


def response_bytes(prompt_lengths: list[int], n: int, max_tokens: int, logprobs: int | None, echo: bool) -> int:
    """An upper estimate of a response's JSON: every choice's tokens (the echoed prompt's too) times the
    bytes of a token with its log-probabilities."""
    per_token = TEXT_BYTES + (0 if logprobs is None else LOGPROB_BYTES + ALTERNATIVE_BYTES * logprobs)
    tokens = n * (len(prompt_lengths) * max_tokens + (sum(prompt_lengths) if echo else 0))
    return per_token * tokens


def check_choices(limits: ServeConfig, prompts: int, n: int, field: str = "n") -> None:
    """Refused(400) for more than --max-choices choices (prompts x n, n the ``field`` best_of if it is
    larger) in one request."""
    if prompts * n > limits.max_choices:
        raise Refused(400, f"this request asks for {prompts * n} choices ({prompts} prompts x {field} = {n}); "
                      f"the server allows {limits.max_choices} per request (--max-choices)", field)


def check_cache(positions: int | None, prompt_lengths: list[int], max_tokens: int) -> None:
    """Refused(400) for a choice that would need more cache positions than the server keeps for all
    (--kv-cache-mb, as ``positions``; None: no bound): it could never start."""
    longest = max(prompt_lengths, default=0) + max_tokens
    if positions is not None and max_tokens and longest > positions:
        raise Refused(400, f"a choice of this request needs up to {longest} cache positions (its prompt and "
                      f"max_tokens); the server keeps {positions} for every sequence in flight (--kv-cache-mb)",
                      "max_tokens")


def check_size(limits: ServeConfig, prompt_lengths: list[int], n: int, max_tokens: int, logprobs: int | None,
               echo: bool, field: str = "n") -> None:
    """Refused(400) for a request over a per-request limit, whatever the load. n: the choices run per prompt
    (best_of, named by ``field``, when larger: the response holds them all until it ranks them)."""
    check_choices(limits, len(prompt_lengths), n, field)
    choices = len(prompt_lengths) * n
    size = response_bytes(prompt_lengths, n, max_tokens, logprobs, echo)
    if size > limits.max_response_mb * 2**20:
        raise Refused(400, f"the response would be about {size / 2**20:.0f} MB ({choices} choices of up to "
                      f"{max_tokens} tokens{', the prompt echoed' if echo else ''}"
                      f"{f', {logprobs} alternatives a token' if logprobs else ''}); the server allows "
                      f"{limits.max_response_mb:g} MB (--max-response-mb): ask for fewer choices, tokens or "
                      f"log-probabilities", "max_tokens")


class Waiting:
    """Requests with choices not yet started, taken round-robin. A job counts its own choices:
    ``choices`` (all of them) and ``started``; nothing is built per choice until it starts."""

    def __init__(self, limits: ServeConfig):
        self.limits = limits
        self._jobs: collections.deque = collections.deque()
        self.choices = 0  # choices waiting, over every job

    def __len__(self) -> int:
        """Requests waiting: each with at least one choice not yet started."""
        return len(self._jobs)

    def add(self, job) -> None:
        """Queue a job's choices; QueueFull (naming the limit and its flag) if the queue cannot take them."""
        waiting = job.choices - job.started
        if len(self._jobs) >= self.limits.max_queue:
            raise QueueFull(f"the server is busy: {len(self._jobs)} requests are waiting already, the most it "
                            f"queues (--max-queue); retry later")
        if self.choices + waiting > self.limits.max_queued_choices:
            raise QueueFull(f"the server is busy: {self.choices} choices are waiting and this request adds "
                            f"{waiting}, over the {self.limits.max_queued_choices} it queues "
                            f"(--max-queued-choices); retry later")
        self._jobs.append(job)
        self.choices += waiting

    def find(self, wanted):
        """The first waiting job for which wanted(job) is true, or None."""
        return next((job for job in self._jobs if wanted(job)), None)

    def peek(self, job=None):
        """(job, choice index) that take(job) would give now, without taking it; None if none waits."""
        if not self._jobs:
            return None
        job = self._jobs[0] if job is None else job
        return job, job.started

    def take(self, job=None):
        """(job, choice index) of the next choice to start: job's if given (a waiting job), else round-robin
        over the jobs; None if none waits."""
        if not self._jobs:
            return None
        if job is None:
            job = self._jobs.popleft()
        else:
            self._jobs.remove(job)
        index = job.started
        job.started += 1
        self.choices -= 1
        if job.started < job.choices:
            self._jobs.append(job)  # its next choice after every other request's
        return job, index

    def remove(self, keep) -> list:
        """Drop the jobs for which keep(job) is false; returns them."""
        dropped = [job for job in self._jobs if not keep(job)]
        if dropped:
            self._jobs = collections.deque(job for job in self._jobs if keep(job))
            self.choices -= sum(job.choices - job.started for job in dropped)
        return dropped

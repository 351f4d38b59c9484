"""The serving engine: one thread owns the weights and the batch (no HTTP here).

Requests come in as checked Completions inside Jobs; the engine thread admits their sequences
into a batching.Batch at step boundaries, runs one forward pass a step over every sequence in
flight, cuts text at stop strings, computes OpenAI's log-probabilities, and hands each step's
events to the requests' event loops. A test or another front end drives it without a web framework
(app.py is the HTTP one).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time

import numpy as np

from ..batching import Batch, Sequence
from ..forward import prefill
from ..kvcache import ModelCache
from ..sample import Sampler
from ..tokenizer import Tokenizer
from ..weights import GPT2Weights

log = logging.getLogger("gpt2numba.serve")

LOGPROB_ROWS = 64  # echo: prompt rows turned into log-probabilities at a time (float64)



@dataclasses.dataclass(frozen=True)
class Completion:
    """A checked POST /v1/completions body."""

    prompts: list[list[int]]  # token ids of each prompt
    max_tokens: int
    sampler: Sampler
    n: int
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives per token; None: no log-probabilities
    echo: bool
    ignore_eos: bool



class QueueFull(Exception):
    pass


@dataclasses.dataclass(eq=False)
class _Choice:
    """One sequence of a request, as the engine thread sees it."""

    index: int  # OpenAI's choice index: prompt index x n + j
    prompt: int  # index into the request's prompts
    decode: object  # Tokenizer.stream_decoder(): id -> text, holding back split characters
    held: str = ""  # text held back: it may be the start of a stop string
    tokens: int = 0
    sequence: Sequence | None = None


class Job:
    """A request inside the server. The engine thread queues events in ``outbox``; the handler awaits them.

    Events: ("text", choice, text, logprobs or None) and ("finish", choice, reason), then ("done",)
    once every choice has finished, or ("error", message) when the engine gives up on it.
    """

    def __init__(self, request: Completion, loop: asyncio.AbstractEventLoop, tokenizer: Tokenizer):
        self.request, self.loop = request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        # choice p x n + j: prompt p's j-th, with a text decoder of its own
        self.choices = [_Choice(p * request.n + j, p, tokenizer.stream_decoder())
                        for p in range(len(request.prompts)) for j in range(request.n)]
        self.unfinished = len(self.choices)
        self.started = time.perf_counter()
        self.outbox: list[tuple] = []  # events not yet handed to the event loop (the engine thread's)
        self.echoed: dict[int, tuple] = {}  # prompt index -> its echo (text, logprobs), for its n choices


def _deliver(items: list[tuple[Job, list[tuple]]]) -> None:
    """On the event loop: each job's events into its queue."""
    for job, events in items:
        for event in events:
            job.events.put_nowait(event)


class Engine:
    """Runs in its own thread: admits waiting choices into the batch, steps it, and reports each token."""

    def __init__(self, w: GPT2Weights, tokenizer: Tokenizer, max_batch: int, max_queue: int):
        self.w, self.tokenizer, self.max_queue = w, tokenizer, max_queue
        self.batch = Batch(w, max_batch)
        self._waiting: collections.deque[tuple[Job, _Choice]] = collections.deque()
        self._owner: dict[Sequence, tuple[Job, _Choice]] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._ready = threading.Event()
        self._emitted: list[Job] = []  # jobs with events in their outbox
        # Every kernel runs on this one thread, the warm-up too: libgomp gives each thread that opens
        # parallel regions a team of its own, and with two teams on two cores it stops spinning between
        # regions (measured: a decode step 19.8 ms instead of 13.1).
        self._thread = threading.Thread(target=self._run, name="gpt2numba-engine", daemon=True)

    # called from the event loop
    def start(self) -> None:
        """Start the engine thread and wait until it has loaded the kernels (from Numba's cache, or compiling)."""
        self._thread.start()
        self._ready.wait()

    def submit(self, job: Job) -> None:
        """Queue a request's choices; QueueFull when --max-queue requests are waiting already."""
        with self._wake:
            if self.queued >= self.max_queue:
                raise QueueFull
            self._waiting.extend((job, choice) for choice in job.choices)
            self._wake.notify()

    def cancel(self, job: Job) -> None:
        """Stop a request: its sequences leave the batch at the next step."""
        job.cancelled = True
        with self._wake:
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def queued(self) -> int:
        """Requests with a choice not yet started."""
        return len({id(job) for job, _ in list(self._waiting)})

    @property
    def active(self) -> int:
        return len(self.batch.sequences)

    # the engine thread
    def _warm_up(self) -> None:
        ids = [self.tokenizer.eot_id] * 3
        prefill(ids, self.w, ModelCache(self.w.config, max_len=3), logits="all")
        sequence = self.batch.add(ids, max_new_tokens=2, sampler=Sampler(0.0), rng=np.random.default_rng(0))
        while sequence in self.batch.sequences:
            self.batch.step()

    def _run(self) -> None:
        try:
            self._warm_up()
        finally:
            self._ready.set()
        while True:
            with self._wake:
                while not (self._stopping or self._waiting or self.batch.sequences):
                    self._wake.wait()
                if self._stopping:
                    break
            self._drop_cancelled()
            self._admit()
            try:
                steps = self.batch.step()
            except Exception as e:  # a bug, not a bad request: those were refused before queueing
                log.exception("engine step failed")
                for job in {job for job, _ in self._owner.values()}:
                    self._fail(job, f"internal error: {type(e).__name__}: {e}")
                self._flush()
                continue
            for sequence, token, done, row in steps:
                job, choice = self._owner[sequence]
                self._on_token(job, choice, token, done, row)
            self._flush()
        for job in {job for job, _ in [*self._owner.values(), *self._waiting]}:
            self._fail(job, "the server is shutting down")
        self._flush()

    def _emit(self, job: Job, *event) -> None:
        if not job.outbox:
            self._emitted.append(job)
        job.outbox.append(event)

    def _flush(self) -> None:
        """Hand this step's events to the event loops: one wake-up per loop, not one per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for job in self._emitted:
            by_loop.setdefault(job.loop, []).append((job, job.outbox))
            job.outbox = []
        self._emitted = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                for job, _ in items:
                    job.cancelled = True

    def _drop_cancelled(self) -> None:
        for sequence, (job, _) in list(self._owner.items()):
            if job.cancelled:
                self.batch.remove(sequence)
                del self._owner[sequence]
        with self._wake:
            self._waiting = collections.deque((job, c) for job, c in self._waiting if not job.cancelled)

    def _admit(self) -> None:
        """Waiting choices into free places of the batch; echo's prompt log-probabilities on the way."""
        while not self.batch.full:
            with self._wake:
                if not self._waiting:
                    return
                job, choice = self._waiting.popleft()
            try:
                self._start(job, choice)
            except Exception as e:  # a bug: this request fails, the others go on
                log.exception("starting a request failed")
                self._fail(job, f"internal error: {type(e).__name__}: {e}")

    def _start(self, job: Job, choice: _Choice) -> None:
        r = job.request
        ids = r.prompts[choice.prompt]
        if r.echo:
            if choice.prompt not in job.echoed:  # once for the n choices of a prompt, whenever they start
                job.echoed[choice.prompt] = (self.tokenizer.decode(ids), self._prompt_logprobs(ids, r.logprobs))
            self._emit(job, "text", choice.index, *job.echoed[choice.prompt])
        if r.max_tokens == 0:
            self._finish(job, choice, "length")
            return
        rng = np.random.default_rng(None if r.seed is None else [r.seed, choice.index])
        choice.sequence = self.batch.add(ids, max_new_tokens=r.max_tokens, sampler=r.sampler, rng=rng,
                                         stop_at_eos=not r.ignore_eos)
        self._owner[choice.sequence] = (job, choice)

    def _on_token(self, job: Job, choice: _Choice, token: int, done: bool, row: np.ndarray) -> None:
        r = job.request
        choice.tokens += 1
        logprobs = self._logprobs(row[None], [token], r.logprobs) if r.logprobs is not None else None
        eos = token == self.tokenizer.eot_id and not r.ignore_eos
        text = choice.held + ("" if eos else choice.decode(token))
        if done:
            text += choice.decode(None)  # bytes of a character cut short
        cut = min((i for i in (text.find(s) for s in r.stop) if i >= 0), default=-1)
        if cut >= 0:  # a stop string: the text ends before it
            text, done, reason = text[:cut], True, "stop"
            if choice.sequence in self.batch.sequences:
                self.batch.remove(choice.sequence)
        else:
            reason = "stop" if eos else "length"
            keep = 0 if done else _stop_prefix(text, r.stop)
            text, choice.held = text[:len(text) - keep], text[len(text) - keep:]
        self._emit(job, "text", choice.index, text, logprobs)
        if done:
            del self._owner[choice.sequence]
            self._finish(job, choice, reason)

    def _finish(self, job: Job, choice: _Choice, reason: str) -> None:
        self._emit(job, "finish", choice.index, reason, choice.tokens)
        job.unfinished -= 1
        if job.unfinished == 0:
            self._emit(job, "done")

    def _fail(self, job: Job, message: str) -> None:
        for sequence, (owner, _) in list(self._owner.items()):
            if owner is job:
                if sequence in self.batch.sequences:
                    self.batch.remove(sequence)
                del self._owner[sequence]
        with self._wake:
            self._waiting = collections.deque((j, c) for j, c in self._waiting if j is not job)
        self._emit(job, "error", message)

    def _prompt_logprobs(self, ids: list[int], k: int | None) -> dict | None:
        """Echo: each prompt token's log-probability given those before it (None for the first)."""
        if k is None:
            return None
        logits = prefill(ids, self.w, ModelCache(self.w.config, max_len=len(ids)), logits="all")  # (T, vocab)
        rows = self._logprobs(logits[:-1], ids[1:], k)
        first = self.tokenizer.decode(ids[:1])
        return {"tokens": [first, *rows["tokens"]], "token_logprobs": [None, *rows["token_logprobs"]],
                "top_logprobs": [None, *rows["top_logprobs"]]}

    def _logprobs(self, logits: np.ndarray, tokens: list[int], k: int) -> dict:
        """OpenAI's logprobs lists for rows of logits (R, vocab) and the token chosen after each."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        decode = self.tokenizer.decode
        for r0 in range(0, len(tokens), LOGPROB_ROWS):
            z = logits[r0:r0 + LOGPROB_ROWS].astype(np.float64)  # (rows, vocab)
            peak = z.max(axis=1, keepdims=True)
            z -= peak + np.log(np.exp(z - peak).sum(axis=1, keepdims=True))  # log-softmax
            for row, token in zip(z, tokens[r0:r0 + LOGPROB_ROWS]):
                out["tokens"].append(decode([token]))
                out["token_logprobs"].append(float(row[token]))
                top = np.argpartition(-row, k - 1)[:k] if k else np.zeros(0, np.int64)
                top = top[np.lexsort((top, -row[top]))]
                out["top_logprobs"].append({decode([int(t)]): float(row[t]) for t in top})
        return out


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins a stop string: held back until the next token."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)


"""The serving engine: one thread owns the weights and the batch (no HTTP here).

Requests come in as checked Completions inside Jobs (jobs.py: the records of a request and its choices); the
engine thread admits their choices into a batching.Batch at step boundaries (round-robin across requests:
admission.py), runs one forward pass a step over every sequence in flight, cuts text at stop strings, computes
OpenAI's log-probabilities (logprobs.py), and hands each step's events to the requests' event loops. Between two steps it runs one
of the calls waiting (Engine.call: a forward pass of its own, such as /v1/inspect's), so every forward pass
of the server runs on this thread, one at a time. A test or another front end drives it without a web
framework (app.py is the HTTP one). It tells a Watcher (metrics.py's Metrics) what only it knows: tokens in
and out, and when a request's first token and its end come.

Memory follows the batch: nothing is built for a choice until it starts, and a sequence's cache goes
the moment it leaves (finished, cancelled or failed), whoever still holds the job.

A request's fault is its own: what its sequences' work raises in a step (sampling, constraint, draft: the
batch's Faults) or its handling of their tokens (stop strings, log-probabilities) fails that request alone,
its other choices cancelled, and the other requests go on as without it. A client's error (jobs.CLIENT_ERRORS)
is a 400 with its message, anything else a 500 that names it, logged. What the step's forward pass raises fails
every request in flight.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

import numpy as np

from ..decoding import speculative
from ..decoding.batching import Batch, Fault, Sequence, SharedPrompt
from ..decoding.prefixes import PrefixCache
from ..decoding.sample import Sampler
from ..model.forward import prefill
from ..model.kvcache import ModelCache
from ..model.weights import GPT2Weights
from ..text.scoring import log_softmax
from ..text.tokenizer import Tokenizer
from .admission import QueueFull, Waiting
from .config import ServeConfig
from .events import Done, Event, Failed, Finish, Text
from .jobs import Choice, Completion, Job, Watcher, failure
from .logprobs import LOGPROB_ROWS, Logprobs, Piece

log = logging.getLogger("gpt2numba.serve")

__all__ = ["Completion", "Engine", "Job", "LOGPROB_ROWS", "QueueFull", "Watcher"]

SHUTTING_DOWN = "the server is shutting down"


def _deliver(items: list[tuple[Job, list[Event]]]) -> None:
    """On the event loop: each job's events into its queue."""
    for job, events in items:
        for event in events:
            job.events.put_nowait(event)


class Engine:
    """Runs in its own thread: admits waiting choices into the batch, steps it, and reports each token."""

    def __init__(self, w: GPT2Weights, tokenizer: Tokenizer, config: ServeConfig | None = None, *,
                 metrics: Watcher | None = None, **settings):
        """config: the server's settings (the engine reads max_batch, max_step_tokens, prefix_cache_mb, kv_dtype
        and the limits), or ServeConfig's defaults with ``settings`` (its fields, as keywords) over them."""
        self.config = config = ServeConfig.made(config, settings)
        self.w, self.tokenizer = w, tokenizer
        self.metrics = metrics if metrics is not None else Watcher()
        kv_dtype, prefix_bytes = config.kv_dtype, int(config.prefix_cache_mb * 2**20)
        self.prefixes = PrefixCache(w.config, prefix_bytes, kv_dtype) if config.prefix_cache_mb else None
        self.speculation = spec = speculative.plan(w, config.draft, config.num_speculative_tokens, config.prompt_lookup)
        position = ModelCache(w.config, 1, kv_dtype).nbytes + (spec.position_bytes(kv_dtype) if spec else 0)  # K, V
        self.max_positions = int(config.kv_cache_mb * 2**20) // position if config.kv_cache_mb else None
        self.batch = Batch(w, config.max_batch, self.prefixes, kv_dtype, self.max_positions, spec)  # in kv_dtype
        self.logprobs = Logprobs(w, tokenizer, kv_dtype)
        self.waiting = Waiting(config)
        self._owner: dict[Sequence, tuple[Job, Choice]] = {}
        self._wake = threading.Condition()
        self._stopping = self._draining = False
        self.preemptions = 0  # choices paused for another request's (_pause_one)
        self._ready = threading.Event()
        self._emitted: list[Job] = []  # jobs with events in their outbox
        self._calls: collections.deque = collections.deque()  # (function, loop, future) to run between steps
        # Every forward pass runs on this one thread, the warm-up's too: a parallel region that starts while
        # another runs, on another thread, runs on its caller alone (pool.py).
        self._thread = threading.Thread(target=self._run, name="gpt2numba-engine", daemon=True)

    # called from the event loop
    def start(self) -> None:
        """Start the engine thread and wait until it has loaded the kernels (from Numba's cache, or compiling)."""
        self._thread.start()
        self._ready.wait()

    def submit(self, job: Job) -> None:
        """Queue a request's choices; QueueFull (its message names the limit) if the queue cannot take them."""
        with self._wake:
            if self._draining or self._stopping:
                raise QueueFull(f"{SHUTTING_DOWN}; retry on another server")
            self.waiting.add(job)
            self._wake.notify()

    def call(self, function, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Run function() on this thread between two steps, one call a step: work of a forward pass of its
        own (an inspection), which the kernels' threads allow only here. Returns a future of ``loop`` that
        gets its result or its exception; one cancelled before its turn does not run. QueueFull when
        max_queue calls wait already, or when the server is shutting down."""
        future = loop.create_future()
        with self._wake:
            if self._draining or self._stopping:
                raise QueueFull(f"{SHUTTING_DOWN}; retry on another server")
            if len(self._calls) >= self.config.max_queue:
                raise QueueFull(f"the server is busy: {len(self._calls)} calls are waiting already, the most it "
                                f"queues (--max-queue); retry later")
            self._calls.append((function, loop, future))
            self._wake.notify()
        return future

    def cancel(self, job: Job) -> None:
        """Stop a request: its sequences leave the batch at the next step."""
        job.cancelled = True
        with self._wake:
            self._wake.notify()

    def drain(self) -> None:
        """Shutting down: take no new request, and fail (503) those with no choice started yet; requests
        under way go on, their later choices too."""
        with self._wake:
            self._draining = True
            self._wake.notify()

    def stop(self) -> None:
        """Fail (503) every request left, and end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def busy(self) -> bool:
        """A request is in flight or waiting, or a call waits."""
        return bool(self._owner) or len(self.waiting) > 0 or bool(self._calls)

    @property
    def queued(self) -> int:
        """Requests with a choice not yet started."""
        return len(self.waiting)

    @property
    def queued_choices(self) -> int:
        """Choices not yet started, over every request."""
        return self.waiting.choices

    @property
    def active(self) -> int:
        """Sequences in flight: in the batch, or paused for a while to give a place to another request."""
        return len(self.batch.sequences) + len(self.batch.paused)

    @property
    def positions(self) -> tuple[int, int]:
        """Cache positions of the sequences in flight after the last step: (written into their own arrays, read
        in place from others'): Batch.positions."""
        return self.batch.in_flight

    @property
    def paused(self) -> int:
        """Sequences paused (the batch's places given to requests with nothing in flight), to resume."""
        return len(self.batch.paused)

    # the engine thread
    def _warm_up(self) -> None:
        ids = [self.tokenizer.eot_id] * 3
        prefill(ids, self.w, ModelCache(self.w.config, max_len=3, dtype=self.batch.kv_dtype), logits="all")
        sequence = self.batch.add(ids, max_new_tokens=3, sampler=Sampler(0.0), rng=np.random.default_rng(0))  # drafts 1
        while sequence in self.batch.sequences:
            self.batch.step()
        self.batch.stats = speculative.Stats()  # (/metrics counts the requests' drafts alone)

    def _run(self) -> None:
        try:
            self._warm_up()
        finally:
            self._ready.set()
        while self._next_step():
            pass
        jobs = {job for job, _ in self._owner.values()} | set(self.waiting.remove(lambda job: False))
        for job in jobs:
            self._fail(job, SHUTTING_DOWN, 503)
        self._flush()
        with self._wake:
            calls, self._calls = list(self._calls), collections.deque()
        for _, loop, future in calls:
            _settle(loop, future, None, QueueFull(SHUTTING_DOWN))

    def _next_step(self) -> bool:
        """Wait for work, then admit and run one step; False once stopping. (A method, so that nothing of
        the step, a sequence or a row of logits, stays referenced while the thread waits.)"""
        with self._wake:
            while not (self._stopping or len(self.waiting) or self.batch.sequences or self.batch.paused
                       or self._calls):
                self._wake.wait()
            if self._stopping:
                return False
            call = self._calls.popleft() if self._calls else None
        if call is not None:
            self._call(*call)
        self._drop_cancelled()
        self._admit()
        try:
            steps = self.batch.step(self.config.max_step_tokens)
        except Exception as e:  # a bug, not a bad request: those were refused before queueing
            log.exception("engine step failed")
            for job in {job for job, _ in self._owner.values()}:
                self._fail(job, f"internal error: {type(e).__name__}: {e}")
            self._flush()
            return True
        delivered = 0
        for out in steps:
            if isinstance(out, Fault):
                if out.sequence in self._owner:  # (not one whose request failed earlier in this step)
                    self._fault(self._owner[out.sequence][0], out.error)
                continue
            sequence, token, done, row = out
            if sequence in self._owner:  # (not one a stop string or a fault ended earlier in this step)
                job, choice = self._owner[sequence]
                try:
                    self._on_token(job, choice, token, done, row)
                    delivered += 1
                except Exception as e:  # (its stop strings', its log-probabilities': this request's alone)
                    self._fault(job, e)
        self.metrics.step(delivered)
        self._flush()
        return True

    @staticmethod
    def _call(function, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        if future.cancelled():  # (read from this thread: at worst it runs for nobody)
            return
        try:
            result, error = function(), None
        except Exception as e:  # the caller's to answer (a bug: the handler's 500)
            result, error = None, e
        _settle(loop, future, result, error)

    def _emit(self, job: Job, event: Event) -> None:
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

    def _leave(self, sequence: Sequence) -> None:
        """A sequence leaves: out of the batch (its cache freed there) and out of its choice."""
        if sequence in self.batch.sequences or sequence in self.batch.paused:
            self.batch.remove(sequence)
            self.batch.in_flight = self.batch.positions()  # (what /metrics reads, while the engine may wait)
        _, choice = self._owner.pop(sequence)
        choice.sequence = None

    def _drop_cancelled(self) -> None:
        for sequence, (job, _) in list(self._owner.items()):
            if job.cancelled:
                self._leave(sequence)
        with self._wake:
            cancelled = self.waiting.remove(lambda job: not job.cancelled)
            unstarted = self.waiting.remove(lambda job: job.started > 0) if self._draining else []
        for job in cancelled:  # what its choices still to start would have shared
            job.echoed.clear()
            job.shared.clear()
        for job in unstarted:
            self._fail(job, SHUTTING_DOWN, 503)

    def _admit(self) -> None:
        """Free places of the batch to a request with nothing in flight first, then to paused choices, then to
        waiting choices round-robin (their prompts run in chunks of the step's budget); echo's
        log-probabilities on the way. With no place free, a request with nothing in flight takes one from the
        request with the most places, if it holds two or more: that choice pauses, its cache kept, and
        resumes when a place frees. So a small request never waits for a large one to finish."""
        while True:
            in_flight = {self._owner[seq][0] for seq in (*self.batch.sequences, *self.batch.paused)}
            with self._wake:
                newcomer = self.waiting.find(lambda job: job not in in_flight)
            if newcomer is None and self.batch.paused and not self.batch.full:
                self.batch.resume(self.batch.paused[0])
                continue
            if self.batch.full and (newcomer is None or not self._pause_one()):
                return
            with self._wake:
                head = self.waiting.peek(newcomer)
                if head is None or not self.batch.admits(self._need(*head)):
                    return  # (it waits in the queue until sequences leave: check_cache saw that it fits alone)
                head = self.waiting.take(newcomer)
            job, index = head
            try:
                self._start(job, index)
            except Exception as e:  # this request fails, the others go on
                self._fault(job, e)

    def _need(self, job: Job, index: int) -> int:
        """The cache positions choice ``index`` of ``job`` would reserve if it started now (Batch.need)."""
        r = job.request
        if r.max_tokens == 0:
            return 0
        prompt = index // r.best_of
        return self.batch.need(r.prompts[prompt], r.max_tokens, job.shared.get(prompt))

    def _pause_one(self) -> bool:
        """Pause the latest decoding sequence of the request with the most places, if it holds two or more."""
        places = collections.Counter(self._owner[seq][0] for seq in self.batch.sequences)
        job, held = places.most_common(1)[0] if places else (None, 0)
        decoding = [seq for seq in self.batch.sequences if self._owner[seq][0] is job and seq.new_tokens > 0]
        if held < 2 or not decoding:
            return False
        self.batch.pause(decoding[-1])
        self.preemptions += 1
        return True

    def _start(self, job: Job, index: int) -> None:
        r = job.request
        choice = Choice(index, index // r.best_of, self.tokenizer.stream_decoder())
        ids = r.prompts[choice.prompt]
        self.metrics.started(len(ids))
        if r.echo:
            if choice.prompt not in job.echoed:  # once for the choices of a prompt, whenever they start
                job.echoed[choice.prompt] = (self.tokenizer.decode(ids), self._echo_logprobs(job, choice.prompt))
            last = index % r.best_of == r.best_of - 1
            echo = job.echoed.pop(choice.prompt) if last else job.echoed[choice.prompt]
            self._emit(job, Text(choice.index, *echo))
        if r.max_tokens == 0:
            self._finish(job, choice, "length")
            return
        rng = np.random.default_rng(None if r.seed is None else [r.seed, choice.index])
        shared = job.shared.get(choice.prompt)  # the prompt run once for its choices, whenever they start
        if shared is None and r.best_of > 1:
            shared = job.shared[choice.prompt] = SharedPrompt(r.best_of)
        if shared is not None and index % r.best_of == r.best_of - 1:
            del job.shared[choice.prompt]
        choice.sequence = self.batch.add(ids, max_new_tokens=r.max_tokens, sampler=r.sampler, rng=rng,
                                         stop_at_eos=not r.ignore_eos, shared=shared, constraint=r.constraint)
        self._owner[choice.sequence] = (job, choice)

    def _on_token(self, job: Job, choice: Choice, token: int, done: bool, row: np.ndarray) -> None:
        r = job.request
        choice.tokens += 1
        job.tokens += 1
        if choice.tokens == 1:  # (the clock is read once a choice, not once a token)
            choice.first = time.perf_counter()
            if job.tokens == 1:
                self.metrics.first_token(choice.first - job.since)
        logprobs = self.logprobs.rows(row[None], [token], r.logprobs) if r.logprobs is not None else None
        if r.best_of > r.n:  # the model's own log-probability of the token (not the sampler's), as vLLM ranks
            choice.logprob += logprobs.logprob if logprobs is not None else float(log_softmax(row[None])[0, token])
        # (a constraint lets <|endoftext|> through only where its text may end: there it ends, ignore_eos or not)
        eos = token == self.tokenizer.eot_id and (not r.ignore_eos or r.constraint is not None)
        complete = choice.sequence.complete  # its constraint's text
        text = choice.held + ("" if eos else choice.decode(token))
        if done:
            text += choice.decode(None)  # bytes of a character cut short
        # before min_tokens tokens a stop string ends nothing, as in vLLM (and the sampler bans the eos ids)
        stops = r.stop if choice.tokens > r.sampler.processors.min_new_tokens else ()
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:  # a stop string: the text ends before it
            text, done, reason = text[:cut], True, "stop"
        else:
            reason = "stop" if eos or complete else "length"
            keep = 0 if done else _stop_prefix(text, r.stop)
            text, choice.held = text[:len(text) - keep], text[len(text) - keep:]
        self._emit(job, Text(choice.index, text, logprobs))
        if done:
            self._leave(choice.sequence)
            self._finish(job, choice, reason)

    def _finish(self, job: Job, choice: Choice, reason: str) -> None:
        self._emit(job, Finish(choice.index, reason, choice.tokens, choice.logprob))
        job.unfinished -= 1
        now = time.perf_counter()
        if choice.tokens > 1:
            self.metrics.choice_done((now - choice.first) / (choice.tokens - 1))
        if job.unfinished == 0:
            self._emit(job, Done())
            self.metrics.request_done(now - job.since)

    def _fault(self, job: Job, error: Exception) -> None:
        """A request's own work raised ``error``: it fails alone, with jobs.failure's message and status (an
        internal error logged)."""
        message, status = failure(error)
        if status == 500:
            log.error("a request failed: %s: %s", type(error).__name__, error, exc_info=error)
        self._fail(job, message, status)

    def _fail(self, job: Job, message: str, status: int = 500) -> None:
        for sequence, (owner, _) in list(self._owner.items()):
            if owner is job:
                self._leave(sequence)
        with self._wake:
            self.waiting.remove(lambda waiting: waiting is not job)
        job.echoed.clear()
        job.shared.clear()
        self._emit(job, Failed(message, status))

    def _echo_logprobs(self, job: Job, prompt: int) -> Piece | None:
        """Echo: each prompt token's log-probability given those before it; None without logprobs. With
        tokens to generate, the pass's cache serves the prompt's choices (job.shared): it runs once."""
        r, ids = job.request, job.request.prompts[prompt]
        if r.logprobs is None:
            return None
        if r.max_tokens == 0:
            return self.logprobs.prompt(ids, r.logprobs)
        ran = job.shared[prompt] = SharedPrompt(r.best_of)
        piece = self.logprobs.prompt(ids, r.logprobs, into=ran)
        if self.prefixes is not None:
            self.prefixes.store(ids, ran.cache)
        return piece


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result, error: Exception | None) -> None:
    """Hand a call's result (or its error) to its future, on its event loop; nobody listens if it has closed."""
    def settle():
        if not future.done():
            future.set_result(result) if error is None else future.set_exception(error)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins a stop string: held back until the next token."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)

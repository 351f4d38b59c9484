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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import threading
import time
import uuid

import numpy as np

from . import checks
from .batching import Batch, Sequence
from .forward import prefill
from .kvcache import ModelCache
from .sample import Sampler, prompt_ids
from .tokenizer import EOT_ID, Tokenizer
from .weights import GPT2Weights

log = logging.getLogger("gpt2numba.serve")

MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows (OpenAI's legacy API: 5)
MAX_STOPS = 4  # stop strings per request, as OpenAI's
LOGPROB_ROWS = 64  # echo: prompt rows turned into log-probabilities at a time (float64)


# --- a request, checked -----------------------------------------------------------------------------

class ApiError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


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


# field -> (JSON types allowed, what the message says); None is "absent" for every field
_FIELDS = {
    "model": ((str,), "a string"),
    "prompt": ((str, list), "a string, a list of strings, a list of token ids or a list of lists of ids"),
    "max_tokens": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "n": ((int,), "an integer"),
    "stop": ((str, list), "a string or a list of strings"),
    "seed": ((int,), "an integer"),
    "stream": ((bool,), "a boolean"),
    "stream_options": ((dict,), "an object"),
    "logprobs": ((int,), "an integer"),
    "echo": ((bool,), "a boolean"),
    "ignore_eos": ((bool,), "a boolean"),
    "user": ((str,), "a string"),
    "best_of": ((int,), "an integer"),
    "presence_penalty": ((int, float), "a number"),
    "frequency_penalty": ((int, float), "a number"),
    "logit_bias": ((dict,), "an object"),
    "suffix": ((str,), "a string"),
}


def parse_completion(body, tokenizer: Tokenizer, n_positions: int, vocab_size: int) -> Completion:
    """A POST /v1/completions body (parsed JSON), checked; ApiError(400) naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name not in _FIELDS:
            raise ApiError(400, f"unrecognized request argument supplied: {name}", name)
        types, what = _FIELDS[name]
        is_bool = isinstance(value, bool)
        if value is not None and (not isinstance(value, types) or is_bool and bool not in types):
            raise ApiError(400, f"{name} must be {what}, got {json.dumps(value)[:80]}", name)
    get = body.get
    for name in ("presence_penalty", "frequency_penalty"):
        if get(name) not in (None, 0):
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    if get("logit_bias"):
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if get("suffix"):
        raise ApiError(400, "suffix is not supported", "suffix")

    prompts = _prompts(get("prompt"), tokenizer, vocab_size)
    max_tokens = _in_range(get("max_tokens"), 16, 0, math.inf, "max_tokens")
    n = _in_range(get("n"), 1, 1, 128, "n")
    if get("best_of") not in (None, n):
        raise ApiError(400, "best_of must equal n (or be absent)", "best_of")
    longest = max(len(ids) for ids in prompts)
    if longest + max_tokens > n_positions:
        raise ApiError(400, f"this model's maximum context length is {n_positions} tokens; you requested "
                       f"{longest + max_tokens} ({longest} in the prompt, {max_tokens} for the completion)",
                       "max_tokens")
    temperature = _in_range(get("temperature"), 1.0, 0, 2, "temperature")
    top_p = _in_range(get("top_p"), 1.0, 0, 1, "top_p")
    if top_p == 0:
        raise ApiError(400, "top_p must be in (0, 1]", "top_p")
    stop = get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be up to {MAX_STOPS} non-empty strings", "stop")
    options = get("stream_options") or {}
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, 'stream_options takes only "include_usage": true or false', "stream_options")
    return Completion(
        prompts=prompts, max_tokens=max_tokens, n=n, stop=tuple(dict.fromkeys(stop)),
        sampler=Sampler(temperature=temperature, top_p=None if top_p == 1 else top_p),
        seed=_in_range(get("seed"), None, 0, 2**63 - 1, "seed"), stream=bool(get("stream")),
        include_usage=bool(options.get("include_usage")),
        logprobs=_in_range(get("logprobs"), None, 0, MAX_LOGPROBS, "logprobs"),
        echo=bool(get("echo")), ignore_eos=bool(get("ignore_eos")))


def _in_range(value, default, low, high, name):
    if value is None:
        return default
    if not low <= value <= high:
        bounds = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise ApiError(400, f"{name} must be {bounds}, got {value}", name)
    return value


def _prompts(prompt, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """The prompt field as lists of ids: a string, strings, ids, or lists of ids."""
    if prompt is None:
        raise ApiError(400, "prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt_ids(prompt, tokenizer)]
    if not prompt:
        raise ApiError(400, "prompt must not be an empty list", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [prompt_ids(p, tokenizer) for p in prompt]
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [_ids(prompt, vocab_size, "")]
    if all(isinstance(p, list) for p in prompt):
        return [_ids(p, vocab_size, f"prompt {i}: ") for i, p in enumerate(prompt)]
    raise ApiError(400, f"prompt must be {_FIELDS['prompt'][1]}", "prompt")


def _ids(ids: list, vocab_size: int, label: str) -> list[int]:
    """Checked token ids; an empty prompt starts from <|endoftext|>, as an empty string does."""
    if not ids:
        return [EOT_ID]
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ApiError(400, f"{label}token id at index {i}: {t!r} is not in [0, {vocab_size})", "prompt")
    return ids


# --- the engine: one thread owns the weights -----------------------------------------------------------

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


# --- HTTP -------------------------------------------------------------------------------------------------

def create_app(w: GPT2Weights, tokenizer: Tokenizer, *, model_name: str = "gpt2", max_batch: int = 16,
               max_queue: int = 64, api_key: str | None = None, max_body_bytes: int = 2**20):
    """The Starlette application: the OpenAI routes over an Engine that starts and stops with it."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    checks.weights(w)
    cfg = w.config
    engine = Engine(w, tokenizer, max_batch, max_queue)
    created = int(time.time())

    def error(e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def authorised(request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "invalid API key: send Authorization: Bearer KEY", kind="authentication_error")

    async def read_json(request):
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body_bytes:
            raise ApiError(400, f"the body is over the limit of {max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise ApiError(400, f"the body is over the limit of {max_body_bytes} bytes")
        try:
            return json.loads(body)
        except ValueError as e:  # UnicodeDecodeError is one
            raise ApiError(400, f"the body is not valid JSON: {e}") from None

    async def completions(request):
        authorised(request)
        r = parse_completion(await read_json(request), tokenizer, cfg.n_positions, cfg.vocab_size)
        job = Job(r, asyncio.get_running_loop(), tokenizer)
        try:
            engine.submit(job)
        except QueueFull:
            raise ApiError(503, f"the server is busy: {engine.max_queue} requests are waiting already",
                           kind="server_error", headers={"Retry-After": "1"}) from None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        if r.stream:
            return StreamingResponse(_sse(job, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        choices = [{"index": i, "text": "", "logprobs": _empty_logprobs() if r.logprobs is not None else None,
                    "finish_reason": None} for i in range(len(r.prompts) * r.n)]
        tokens = 0
        async for event in _events(job, request):
            if event[0] == "text":
                _, i, text, logprobs = event
                _append_logprobs(choices[i], len(choices[i]["text"]), logprobs)
                choices[i]["text"] += text
            elif event[0] == "finish":
                choices[event[1]]["finish_reason"] = event[2]
                tokens += event[3]
        return JSONResponse({**head, "choices": choices, "usage": _usage(r, tokens)})

    async def _events(job: Job, request=None):
        """The job's events up to ("done",); ApiError(500) for ("error", ...). Cancels the job if left early."""
        gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                if gone is not None:
                    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()
                        return  # the client went away: finally cancels the job
                event = await get
                if event[0] == "done":
                    return
                if event[0] == "error":
                    raise ApiError(500, event[1], kind="server_error")
                yield event
        finally:
            if gone is not None:
                gone.cancel()
            if job.unfinished:
                engine.cancel(job)
            _log(job)

    def _log(job: Job):
        r = job.request
        state = "cancelled" if job.cancelled else "done"
        log.info("completion %s: %d prompt tokens, %d choices, %d tokens out, %.3f s", state, sum(map(len, r.prompts)),
                 len(job.choices), sum(c.tokens for c in job.choices), time.perf_counter() - job.started)

    async def _sse(job: Job, head: dict):
        r = job.request
        tokens = 0
        sent = collections.Counter()  # choice -> characters of text sent: where its next token's offset starts
        try:
            async with contextlib.aclosing(_events(job)) as events:  # a client gone: the job is cancelled now
                async for event in events:
                    if event[0] == "text":
                        _, i, text, logprobs = event
                        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": None}
                        if r.logprobs is not None:
                            choice["logprobs"] = _empty_logprobs()
                            _append_logprobs(choice, sent[i], logprobs)
                        sent[i] += len(text)
                    else:  # "finish"
                        choice = {"index": event[1], "text": "", "logprobs": None, "finish_reason": event[2]}
                        tokens += event[3]
                    yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
            if r.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(r, tokens)})}\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    async def models(request):
        authorised(request)
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                                         "owned_by": "gpt2numba"}]})

    async def health(request):
        return JSONResponse({"status": "ok", "active": engine.active, "queued": engine.queued})

    # /tokenize and /detokenize answer as llama-server's and vLLM's do (lm-eval's remote tokenizer uses vLLM's)
    async def tokenize(request):
        authorised(request)
        body = await read_json(request)
        content = body.get("content", body.get("prompt")) if isinstance(body, dict) else None
        if not isinstance(content, str):
            raise ApiError(400, 'tokenize takes {"content": "text"} (or "prompt")', "content")
        return JSONResponse({"tokens": tokenizer.encode(content)})

    async def detokenize(request):
        authorised(request)
        body = await read_json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list):
            raise ApiError(400, 'detokenize takes {"tokens": [ids]}', "tokens")
        text = tokenizer.decode(_ids(ids, cfg.vocab_size, "") if ids else [])  # (no <|endoftext|> for [])
        return JSONResponse({"content": text, "prompt": text})

    async def tokenizer_info(request):
        authorised(request)
        eot = tokenizer.decode([tokenizer.eot_id])
        return JSONResponse({"eos_token": eot, "bos_token": eot, "pad_token": None,
                             "model_max_length": cfg.n_positions, "tokenizer_class": "GPT2Tokenizer"})

    async def api_error(request, e: ApiError):
        return error(e)

    async def http_error(request, e: HTTPException):
        return error(ApiError(e.status_code, e.detail, kind="invalid_request_error" if e.status_code < 500
                              else "server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.get_running_loop().run_in_executor(None, engine.start)
        log.info("serving %s (%s) with up to %d sequences per step", model_name, w.dtype, max_batch)
        yield
        engine.stop()

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error}, lifespan=lifespan)
    app.state.engine = engine
    return app


async def _disconnected(request) -> None:
    """Returns when the client has gone (the body is read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(r: Completion, completion_tokens: int) -> dict:
    prompt_tokens = sum(map(len, r.prompts))  # once per prompt, whatever n
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _empty_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _append_logprobs(choice: dict, start: int, logprobs: dict | None) -> None:
    """Add a piece's token log-probabilities to a choice's, with each token's offset in the choice's text
    (start: the text's length before this piece)."""
    if logprobs is None or choice["logprobs"] is None:
        return
    out = choice["logprobs"]
    offset = (out["text_offset"][-1] + len(out["tokens"][-1])) if out["tokens"] else start
    for token in logprobs["tokens"]:
        out["text_offset"].append(offset)
        offset += len(token)
    for name in ("tokens", "token_logprobs", "top_logprobs"):
        out[name].extend(logprobs[name])


def run(w: GPT2Weights, tokenizer: Tokenizer, *, host: str = "127.0.0.1", port: int = 8000,
        shutdown_grace: int = 5, **options) -> None:
    """Serve until Ctrl-C or SIGTERM: uvicorn stops taking connections, lets requests in flight finish
    (up to shutdown_grace seconds), then the engine fails what is left and stops."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    app = create_app(w, tokenizer, **options)
    uvicorn.run(app, host=host, port=port, access_log=False, timeout_graceful_shutdown=shutdown_grace, log_level="info")

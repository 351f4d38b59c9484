"""The HTTP room of the server: OpenAI's completions API over the engine (the optional extra [serve]).

    gpt2numba serve --model PATH --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 16}'

Request parsing (parse_completion: ApiError naming the field), the routes (Routes: check, submit, await;
none computes) and server-sent events. The engine thread (engine.py) owns the weights and the batch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import math
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .. import checks
from ..sample import Sampler, prompt_ids
from ..tokenizer import EOT_ID, Tokenizer
from ..weights import GPT2Weights
from .engine import Completion, Engine, Job, QueueFull

log = logging.getLogger("gpt2numba.serve")


# --- a request, checked -----------------------------------------------------------------------------

class ApiError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows (OpenAI's legacy API: 5)


MAX_STOPS = 4  # stop strings per request, as OpenAI's


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


# --- HTTP -------------------------------------------------------------------------------------------------

def create_app(w: GPT2Weights, tokenizer: Tokenizer, *, model_name: str = "gpt2", max_batch: int = 16,
               max_queue: int = 64, api_key: str | None = None, max_body_bytes: int = 2**20):
    """The Starlette application: the OpenAI routes over an Engine that starts and stops with it."""
    checks.weights(w)
    engine = Engine(w, tokenizer, max_batch, max_queue)
    routes = Routes(engine, tokenizer, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes)
    app = Starlette(routes=[
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/tokenize", routes.tokenize, methods=["POST"]),
        Route("/detokenize", routes.detokenize, methods=["POST"]),
        Route("/tokenizer_info", routes.tokenizer_info, methods=["GET"]),
    ], exception_handlers={ApiError: _api_error, HTTPException: _http_error}, lifespan=routes.lifespan)
    app.state.engine = engine
    return app


class Routes:
    """The HTTP routes over one Engine: each handler checks, submits and awaits; none computes."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, model_name: str, api_key: str | None,
                 max_body_bytes: int):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, engine.w.config
        self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes
        self.created = int(time.time())

    def authorised(self, request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "invalid API key: send Authorization: Bearer KEY", kind="authentication_error")

    async def read_json(self, request):
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(400, f"the body is over the limit of {self.max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise ApiError(400, f"the body is over the limit of {self.max_body_bytes} bytes")
        try:
            return json.loads(body)
        except ValueError as e:  # UnicodeDecodeError is one
            raise ApiError(400, f"the body is not valid JSON: {e}") from None

    async def completions(self, request):
        self.authorised(request)
        cfg, tokenizer = self.cfg, self.tokenizer
        r = parse_completion(await self.read_json(request), tokenizer, cfg.n_positions, cfg.vocab_size)
        job = Job(r, asyncio.get_running_loop(), tokenizer)
        try:
            self.engine.submit(job)
        except QueueFull:
            raise ApiError(503, f"the server is busy: {self.engine.max_queue} requests are waiting already",
                           kind="server_error", headers={"Retry-After": "1"}) from None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if r.stream:
            return StreamingResponse(self._sse(job, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        choices = [{"index": i, "text": "", "logprobs": _empty_logprobs() if r.logprobs is not None else None,
                    "finish_reason": None} for i in range(len(r.prompts) * r.n)]
        tokens = 0
        async for event in self._events(job, request):
            if event[0] == "text":
                _, i, text, logprobs = event
                _append_logprobs(choices[i], len(choices[i]["text"]), logprobs)
                choices[i]["text"] += text
            elif event[0] == "finish":
                choices[event[1]]["finish_reason"] = event[2]
                tokens += event[3]
        return JSONResponse({**head, "choices": choices, "usage": _usage(r, tokens)})

    async def _events(self, job: Job, request=None):
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
                self.engine.cancel(job)
            _log(job)

    async def _sse(self, job: Job, head: dict):
        r = job.request
        tokens = 0
        sent = collections.Counter()  # choice -> characters of text sent: where its next token's offset starts
        try:
            async with contextlib.aclosing(self._events(job)) as events:  # a client gone: the job is cancelled now
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

    async def models(self, request):
        self.authorised(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": self.created, "owned_by": "gpt2numba"}]})

    async def health(self, request):
        return JSONResponse({"status": "ok", "active": self.engine.active, "queued": self.engine.queued})

    # /tokenize and /detokenize answer as llama-server's and vLLM's do (lm-eval's remote tokenizer uses vLLM's)
    async def tokenize(self, request):
        self.authorised(request)
        body = await self.read_json(request)
        content = body.get("content", body.get("prompt")) if isinstance(body, dict) else None
        if not isinstance(content, str):
            raise ApiError(400, 'tokenize takes {"content": "text"} (or "prompt")', "content")
        return JSONResponse({"tokens": self.tokenizer.encode(content)})

    async def detokenize(self, request):
        self.authorised(request)
        body = await self.read_json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list):
            raise ApiError(400, 'detokenize takes {"tokens": [ids]}', "tokens")
        text = self.tokenizer.decode(_ids(ids, self.cfg.vocab_size, "") if ids else [])  # (no <|endoftext|> for [])
        return JSONResponse({"content": text, "prompt": text})

    async def tokenizer_info(self, request):
        self.authorised(request)
        eot = self.tokenizer.decode([self.tokenizer.eot_id])
        return JSONResponse({"eos_token": eot, "bos_token": eot, "pad_token": None,
                             "model_max_length": self.cfg.n_positions, "tokenizer_class": "GPT2Tokenizer"})

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        await asyncio.get_running_loop().run_in_executor(None, self.engine.start)
        log.info("serving %s (%s) with up to %d sequences per step", self.model_name, self.engine.w.dtype,
                 self.engine.batch.size)
        yield
        self.engine.stop()


async def _api_error(request, e: ApiError):
    return _error(e)


async def _http_error(request, e: HTTPException):
    return _error(ApiError(e.status_code, e.detail, kind="invalid_request_error" if e.status_code < 500
                          else "server_error"))


def _error(e: ApiError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _log(job: Job):
    r = job.request
    state = "cancelled" if job.cancelled else "done"
    log.info("completion %s: %d prompt tokens, %d choices, %d tokens out, %.3f s", state, sum(map(len, r.prompts)),
             len(job.choices), sum(c.tokens for c in job.choices), time.perf_counter() - job.started)


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

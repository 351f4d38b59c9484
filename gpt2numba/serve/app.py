"""The HTTP room of the server: OpenAI's completions API over the engine (the optional extra [serve]).

    gpt2numba serve --model PATH --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 16}'

The routes (Routes: check, submit, await; none computes) and server-sent events. Request parsing is
requests.py, the limits admission.py, the JSON of a response responses.py, /metrics metrics.py, the
connections and the shutdown server.py; the engine thread (engine.py) owns the weights and the batch.
GET / is the playground (the package's view/ folder: plain HTML, CSS and JS, also under /static/), which
talks to /v1/completions and /v1/inspect like any client.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..cpu import dispatch
from ..model import checks
from ..model.weights import GPT2Weights
from ..text.tokenizer import Tokenizer
from ..text.tokenview import inspect_ids
from .admission import Refused, check_cache, check_choices, check_size
from .config import ServeConfig
from .engine import Engine
from .events import Done, Failed
from .jobs import Job
from .metrics import CONTENT_TYPE, Metrics
from .requests import CONSTRAINED, MAX_LOGPROBS, MAX_STOPS, ApiError, checked_ids, parse_completion, parse_inspect
from .responses import Chunks, Whole, inspection_json, json_response

log = logging.getLogger("gpt2numba.serve")

# what may make a body carry a grammar to compile: a structured-output field's name, or any JSON escape (which
# could spell one)
_GRAMMAR_HINTS = (*(name.encode() for name in CONSTRAINED), b"\\u")

__all__ = ["ApiError", "MAX_LOGPROBS", "MAX_STOPS", "Routes", "create_app", "parse_completion"]

PARSE_INLINE_BYTES = 2**16  # bodies up to this size are parsed on the event loop; larger ones in a thread,
PARSE_THREADS = 2  # so many at a time (each may hold a few hundred thousand prompts while it checks them)

VIEW = Path(__file__).resolve().parent.parent / "view"  # the playground's files (package data)
# The page may load and ask nothing but this server: no CDN, font, or analytics, even if one slipped in.
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def create_app(w: GPT2Weights, tokenizer: Tokenizer, config: ServeConfig | None = None, **settings):
    """The Starlette application: the OpenAI routes over an Engine that starts and stops with it.

    config: the server's settings (its connection settings are server.run's), or ServeConfig's defaults with
    ``settings`` (its fields, as keywords: create_app(w, tokenizer, max_batch=4)) over them. ConfigError for a
    setting out of its range (an empty api_key, an unknown kv_dtype: ServeConfig says), TypeError for a name
    that is no setting."""
    checks.weights(w)
    config = ServeConfig.made(config, settings).named(None)
    metrics = Metrics()  # this server's own registry
    engine = Engine(w, tokenizer, config, metrics=metrics)
    metrics.watch(engine)
    routes = Routes(engine, tokenizer, metrics)
    app = Starlette(routes=[
        Route("/", routes.page, methods=["GET"]),
        Mount("/static", StaticFiles(directory=VIEW), name="static"),
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/inspect", routes.inspect, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.prometheus, methods=["GET"]),
        Route("/tokenize", routes.tokenize, methods=["POST"]),
        Route("/detokenize", routes.detokenize, methods=["POST"]),
        Route("/tokenizer_info", routes.tokenizer_info, methods=["GET"]),
    ], exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=routes.lifespan, middleware=[Middleware(AccessLog)])
    app.state.engine = engine
    return app


class Routes:
    """The HTTP routes over one Engine: each handler checks, submits and awaits; none computes."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: Metrics):
        self.engine, self.tokenizer, self.cfg, self.metrics = engine, tokenizer, engine.w.config, metrics
        config = engine.config
        self.model_name, self.api_key, self.max_body_bytes = config.model_name, config.api_key, config.max_body_bytes
        self.created = int(time.time())
        self._parsing = asyncio.Semaphore(PARSE_THREADS)

    def authorised(self, request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "invalid API key: send Authorization: Bearer KEY", kind="authentication_error")

    async def read_body(self, request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(400, f"the body is over the limit of {self.max_body_bytes} bytes")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise ApiError(400, f"the body is over the limit of {self.max_body_bytes} bytes")
        except ClientDisconnect:  # (or the body timed out: server.py closed the connection)
            raise ApiError(400, "the client went away before the end of the body") from None
        return bytes(body)

    async def read_json(self, request):
        return _json(await self.read_body(request))

    def parse(self, body: bytes):
        """A completions body, checked against the request's fields and the server's per-request limits."""
        cfg, body = self.cfg, _json(body)
        try:
            prompt, n, field = _choices(body)
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # before checking (or
                check_choices(self.engine.config, len(prompt), n, field)  # tokenising) each prompt
            settings = self.engine.config
            r = parse_completion(body, self.tokenizer, cfg.n_positions, cfg.vocab_size,
                                 max_grammar_bytes=settings.max_grammar_bytes,
                                 max_grammar_seconds=settings.max_grammar_seconds)
            check_size(self.engine.config, [len(ids) for ids in r.prompts], r.best_of, r.max_tokens, r.logprobs,
                       r.echo, "best_of" if r.best_of > r.n else "n")
            check_cache(self.engine.max_positions, [len(ids) for ids in r.prompts], r.max_tokens)
        except Refused as e:
            raise ApiError(e.status, e.message, e.param) from None
        return r

    async def completions(self, request):
        """POST /v1/completions. Each answer is counted by its status here; a stream's at its end (_sse)."""
        try:
            return await self._complete(request)
        except ApiError as e:
            self.metrics.answered(e.status)
            raise
        except Exception:  # (_internal_error answers it)
            self.metrics.answered(500)
            raise

    async def off_loop(self, parse, body: bytes):
        """parse(body); a large body (many prompts, long texts) is parsed and tokenised off the event loop, and
        so is one that may carry a grammar to compile (_GRAMMAR_HINTS)."""
        if len(body) <= PARSE_INLINE_BYTES and not any(hint in body for hint in _GRAMMAR_HINTS):
            return parse(body)
        async with self._parsing:
            return await asyncio.to_thread(parse, body)

    async def _complete(self, request):
        self.authorised(request)
        r = await self.off_loop(self.parse, await self.read_body(request))
        job = Job(r, asyncio.get_running_loop())
        try:
            self.engine.submit(job)
        except Refused as e:  # QueueFull: the message names the limit and its flag
            raise ApiError(e.status, e.message, kind="server_error", headers={"Retry-After": "1"}) from None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if r.stream:
            return StreamingResponse(self._sse(job, Chunks(r, head)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        whole = Whole(r, head)
        try:
            async for event in self._events(job, request):
                whole.add(event)
        finally:
            del job  # nothing here keeps the job (an exception's traceback holds this frame)
        if not whole.complete:  # the client went away (nginx's 499): nobody reads this
            raise ApiError(499, "the client closed the connection before the response")
        self.metrics.answered(200)
        return whole.response()

    async def _events(self, job: Job, request=None):
        """The job's Text and Finish events, up to Done; ApiError for Failed. Cancels the job if left early, and
        drops every reference to it on the way out."""
        gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        get = None
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                if gone is not None:
                    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        return  # the client went away: finally cancels the job
                event = await get
                if isinstance(event, Done):
                    return
                if isinstance(event, Failed):  # (400: the request's own settings failed it; 500, 503: the server)
                    raise ApiError(event.status, event.message,
                                   kind="invalid_request_error" if event.status < 500 else "server_error")
                yield event
        finally:
            for future in (get, gone):
                if future is not None:
                    future.cancel()
            if job.unfinished:
                self.engine.cancel(job)
            _log(job)
            del job, get, gone, request

    async def _sse(self, job: Job, chunks: Chunks):
        include_usage = job.request.include_usage
        status = 499  # the client left before the end: the generator is closed at a yield
        try:
            async with contextlib.aclosing(self._events(job)) as events:  # a client gone: the job is cancelled now
                del job
                async for event in events:
                    yield chunks.event(event)
            if include_usage:
                yield chunks.usage()
            status = 200
        except ApiError as e:
            status = e.status
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception:  # a bug: the stream is cut
            status = 500
            raise
        finally:
            del chunks
            self.metrics.answered(status)  # before [DONE]: a client that has read it finds its answer counted
        yield "data: [DONE]\n\n"

    async def inspect(self, request):
        """POST /v1/inspect: every token of a text with its log-probability, rank and alternatives
        (tokenview.py), computed and serialised on the engine thread between two steps."""
        self.authorised(request)
        cfg, tokenizer, w, kv_dtype = self.cfg, self.tokenizer, self.engine.w, self.engine.batch.kv_dtype
        r = await self.off_loop(lambda body: parse_inspect(_json(body), tokenizer, cfg.n_positions, cfg.vocab_size),
                                await self.read_body(request))
        name = self.model_name

        def inspection() -> str:  # the engine thread's
            return inspection_json(inspect_ids(r.ids, w, tokenizer, top_logprobs=r.top_logprobs,
                                               kv_dtype=kv_dtype), name)
        try:
            future = self.engine.call(inspection, asyncio.get_running_loop())
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not future.done():  # the client went away: the call does not run if it has not yet
                future.cancel()
                raise ApiError(499, "the client closed the connection before the response")
            return Response(future.result(), media_type="application/json")
        except Refused as e:  # QueueFull, now or at shutdown: the message names the limit and its flag
            raise ApiError(e.status, e.message, kind="server_error", headers={"Retry-After": "1"}) from None

    async def page(self, request):
        """GET /: the playground. Open, as /health is: it holds no data (its requests send the key)."""
        return FileResponse(VIEW / "index.html", headers={"Content-Security-Policy": PAGE_POLICY,
                                                          "Cache-Control": "no-cache"})

    async def models(self, request):
        self.authorised(request)
        return json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                          "created": self.created, "owned_by": "gpt2numba"}]})

    async def health(self, request):
        return json_response({"status": "ok", "active": self.engine.active, "queued": self.engine.queued})

    async def prometheus(self, request):
        """GET /metrics: open, as /health is (docs/serving.md says why): counts and times, never a text."""
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)

    # /tokenize and /detokenize answer as llama-server's and vLLM's do (lm-eval's remote tokenizer uses vLLM's)
    async def tokenize(self, request):
        self.authorised(request)
        body = await self.read_json(request)
        content = body.get("content", body.get("prompt")) if isinstance(body, dict) else None
        if not isinstance(content, str):
            raise ApiError(400, 'tokenize takes {"content": "text"} (or "prompt")', "content")
        return json_response({"tokens": self.tokenizer.encode(content)})

    async def detokenize(self, request):
        self.authorised(request)
        body = await self.read_json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list):
            raise ApiError(400, 'detokenize takes {"tokens": [ids]}', "tokens")
        text = self.tokenizer.decode(checked_ids(ids, self.cfg.vocab_size, "") if ids else [])  # (no <|endoftext|> for [])
        return json_response({"content": text, "prompt": text})

    async def tokenizer_info(self, request):
        self.authorised(request)
        eot = self.tokenizer.decode([self.tokenizer.eot_id])
        return json_response({"eos_token": eot, "bos_token": eot, "pad_token": None,
                              "model_max_length": self.cfg.n_positions, "tokenizer_class": "GPT2Tokenizer"})

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.engine.start)
        log.info("serving %s (%s) with up to %d sequences per step", self.model_name, self.engine.w.dtype,
                 self.engine.batch.size)
        log.info("row thresholds: %s", dispatch.describe_tuning())  # (serve does not tune: docs/performance.md)
        yield
        await loop.run_in_executor(None, self.engine.stop)


def _choices(body) -> tuple:
    """(prompt, choices run per prompt, the field that says so) of a body not yet checked: n, or best_of when
    it is larger; (None, 1, "n") when the body cannot say."""
    if not isinstance(body, dict):
        return None, 1, "n"
    n, best_of = (v if isinstance(v, int) else 1 for v in (body.get("n"), body.get("best_of")))
    return body.get("prompt"), max(n, best_of), "best_of" if best_of > n else "n"


def _json(body: bytes):
    """The body as JSON; ApiError(400) for anything that is not (bad UTF-8, bad syntax, nesting too deep)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, f"the body is not valid JSON: {str(e)[:200]}") from None


async def _api_error(request, e: ApiError):
    return _error(e)


async def _http_error(request, e: HTTPException):
    return _error(ApiError(e.status_code, e.detail, kind="invalid_request_error" if e.status_code < 500
                          else "server_error"))


async def _internal_error(request, e: Exception):
    log.error("internal error: %s: %s", type(e).__name__, e)
    return _error(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error"))


def _error(e: ApiError):
    return json_response(e.body(), e.status, e.headers)


class AccessLog:
    """One log line per request, refused ones too (400, 401, 404, 405, 503): method, path, status, seconds,
    once its response has gone (uvicorn's own access log is off: server.run)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        since, status = time.perf_counter(), []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)
        try:
            await self.app(scope, receive, sending)
        except Exception:
            status.append(500)  # (the error handler outside this middleware answers it)
            raise
        finally:
            log.info("%s %s %s %.3f s", scope["method"], scope["path"], status[0] if status else "-",
                     time.perf_counter() - since)


def _log(job: Job):
    r = job.request
    state = "cancelled" if job.cancelled else "done"
    log.info("completion %s: %d prompt tokens, %d choices, %d tokens out, %.3f s", state, sum(map(len, r.prompts)),
             job.choices, job.tokens, time.perf_counter() - job.since)


async def _disconnected(request) -> None:
    """Returns when the client has gone (the body is read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


"""A POST /v1/completions body, checked: parse_completion returns a Completion or raises ApiError naming the
field (the HTTP status and OpenAI's error object); parse_inspect does the same for POST /v1/inspect. No HTTP
framework here.
"""

from __future__ import annotations

import dataclasses
import json
import math

from ..decoding.constraints import constraint
from ..decoding.processors import MAX_BIAS
from ..errors import GrammarError
from ..decoding.sample import Sampler, prompt_ids
from ..text.tokenizer import EOT_ID, Tokenizer
from ..text.tokenview import MAX_TOP
from .config import ServeConfig
from .jobs import Completion


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


MAX_N = 128  # choices (n) and candidates (best_of) per prompt, as OpenAI's


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
    # vLLM's extras
    "top_k": ((int,), "an integer"),
    "min_p": ((int, float), "a number"),
    "repetition_penalty": ((int, float), "a number"),
    "min_tokens": ((int,), "an integer"),
    # structured output (decoding/constraints.py): OpenAI's, vLLM's and llama.cpp's fields, at most one
    "response_format": ((dict,), "an object"),
    "guided_json": ((dict, str), "an object or a JSON string"),
    "guided_regex": ((str,), "a string"),
    "guided_choice": ((list,), "a list of strings"),
    "guided_grammar": ((str,), "a string"),
    "json_schema": ((dict,), "an object"),
    "grammar": ((str,), "a string"),
}
# each structured-output field -> the constraint it asks for (constraints.KINDS)
CONSTRAINED = {"response_format": "json_schema", "guided_json": "json_schema", "guided_regex": "regex",
                "guided_choice": "choice", "guided_grammar": "grammar", "json_schema": "json_schema",
                "grammar": "grammar"}


_SETTINGS = ServeConfig()  # (the defaults of a server's settings, for a caller that gives none)


def parse_completion(body, tokenizer: Tokenizer, n_positions: int, vocab_size: int, *,
                     max_grammar_bytes: int = _SETTINGS.max_grammar_bytes,
                     max_grammar_seconds: float = _SETTINGS.max_grammar_seconds) -> Completion:
    """A POST /v1/completions body (parsed JSON), checked; ApiError(400) naming the field otherwise. A
    structured-output field's grammar is compiled here, last, before anything reaches the engine: at most
    ``max_grammar_bytes`` of it, and refused if compiling took longer than ``max_grammar_seconds`` (ServeConfig's
    settings)."""
    _typed(body, _FIELDS)
    get = body.get
    if get("suffix"):
        raise ApiError(400, "suffix is not supported", "suffix")

    prompts = _prompts(get("prompt"), tokenizer, vocab_size)
    max_tokens = _in_range(get("max_tokens"), 16, 0, math.inf, "max_tokens")
    n = _in_range(get("n"), 1, 1, MAX_N, "n")
    best_of = _in_range(get("best_of"), n, 1, MAX_N, "best_of")
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if get("stream") and best_of != n:
        raise ApiError(400, "best_of cannot be used with stream (unless it equals n)", "best_of")
    longest = max(len(ids) for ids in prompts)
    if longest + max_tokens > n_positions:
        raise ApiError(400, f"this model's maximum context length is {n_positions} tokens; you requested "
                       f"{longest + max_tokens} ({longest} in the prompt, {max_tokens} for the completion)",
                       "max_tokens")
    stop = get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be up to {MAX_STOPS} non-empty strings", "stop")
    options = get("stream_options") or {}
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, 'stream_options takes only "include_usage": true or false', "stream_options")
    return Completion(
        prompts=prompts, max_tokens=max_tokens, n=n, best_of=best_of, stop=tuple(dict.fromkeys(stop)),
        sampler=_sampler(get, max_tokens, vocab_size),
        seed=_in_range(get("seed"), None, 0, 2**63 - 1, "seed"), stream=bool(get("stream")),
        include_usage=bool(options.get("include_usage")),
        logprobs=_in_range(get("logprobs"), None, 0, MAX_LOGPROBS, "logprobs"),
        echo=bool(get("echo")), ignore_eos=bool(get("ignore_eos")),
        constraint=_constraint(get, tokenizer, vocab_size, max_grammar_bytes, max_grammar_seconds))


def _constraint(get, tokenizer: Tokenizer, vocab_size: int, max_bytes: int, max_seconds: float):
    """The request's structured-output field as a Constraint (None for none, or response_format "text"):
    compiled, within the bounds; a 400 naming the field otherwise."""
    given = [name for name in CONSTRAINED if get(name) is not None
             and not (name == "response_format" and get(name).get("type") == "text")]  # ("text": none asked)
    if len(given) > 1:
        raise ApiError(400, f"give at most one of {', '.join(CONSTRAINED)}; got {' and '.join(given)}", given[1])
    if not given:
        return None
    field = given[0]
    value = get(field)
    if field == "response_format":
        value = _response_format(value)
    size = len(value.encode() if isinstance(value, str) else json.dumps(value).encode())
    if size > max_bytes:
        raise ApiError(400, f"{field} is {size} bytes; this server takes at most {max_bytes} "
                       "(--max-grammar-bytes)", field)
    try:
        made = constraint(**{CONSTRAINED[field]: value}, tokenizer=tokenizer, vocab_size=vocab_size)
    except GrammarError as e:  # (named as this field, not as the library's argument)
        raise ApiError(400, f"{field}: {e.detail}" if e.argument else f"{field}: {e}", field) from None
    if made.compile_s > max_seconds:  # (after the fact: the time is spent, but its grammar is never used)
        raise ApiError(400, f"{field} took {made.compile_s:.1f} s to compile, longer than this server allows: "
                       f"{max_seconds:g} s (--max-grammar-seconds)", field)
    return made


def _response_format(value: dict) -> dict:
    """OpenAI's response_format as a JSON schema: {"type": "json_object"} any object, {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}} its schema ({"type": "text"} asks for none: never here)."""
    kind = value.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ApiError(400, 'response_format.type must be "text", "json_object" or "json_schema", got '
                       f"{json.dumps(kind)[:40]}", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, 'response_format "json_schema" needs json_schema.schema, a JSON schema object '
                       '({"name": ..., "schema": {...}, "strict": true})', "response_format")
    return spec["schema"]


@dataclasses.dataclass(frozen=True)
class Inspect:
    """A checked POST /v1/inspect body."""

    ids: list[int]  # the text's tokens (<|endoftext|> goes before them in the pass, not here)
    top_logprobs: int  # alternatives per token


DEFAULT_TOP = 5  # alternatives per token when a request does not say: what the page's tip shows

_INSPECT_FIELDS = {
    "model": ((str,), "a string"),
    "text": ((str,), "a string"),
    "prompt": ((list,), "a list of token ids"),
    "top_logprobs": ((int,), "an integer"),
}


def parse_inspect(body, tokenizer: Tokenizer, n_positions: int, vocab_size: int) -> Inspect:
    """A POST /v1/inspect body: {"text": str} or {"prompt": [ids]}, and "top_logprobs" (0 to MAX_TOP, default
    DEFAULT_TOP); ApiError(400) naming the field otherwise. The tokens must fit the context with <|endoftext|>
    before them: at most n_positions - 1."""
    _typed(body, _INSPECT_FIELDS)
    text, prompt = body.get("text"), body.get("prompt")
    if (text is None) == (prompt is None):
        raise ApiError(400, 'give "text" (a string) or "prompt" (a list of token ids): one of them',
                       "text" if text is None else "prompt")
    field = "text" if prompt is None else "prompt"
    ids = tokenizer.encode(text) if prompt is None else checked_ids(prompt, vocab_size, "") if prompt else []
    if not ids:
        raise ApiError(400, f"{field} must not be empty", field)
    if len(ids) > n_positions - 1:
        raise ApiError(400, f"this model's maximum context length is {n_positions} tokens, and inspecting takes "
                       f"one before the text (<|endoftext|>): at most {n_positions - 1} tokens; {field} has "
                       f"{len(ids)}", field)
    return Inspect(ids, _in_range(body.get("top_logprobs"), DEFAULT_TOP, 0, MAX_TOP, "top_logprobs"))


def _typed(body, fields: dict) -> None:
    """ApiError(400) unless ``body`` is a JSON object of known ``fields``, each of its types or null."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name not in fields:
            raise ApiError(400, f"unrecognized request argument supplied: {name}", name)
        types, what = fields[name]
        is_bool = isinstance(value, bool)
        if value is not None and (not isinstance(value, types) or is_bool and bool not in types):
            raise ApiError(400, f"{name} must be {what}, got {json.dumps(value)[:80]}", name)


def _sampler(get, max_tokens: int, vocab_size: int) -> Sampler:
    """The sampling fields as a Sampler: OpenAI's, in OpenAI's ranges, and vLLM's extras in vLLM's."""
    temperature = _in_range(get("temperature"), 1.0, 0, 2, "temperature")
    top_p = _in_range(get("top_p"), 1.0, 0, 1, "top_p", low_open=True)
    top_k = get("top_k")
    if top_k is not None and top_k < -1:
        raise ApiError(400, f"top_k must be an integer >= 1, or -1 or 0 for none, got {top_k}", "top_k")
    repetition_penalty = get("repetition_penalty")
    if repetition_penalty is not None and not 0 < repetition_penalty < math.inf:
        raise ApiError(400, f"repetition_penalty must be a finite number > 0, got {repetition_penalty}",
                       "repetition_penalty")
    min_tokens = _in_range(get("min_tokens"), 0, 0, math.inf, "min_tokens")
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")
    return Sampler(
        temperature=temperature, top_k=top_k if top_k is not None and top_k > 0 else None,
        top_p=None if top_p == 1 else top_p, min_p=_in_range(get("min_p"), 0, 0, 1, "min_p") or None,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty, min_new_tokens=min_tokens,
        presence_penalty=_in_range(get("presence_penalty"), 0.0, -2, 2, "presence_penalty"),
        frequency_penalty=_in_range(get("frequency_penalty"), 0.0, -2, 2, "frequency_penalty"),
        logit_bias=_logit_bias(get("logit_bias"), vocab_size))


def _logit_bias(value: dict | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids written as decimal strings ("50256"), each to a bias in [-100, 100]."""
    bias = {}
    for key, b in (value or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) < 20 else vocab_size
        if token >= vocab_size:
            raise ApiError(400, f"logit_bias: the key {json.dumps(key)[:40]} is not a token id (a decimal "
                           f"integer in [0, {vocab_size}))", "logit_bias")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not -MAX_BIAS <= b <= MAX_BIAS:
            raise ApiError(400, f"logit_bias: the bias of {json.dumps(key)} must be a number in [-{MAX_BIAS:g}, "
                           f"{MAX_BIAS:g}], got {json.dumps(b)[:40]}", "logit_bias")
        bias[token] = b
    return bias or None


def _in_range(value, default, low, high, name, low_open=False):
    """``value`` (``default`` for None) if within [low, high] ((low, high] with ``low_open``), else a 400
    naming the field, the range and the value."""
    if value is None:
        return default
    if not (low < value if low_open else low <= value) or not value <= high:
        bounds = f">= {low}" if high == math.inf else f"in {'(' if low_open else '['}{low}, {high}]"
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
        return [checked_ids(prompt, vocab_size, "")]
    if all(isinstance(p, list) for p in prompt):
        return [checked_ids(p, vocab_size, f"prompt {i}: ") for i, p in enumerate(prompt)]
    raise ApiError(400, f"prompt must be {_FIELDS['prompt'][1]}", "prompt")


def checked_ids(ids: list, vocab_size: int, label: str) -> list[int]:
    """Checked token ids; an empty prompt starts from <|endoftext|>, as an empty string does."""
    if not ids:
        return [EOT_ID]
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ApiError(400, f"{label}token id at index {i}: {t!r} is not in [0, {vocab_size})", "prompt")
    return ids

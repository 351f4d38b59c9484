"""A POST /v1/completions body, checked: parse_completion returns a Completion or raises ApiError naming the
field (the HTTP status and OpenAI's error object). No HTTP framework here.
"""

from __future__ import annotations

import json
import math

from ..sample import Sampler, prompt_ids
from ..tokenizer import EOT_ID, Tokenizer
from .engine import Completion


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

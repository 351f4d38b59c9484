"""Structured output: a sequence's text kept inside a JSON schema, a regular expression, a choice of strings or a
grammar, valid by construction, by llguidance (the [structured] extra).

constraint() compiles and checks what a caller asks for, once (compiled grammars are cached by their text); every
sequence that follows it has a Matcher of its own. Before each token, Matcher.allowed() gives the tokens that keep
the text inside the grammar, a boolean mask over the vocabulary that the Sampler applies after its processors
(where transformers puts its prefix constraint); advance(token) takes the one chosen; ``done`` says the grammar
is complete and takes nothing more, and the sequence ends there (finish "stop"). A grammar that may end but
could go on lets <|endoftext|> through, which ends it too.

llguidance was chosen over xgrammar and outlines-core (docs/structured.md, with the measurements): it needs no
other package, compiles a schema fast, and reads JSON schemas, regexes and Lark grammars (GBNF converted).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import threading
import time
import weakref
from collections.abc import Sequence as _Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, GrammarError
from ..text.tokenizer import Tokenizer, resolve_tokenizer

KINDS = ("json_schema", "regex", "choice", "grammar")  # at most one a sequence
CACHE_SIZE = 64  # compiled grammars kept, the least recently used dropped first
# JSON as compact as json.dumps(separators=(",", ":")) writes it: no whitespace between tokens, so that a model
# cannot spend its tokens on it
JSON_OPTIONS = {"whitespace_flexible": False}


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy
        from llguidance.gbnf_to_lark import gbnf_to_lark
        from llguidance.tiktoken import lltokenizer_from_encoding
    except ImportError:
        raise GrammarError("structured output (json_schema, regex, choice, grammar) needs llguidance: "
                           "pip install -e \".[structured]\"") from None
    return llguidance, gbnf_to_lark, lltokenizer_from_encoding


@dataclass(frozen=True, eq=False)
class Constraint:
    """What a sequence's text must match, compiled: ``kind`` (one of KINDS), ``text`` (as given; a schema as JSON
    text), the vocabulary it was compiled for and how long compiling took. Matcher(constraint) follows it."""

    kind: str
    text: str
    vocab_size: int
    compile_s: float
    _template: object  # an llguidance.LLMatcher that never advances: each Matcher starts as a copy of it

    def __repr__(self) -> str:
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"Constraint({self.kind}={text!r})"


def constraint(*, json_schema=None, regex=None, choice=None, grammar=None, tokenizer: Tokenizer | None = None,
               vocab_size: int | None = None) -> Constraint | None:
    """The Constraint of whichever one of the four is given, or None for none.

    json_schema: a dict or its JSON text (JSON Schema, as OpenAI's structured outputs take it); regex: a regular
    expression the whole text must match (Rust's regex syntax, as llguidance reads it); choice: a non-empty list of
    strings, the text one of them exactly; grammar: a Lark grammar (llguidance's dialect, rule ``start``) or a
    GBNF one (llama.cpp's, rule ``root``; told apart by ``::=``). The tokens are ``tokenizer``'s (GPT-2's by
    default), ``vocab_size`` the model's (default the tokenizer's; at least it). Compiled once per text and
    vocabulary (CACHE_SIZE kept). Raises GrammarError naming the argument and what is wrong with it (two given,
    a schema that is not JSON or not a schema, a regex or grammar that does not parse, llguidance missing), and
    ConfigError for a tokenizer that is not one or a vocabulary smaller than the tokenizer's.
    """
    given = {kind: value for kind, value in zip(KINDS, (json_schema, regex, choice, grammar)) if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(f"give at most one of {', '.join(KINDS)}; got {' and '.join(given)}")
    (kind, value), = given.items()
    tokenizer = resolve_tokenizer(tokenizer)
    vocab = tokenizer.n_vocab if vocab_size is None else vocab_size
    if vocab < tokenizer.n_vocab:
        raise ConfigError(f"structured output needs the model's vocabulary ({vocab}) to hold the tokenizer's "
                          f"{tokenizer.n_vocab} tokens")
    text = _text(kind, value)
    key = (kind, text, tokenizer, vocab)  # (the tokenizer itself: an id could be a later one's)
    with _lock:
        found = _compiled.get(key)
        if found is not None:
            _compiled.move_to_end(key)
            return found
    made = _compile(kind, text, tokenizer, vocab)
    with _lock:
        _compiled[key] = made
        while len(_compiled) > CACHE_SIZE:
            _compiled.popitem(last=False)
    return made


_compiled: collections.OrderedDict = collections.OrderedDict()  # (kind, text, tokenizer, vocab) -> Constraint
_lock = threading.Lock()


def cached() -> int:
    """How many compiled grammars the cache holds (at most CACHE_SIZE)."""
    return len(_compiled)


def _text(kind: str, value) -> str:
    """The constraint's text, checked for its type: a schema as JSON, a choice as a JSON list."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise GrammarError(f"not valid JSON: {e}", kind) from None
        if not isinstance(value, dict):
            raise GrammarError(f"must be a JSON object (a dict), got {type(value).__name__}", kind)
        try:
            return json.dumps(value)  # (in its order: properties are written in the schema's order)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"cannot be written as JSON: {e}", kind) from None
    if kind == "choice":
        if isinstance(value, str) or not isinstance(value, _Sequence) or not value:
            raise GrammarError(f"must be a non-empty list of strings, got {value!r}"[:200], kind)
        for i, option in enumerate(value):
            if not isinstance(option, str) or not option:
                raise GrammarError(f"entry {i} must be a non-empty string, got {option!r}"[:200], kind)
        return json.dumps(list(value))
    if not isinstance(value, str) or not value:
        raise GrammarError(f"must be a non-empty string, got {value!r}"[:200], kind)
    return value


def _compile(kind: str, text: str, tokenizer: Tokenizer, vocab: int) -> Constraint:
    llguidance, gbnf_to_lark, _ = _llguidance()
    lltokenizer = _lltokenizer(tokenizer, vocab)
    start = time.perf_counter()
    if kind == "json_schema":
        source = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    elif kind == "regex":
        source = llguidance.LLMatcher.grammar_from_regex(text)
    elif kind == "choice":
        source = llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(s) for s in json.loads(text)))
    else:
        try:
            lark = gbnf_to_lark(text) if "::=" in text else text
        except Exception as e:  # (its parser's errors: ValueError, AssertionError, ...)
            raise GrammarError(f"not a GBNF grammar llguidance can read: {e}", kind) from None
        source = llguidance.LLMatcher.grammar_from_lark(lark)
    template = llguidance.LLMatcher(lltokenizer, source, log_level=0)
    if template.is_error():
        raise GrammarError(_first_lines(template.get_error()), kind)
    made = Constraint(kind, text, vocab, 0.0, template)
    first = Matcher(made).allowed()  # (the first mask also builds what llguidance builds lazily: timed too)
    first[tokenizer.eot_id] = False
    if not first.any():
        raise GrammarError("matches no text but the empty one: nothing to generate", kind)
    return dataclasses.replace(made, compile_s=time.perf_counter() - start)


def _first_lines(message: str, lines: int = 6) -> str:
    return "\n".join(message.strip().splitlines()[:lines])


_lltokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> {vocab: LLTokenizer}


def _lltokenizer(tokenizer: Tokenizer, vocab: int):
    """llguidance's view of the tokenizer's vocabulary (its token bytes, from tiktoken's tables): built once
    per tokenizer and vocabulary size (a tenth of a second for GPT-2's)."""
    _, _, from_encoding = _llguidance()
    with _lock:
        made = _lltokenizers.setdefault(tokenizer, {})
        if vocab not in made:
            made[vocab] = from_encoding(tokenizer.encoding, n_vocab=vocab, eos_token=tokenizer.eot_id)
        return made[vocab]


class Matcher:
    """One sequence's place in its Constraint: which tokens may come next, and whether the text is complete."""

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self._matcher = constraint._template.deep_copy()
        self._bits = np.empty((1, (constraint.vocab_size + 31) // 32), np.int32)  # llguidance's mask, a bit a token

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens that keep the text inside the grammar (<|endoftext|> where it may end)."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), count=self.constraint.vocab_size,
                             bitorder="little").view(bool)

    def advance(self, token: int) -> None:
        """Take the token chosen. GrammarError if the grammar does not allow it (a caller that did not mask)."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} does not follow it: {_first_lines(self._matcher.get_error(), 2)}",
                               self.constraint.kind)

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and takes no more tokens (after <|endoftext|>, or a closed object)."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """Whether the text so far is a whole match (it could end here)."""
        return self._matcher.is_accepting()

    def fork(self) -> Matcher:
        """A Matcher at the same place that advances on its own (a beam's child)."""
        other = Matcher.__new__(Matcher)
        other.constraint, other._matcher = self.constraint, self._matcher.deep_copy()
        other._bits = np.empty_like(self._bits)
        return other


def per_sequence(count: int, constraints, tokenizer: Tokenizer | None, vocab_size: int, **one) -> list:
    """Each of ``count`` prompts' Constraint (or None): ``constraints`` (a list of Constraint or None, one a
    prompt), or the one of ``one`` (json_schema, regex, choice, grammar) for every prompt; not both."""
    if constraints is None:
        made = constraint(**one, tokenizer=tokenizer, vocab_size=vocab_size)
        return [made] * count
    if any(value is not None for value in one.values()):
        raise GrammarError(f"give constraints (one a prompt) or {', '.join(KINDS)} (for every prompt), not both")
    if isinstance(constraints, (str, bytes)) or not isinstance(constraints, _Sequence) or len(constraints) != count:
        raise GrammarError(f"must be a list of {count} entries (one a prompt), each a Constraint "
                           "(gpt2numba.constraint) or None", "constraints")
    for i, c in enumerate(constraints):
        if c is not None and not isinstance(c, Constraint):
            raise GrammarError(f"entry {i} must be a Constraint (gpt2numba.constraint) or None, got "
                               f"{type(c).__name__}", "constraints")
        if c is not None and c.vocab_size != vocab_size:
            raise GrammarError(f"entry {i} was compiled for a vocabulary of {c.vocab_size}; the model's is "
                               f"{vocab_size}", "constraints")
    return list(constraints)

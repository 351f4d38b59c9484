"""Generation: sampling settings; one prefill, then decode steps, for one sequence or many at once."""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field, fields

import numpy as np

from ..errors import CacheFullError, ConfigError, PartialBatchError, SamplingError, TokenTypeError
from ..model import checks
from ..model.forward import decode_step, prefill
from ..model.kvcache import ModelCache, check_kv_dtype
from ..model.weights import GPT2Weights
from ..text.tokenizer import Tokenizer, resolve_tokenizer
from . import speculative
from .batching import Batch, Fault, Sequence, SharedPrompt, next_token
from .constraints import Matcher, constraint as _constraint, per_sequence
from .processors import Processors


@dataclass(frozen=True)
class Sampler:
    """How the next token is chosen from the logits: transformers' processors and warpers, in its order.

    First the processors (processors.Processors: logit_bias, repetition_penalty, presence_penalty,
    frequency_penalty, no_repeat_ngram_size, bad_words_ids, min_new_tokens with eos_token_id), then
    temperature 0 is greedy (argmax); otherwise softmax(logits / temperature), cut to the top_k most likely,
    then to the smallest set whose probability reaches top_p, then to the tokens at least min_p times as
    likely as the most likely, then to typical_p's locally typical set (transformers' TypicalLogitsWarper).
    Each cut keeps at least one token.

    top_k ranks the logits as given (after the processors, before the
    temperature, in float64): the temperature cannot reorder them, but its
    rounding could make two different logits equal. Equal logits are ranked by
    id, the lower first, so a tie at the k-th place keeps the lower id.
    Raises SamplingError naming a setting out of its range.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    min_p: float | None = None
    typical_p: float | None = None
    _: KW_ONLY
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    eos_token_id: int | tuple[int, ...] | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    processors: Processors = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        t, k = self.temperature, self.top_k
        if not checks.is_real(t) or not 0 <= t < math.inf:
            raise SamplingError(f"temperature must be a finite number >= 0, got {t!r}")
        if k is not None and (not checks.is_integer(k) or k < 1):
            raise SamplingError(f"top_k must be an integer >= 1 or None, got {k!r}")
        for name in ("top_p", "typical_p"):
            value = getattr(self, name)
            if value is not None and (not checks.is_real(value) or not 0 < value <= 1):
                raise SamplingError(f"{name} must be in (0, 1] or None, got {value!r}")
        if self.min_p is not None and (not checks.is_real(self.min_p) or not 0 <= self.min_p <= 1):
            raise SamplingError(f"min_p must be in [0, 1] or None, got {self.min_p!r}")
        for name in ("top_p", "typical_p"):  # 1 keeps every token: off, as in transformers
            if getattr(self, name) == 1:
                object.__setattr__(self, name, None)
        settings = {f.name: getattr(self, f.name) for f in fields(Processors) if f.init}
        object.__setattr__(self, "processors", Processors(**settings))

    def __call__(self, logits, previous, rng: np.random.Generator, prompt_len: int = 0,
                 allowed: np.ndarray | None = None) -> int:
        """One token id from float logits (vocab,), given the ids so far (ids in [0, vocab)), of which the
        first ``prompt_len`` are the prompt (for presence, frequency and min_new_tokens). ``allowed``: a
        constraint's mask (vocab,) bool (constraints.Matcher.allowed): after the processors, where
        transformers puts its prefix constraint, only those tokens are sampled among, as if the others were
        -inf (the same token from the same stream; an exp of -inf is slow, so they are left out instead). A
        mask of one token chooses it whatever the processors did: the grammar wins (min_new_tokens cannot keep
        open a text the grammar ends with <|endoftext|>)."""
        z = np.array(logits, dtype=np.float64)
        if z.ndim != 1 or z.size == 0:
            raise SamplingError(f"logits must be a non-empty 1-D array, got shape {z.shape}")
        if allowed is not None and (not isinstance(allowed, np.ndarray) or allowed.dtype != bool
                                    or allowed.shape != z.shape):
            raise SamplingError(f"allowed must be a bool mask of the logits' shape {z.shape}, got "
                                f"{getattr(allowed, 'dtype', type(allowed).__name__)} {np.shape(allowed)}")
        ids = None if allowed is None else np.flatnonzero(allowed)  # the constraint's tokens, in id order
        if ids is not None and ids.size == 1:
            if self.temperature != 0:
                rng.random()  # (the draw a sample takes: the stream goes on as after any other sample)
            return int(ids[0])
        z = self._processed(z, previous, prompt_len, ids)
        token = self._pick(z, rng)
        return token if ids is None else int(ids[token])

    def probabilities(self, logits, previous, prompt_len: int = 0) -> np.ndarray:
        """float64 (vocab,): the probability of each token that __call__ (without a mask) samples it with, after
        the processors, the temperature and the cuts; greedy (temperature 0) is all on the argmax. Speculative
        decoding's p and q (speculative.py). Raises SamplingError as __call__ does."""
        z = self._processed(np.array(logits, dtype=np.float64), previous, prompt_len)
        p = np.zeros(z.size)
        if self.temperature == 0:
            p[np.argmax(z)] = 1.0
            return p
        z, candidates = self._tempered(z)
        candidates = slice(None) if candidates is None else candidates
        p[candidates] = _softmax(z[candidates])
        return p

    def _processed(self, z: np.ndarray, previous, prompt_len: int, ids: np.ndarray | None = None) -> np.ndarray:
        """z (vocab,) float64 after the processors (in place), then only the ``ids`` a constraint allows."""
        if self.processors.active:
            self.processors(z, checks.token_ids(previous, z.size) if len(previous) else [], prompt_len)
        if ids is not None:
            z = z[ids]
        if (self.processors.active or ids is not None) and (z.size == 0 or z.max() == -np.inf):
            raise SamplingError("every token is banned (bad_words_ids, no_repeat_ngram_size, logit_bias, "
                                "min_new_tokens" + (", the constraint" if ids is not None else "") + ")")
        return z

    def _pick(self, z: np.ndarray, rng: np.random.Generator) -> int:
        """The index in z (processed logits, float64) of the token chosen: greedy, or sampled after the cuts."""
        if self.temperature == 0:
            return int(np.argmax(z))
        z, candidates = self._tempered(z)
        weights = np.exp(z[candidates] if candidates is not None else z, out=None if candidates is not None else z)
        cumulative = np.cumsum(weights, out=weights)  # (z <= 0: exp(z) <= 1, unnormalised)
        pick = min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")), len(weights) - 1)
        return int(candidates[pick]) if candidates is not None else pick

    def _tempered(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(z - max over the temperature, the ids the cuts keep or None when none is set) for processed logits z
        (float64) at a temperature above 0: what _pick samples from and probabilities gives."""
        cut = self.top_k is not None or self.top_p is not None or self.min_p or self.typical_p is not None
        ranked = z.copy() if self.top_k is not None else None  # top_k ranks these: see the class's docstring
        with np.errstate(over="ignore"):  # <= 0: a tiny temperature gives -inf, never nan
            z = (z - z.max()) / self.temperature
        return z, self.candidates(z, ranked) if cut else None  # (with no cut, no index array: it cost 0.3 ms)

    def candidates(self, z: np.ndarray, ranked: np.ndarray | None = None) -> np.ndarray:
        """Ids allowed by top_k, top_p, min_p and typical_p for tempered logits z: most likely first, or all
        in id order when none is set.

        ranked: what top_k ranks, (vocab,) in the same order as z: the logits before the
        temperature (default: z itself). Equal values are ranked by id, the lower first.
        """
        if self.top_k is None and self.top_p is None and not self.min_p and self.typical_p is None:
            return np.arange(z.size)  # no cut, no sort: a full sort costs more than the rest of sampling
        ranked = z if ranked is None else ranked
        if self.top_k is not None and self.top_k < z.size:
            negated = -ranked
            best = np.argpartition(negated, self.top_k - 1)[: self.top_k]  # a tie at the k-th: any of them
            kth = negated[best].max()
            above = best[negated[best] < kth]  # then, of the values equal to the k-th, the lowest ids
            best = np.concatenate([above, np.flatnonzero(negated == kth)[: self.top_k - above.size]])
            order = best[np.lexsort((best, negated[best]))]  # most likely first, ties by id
        else:  # (by what top_k ranks, as above when it cuts: the same order whether or not a constraint
            order = np.argsort(-ranked, kind="stable")  # left fewer tokens than top_k)
        if self.top_p is not None:
            probs = _softmax(z[order])  # renormalised over the top_k set, as is usual
            # smallest prefix whose mass reaches top_p: the first index where the sum >= p
            keep = int(np.searchsorted(np.cumsum(probs), self.top_p * (1 - 1e-12), side="left")) + 1
            order = order[: min(keep, len(order))]
        if self.min_p:
            probs = _softmax(z[order])  # most likely first: probs[0] is the largest
            order = order[: max(1, int(np.count_nonzero(probs >= self.min_p * probs[0])))]
        if self.typical_p is not None:
            order = order[_typical(z[order], self.typical_p)]
        return order


def _typical(z: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling's cut of logits z (most likely first): the indices of those kept, in order.
    Tokens are taken by how close their surprise is to the entropy until their mass reaches ``mass``
    (transformers' TypicalLogitsWarper, with one token kept at least)."""
    with np.errstate(divide="ignore"):
        logp = np.log(_softmax(z))
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):  # (a banned token's -inf x 0: nan, which nansum leaves out)
        entropy = -np.nansum(logp * p)
    distance = np.abs(-logp - entropy)
    by_distance = np.argsort(distance, kind="stable")
    cumulative = np.cumsum(p[by_distance])
    last = min(int(np.count_nonzero(cumulative < mass)), z.size - 1)
    keep = distance <= distance[by_distance[last]]
    keep[by_distance[0]] = True
    return np.flatnonzero(keep)


def generate(prompt_ids, w: GPT2Weights, *, max_new_tokens: int, seed: int | None = None,
             stop_at_eos: bool = True, slide: bool = False, cache: ModelCache | None = None,
             kv_dtype: str | None = None, json_schema=None, regex=None, choice=None, grammar=None,
             tokenizer: Tokenizer | None = None, draft=None, num_speculative_tokens: int | None = None,
             prompt_lookup_num_tokens: int | None = None, max_matching_ngram_size: int | None = None,
             **sampling) -> Iterator[int]:
    """Yield new token ids one at a time: one prefill, then a decode step per token.

    ``sampling``: Sampler's settings (temperature, top_k, top_p, min_p, typical_p, repetition_penalty,
    no_repeat_ngram_size, min_new_tokens, eos_token_id, bad_words_ids, presence_penalty,
    frequency_penalty, logit_bias), with transformers' meaning and order.
    Stops after max_new_tokens, or after yielding an end-of-text id (eos_token_id: <|endoftext|> unless
    given) when stop_at_eos.
    The sequence may not pass the model's n_positions: when prompt plus
    max_new_tokens would, CacheFullError is raised before any work, unless
    ``slide``, which keeps the newest half of the context, re-prefills it at
    positions 0.., and goes on. The same seed gives the same tokens.
    ``cache`` (max_len = n_positions) is used instead of a new one; ``kv_dtype`` is the new one's
    dtype (kvcache.KV_DTYPES; default float32), or must be the given cache's.
    ``json_schema``, ``regex``, ``choice`` or ``grammar`` (at most one; constraints.constraint, over
    ``tokenizer``'s tokens, GPT-2's by default): every token keeps the text inside it, and the generation ends
    when the text is complete and can take nothing more (or at <|endoftext|>, which it allows where the text
    may end); cut short by max_new_tokens, the text is a prefix of a valid one.
    Speculative decoding (speculative.py; the same tokens greedy, the same distribution sampled): ``draft``
    "int4", "int8" or "bfloat16" (these weights in that format), other GPT2Weights of the same vocabulary or a
    checkpoint's path, drafting ``num_speculative_tokens`` a pass (default: adapted to how many are kept); or
    ``prompt_lookup_num_tokens`` tokens copied from where the last n-gram (n at most
    ``max_matching_ngram_size``, default 2) occurred before. Not with ``slide`` or a constraint.
    Raises SamplingError for settings out of range, TokenError/TokenTypeError
    for bad prompt ids, ConfigError for a bad cache, kv_dtype or speculation, GrammarError for a constraint
    that does not compile.
    """
    checks.weights(w)
    cfg = w.config
    sampler = _settings(sampling, cfg.vocab_size, max_new_tokens, seed)
    speculation = (draft, num_speculative_tokens, prompt_lookup_num_tokens, max_matching_ngram_size)
    constrained = any(c is not None for c in (json_schema, regex, choice, grammar))
    if speculative.check(*speculation) is not None and (slide or constrained):
        raise ConfigError(f"speculative decoding does not take {'slide' if slide else 'a constraint'} yet")
    constraint = _constraint(json_schema=json_schema, regex=regex, choice=choice, grammar=grammar,
                             tokenizer=tokenizer, vocab_size=cfg.vocab_size)
    ids = [int(t) for t in checks.token_ids(prompt_ids, cfg.vocab_size)]
    if len(ids) > cfg.n_positions:
        raise CacheFullError(f"the prompt has {len(ids)} tokens; the model's context is {cfg.n_positions}")
    if not slide and len(ids) + max_new_tokens > cfg.n_positions:
        raise CacheFullError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} "
            f"passes the model's context of {cfg.n_positions} positions; ask for fewer tokens or slide=True"
        )
    if kv_dtype is not None:
        check_kv_dtype(kv_dtype)
    if cache is None:
        cache = ModelCache(cfg, dtype=kv_dtype or "float32")
    elif not isinstance(cache, ModelCache) or cache.config != cfg or cache.max_len != cfg.n_positions:
        raise ConfigError("generate needs a cache of the weights' config with max_len = n_positions")
    elif kv_dtype is not None and cache.dtype != kv_dtype:
        raise ConfigError(f"kv_dtype={kv_dtype!r} but the cache given is {cache.dtype}: give one or the other")
    spec = speculative.plan(w, *speculation)  # (last: it may make the draft's weights, or load them)
    rng = np.random.default_rng(seed)
    if spec is not None:
        return speculative.generate(ids, w, cache, sampler, max_new_tokens, rng, stop_at_eos, spec)
    return _generate(ids, w, cache, sampler, max_new_tokens, rng, stop_at_eos, constraint)


def _generate(ids, w, mc, sampler, max_new_tokens, rng, stop_at_eos, constraint):
    mc.reset()
    if max_new_tokens == 0:
        return
    logits = prefill(ids, w, mc)
    prompt_len = len(ids)
    matcher = Matcher(constraint) if constraint is not None else None
    for n in range(max_new_tokens):
        token = next_token(sampler, logits, ids, rng, prompt_len, matcher)
        ids.append(token)
        yield token
        if (stop_at_eos and token in sampler.processors.eos_token_id) or n == max_new_tokens - 1:
            return
        if matcher is not None and matcher.done:
            return
        if mc.room == 0:  # only reached with slide=True: keep the newest half, re-prefill
            mc.reset()
            logits = prefill(ids[-max(1, mc.max_len // 2):], w, mc)
        else:
            logits = decode_step(token, w, mc)


def generate_batch(prompts, w: GPT2Weights, *, max_new_tokens: int, seed: int | None = None,
                   stop_at_eos: bool = True, batch_size: int | None = None, n: int = 1,
                   kv_dtype: str = "float32", **options) -> Iterator[tuple[int, int]]:
    """Generate for many prompts at once; yield (index, token_id) as tokens are produced.

    ``options``: Sampler's settings, as for generate, and a constraint: json_schema, regex, choice or grammar
    for every prompt (as generate takes them, with ``tokenizer``), or ``constraints``, a list with one
    Constraint (gpt2numba.constraint) or None a prompt. Each sequence follows its own. Or speculative
    decoding's settings, as generate takes them: each sequence drafts on its own, the drafts of all in one pass
    of the draft model a token, and the model checks them in the step's one pass.
    ``n`` samples of each prompt: sequence index = prompt_index * n + j for its j-th (index =
    prompt_index when n is 1). A prompt is prefilled once for its n samples (and for every
    repetition of it in ``prompts``); the others copy its cache rows (ModelCache.copy_prefix).

    At most ``batch_size`` sequences (default: all) are in flight, each in its own
    cache slot; every step is one forward pass over all of them. Each sequence
    stops on its own, at an end-of-text id (when stop_at_eos) or after
    max_new_tokens, and the next waiting prompt is prefilled into its slot in the
    same pass as the others' next tokens (continuous batching). With ``seed``,
    sequence i samples from its own stream, derived from (seed, i), so its tokens
    do not depend on the other prompts or on batch_size; greedy tokens equal
    generate's for each prompt alone. Each sequence's cache keeps its keys and values in
    ``kv_dtype`` (kvcache.KV_DTYPES). Everything is checked before any work:
    SamplingError for settings (n an integer >= 1), ConfigError for kv_dtype, TokenError /
    TokenTypeError naming the prompt,
    CacheFullError when a prompt plus max_new_tokens passes n_positions,
    BatchError for no prompts, GrammarError for a constraint.
    A sequence that fails during the work (a SamplingError when its settings leave no token, its constraint's
    or its draft's error) stops alone; the others go on with the tokens they would have had without it, and
    once they are done PartialBatchError is raised, its ``errors`` by sequence index. What the forward pass
    raises ends the whole batch.
    """
    steps = _batch_steps(prompts, w, max_new_tokens=max_new_tokens, seed=seed, stop_at_eos=stop_at_eos,
                         batch_size=batch_size, n=n, kv_dtype=kv_dtype, **options)
    return ((i, token) for i, token, *_ in steps)


def _batch_steps(prompts, w, *, max_new_tokens, seed=None, stop_at_eos=True, batch_size=None, n=1,
                 kv_dtype="float32", streams=None, json_schema=None, regex=None, choice=None, grammar=None,
                 constraints=None, tokenizer=None, draft=None, num_speculative_tokens=None,
                 prompt_lookup_num_tokens=None, max_matching_ngram_size=None, stats=None, **sampling):
    """generate_batch's checks, then its tokens as (sequence index, token_id, whether that sequence is done,
    its logits row (vocab,) float32, valid until the next step).

    streams: each prompt's number in a longer list of prompts that a caller runs in parts (distributed.py,
    Ray Data's blocks): sequence (prompt k, sample j) draws from (seed, streams[k] * n + j), as it would in
    one generate_batch over the whole list; default range(len(prompts)). Ints >= 0, checked by the caller.
    stats: a speculative.Stats that counts what speculation does (profiling/speculative.py).
    """
    checks.weights(w)
    cfg = w.config
    sampler = _settings(sampling, cfg.vocab_size, max_new_tokens, seed)
    if batch_size is not None and (not checks.is_integer(batch_size) or batch_size < 1):
        raise SamplingError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
    if not checks.is_integer(n) or n < 1:
        raise SamplingError(f"n must be an integer >= 1, got {n!r}")
    check_kv_dtype(kv_dtype)
    prompts = checks.prompts(prompts, cfg, max_new_tokens)
    each = per_sequence(len(prompts), constraints, tokenizer, cfg.vocab_size, json_schema=json_schema, regex=regex,
                        choice=choice, grammar=grammar)
    speculation = (draft, num_speculative_tokens, prompt_lookup_num_tokens, max_matching_ngram_size)
    if speculative.check(*speculation) is not None and any(c is not None for c in each):
        raise ConfigError("speculative decoding does not take a constraint yet")
    spec = speculative.plan(w, *speculation)  # (last: it may make the draft's weights, or load them)
    checked = [ids for ids in prompts for _ in range(n)]
    each = [c for c in each for _ in range(n)]
    slots = min(batch_size or len(checked), len(checked))
    numbers = range(len(checked)) if streams is None else [k * n + j for k in streams for j in range(n)]
    rngs = [np.random.default_rng(None if seed is None else [seed, i]) for i in numbers]
    return _generate_batch(checked, w, sampler, max_new_tokens, rngs, stop_at_eos, slots, kv_dtype, each, spec, stats)


def _generate_batch(prompts, w, sampler, max_new_tokens, rngs, stop_at_eos, slots, kv_dtype, each, spec, stats):
    if max_new_tokens == 0:
        return
    batch = Batch(w, slots, kv_dtype=kv_dtype, speculation=spec)
    batch.stats = stats if stats is not None else batch.stats
    shared = _shared_prompts(prompts)
    waiting = collections.deque(range(len(prompts)))
    index_of: dict[Sequence, int] = {}  # sequence in flight -> its index
    errors: dict[int, Exception] = {}  # index -> what failed it
    while waiting or batch.sequences:
        while waiting and not batch.full:  # a free slot takes the next sequence
            i = waiting.popleft()
            index_of[batch.add(prompts[i], max_new_tokens=max_new_tokens, sampler=sampler, rng=rngs[i],
                               stop_at_eos=stop_at_eos, shared=shared[i], constraint=each[i])] = i
        for out in batch.step():
            if isinstance(out, Fault):  # (it has left the batch, its caches with it)
                errors[index_of.pop(out.sequence)] = out.error
                continue
            seq, token, done, row = out
            yield index_of[seq], token, done, row
            if done:  # (its caches go with it)
                del index_of[seq]
    if errors:
        raise PartialBatchError(errors, len(prompts))


def _shared_prompts(prompts: list[list[int]]) -> list[SharedPrompt | None]:
    """Per sequence, the SharedPrompt of its prompt if that prompt occurs more than once (n samples of it,
    or the same prompt repeated): it is prefilled once for all of them."""
    uses = collections.Counter(map(tuple, prompts))
    made = {ids: SharedPrompt(count) for ids, count in uses.items() if count > 1}
    return [made.get(tuple(ids)) for ids in prompts]


def generate_text_batch(texts, w: GPT2Weights, tokenizer: Tokenizer | None = None, **options) -> list[str]:
    """generate_batch from texts to texts: the generated continuations, in input order (with n, text i's
    j-th sample at i * n + j).

    An empty text starts from <|endoftext|>; <|endoftext|> ends a text and is not shown.
    Raises TokenTypeError for a text that is not a str, ConfigError for a tokenizer that is
    not a Tokenizer, and what generate_batch raises; its PartialBatchError carries the texts (None for a
    failed one).
    """
    texts = checks.sequence(texts, "texts")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TokenTypeError(f"text {i} must be a str, got {type(text).__name__}")
    tokenizer = resolve_tokenizer(tokenizer)
    steps = _batch_steps([prompt_ids(t, tokenizer) for t in texts], w, tokenizer=tokenizer, **options)
    tokens: list[list[int]] = [[] for _ in range(len(texts) * options.get("n", 1))]
    try:
        for i, token, *_ in steps:
            if token != tokenizer.eot_id:
                tokens[i].append(token)
    except PartialBatchError as e:
        raise PartialBatchError(e.errors, e.total, [None if i in e.errors else tokenizer.decode(t)
                                                    for i, t in enumerate(tokens)]) from None
    return [tokenizer.decode(t) for t in tokens]


def generate_text(prompt: str, w: GPT2Weights, tokenizer: Tokenizer | None = None, **options) -> Iterator[str]:
    """Like generate, from text to text: yields decoded pieces as tokens arrive.

    A piece never ends inside a multi-byte character (bytes wait for the rest);
    <|endoftext|> ends the text and is not shown.
    """
    tokenizer = resolve_tokenizer(tokenizer)
    if not isinstance(prompt, str):
        raise SamplingError(f"prompt must be a str, got {type(prompt).__name__}")
    tokens = generate(prompt_ids(prompt, tokenizer), w, tokenizer=tokenizer, **options)
    return (text for _, text in text_stream(tokens, tokenizer) if text)


def prompt_ids(prompt: str, tokenizer: Tokenizer) -> list[int]:
    """The prompt's ids; an empty prompt is <|endoftext|>, GPT-2's start of an unconditioned text."""
    return tokenizer.encode(prompt) or [tokenizer.eot_id]


def text_stream(tokens, tokenizer: Tokenizer):
    """(token, text) for each token as it arrives, then (None, text held back at the end).

    text is "" while a character's bytes are incomplete, and for <|endoftext|>.
    """
    decode = tokenizer.stream_decoder()
    for token in tokens:
        yield token, "" if token == tokenizer.eot_id else decode(token)
    yield None, decode(None)  # bytes of a character the generation stopped inside


def _settings(sampling: dict, vocab_size: int, max_new_tokens, seed) -> Sampler:
    """The Sampler of ``sampling`` (its settings by name), its ids checked against the vocabulary, once
    max_new_tokens and seed are checked too."""
    checks.known_settings(sampling, [f.name for f in fields(Sampler) if f.init])
    sampler = Sampler(**sampling)
    sampler.processors.check_vocab(vocab_size, default_eos=sampling.get("eos_token_id") is None)
    if not checks.is_integer(max_new_tokens) or max_new_tokens < 0:
        raise SamplingError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if seed is not None and (not checks.is_integer(seed) or seed < 0):
        raise SamplingError(f"seed must be an integer >= 0 or None, got {seed!r}")
    return sampler


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


"""The forward pass over the rows of one or many sequences, and its validating wrappers.

A batch is ragged, as llama.cpp's llama_batch and FlashAttention's varlen API:
the new tokens of B sequences are stacked into N rows, row0 (B + 1,) marks where
each sequence's rows begin and pos0 (B,) the position of its first row (the
length its cache held). The matrix products see only the N stacked rows, so the
weights are read once for the whole batch; the cache write and attention take
row0 and pos0 and stay within each sequence, over its own cache. prefill and
decode_step are the one-sequence case of the same pass.

Every wrapper validates everything before any work, and a cache's length moves
only once its logits exist: a call that raises leaves every cache as it was.
Scoring (scoring.py), the token view (tokenview.py) and the server's prompt
log-probabilities (serve/logprobs.py) run the same pass with a head of their own:
checked_prompt, forward_pass and logits_head are the package's internal API for that.
Shapes: N = rows, B = sequences, C = n_embd, V = vocab_size.
"""

from __future__ import annotations

import numba
import numpy as np

from ..cpu import dispatch, pool, threadlayer
from ..cpu.attention import _attend, _attention_plan
from ..cpu.kernels import _gelu, _layernorm, _write_kv
from ..errors import BatchError, CacheFullError, ConfigError, GPT2NumbaError
from . import checks, compact, kvcache
from .kvcache import ModelCache
from .models import default_weights  # where weights come from; the package names it from here
from .products import head_logits, matmul, one_blas_thread, workspace
from .weights import GPT2Weights


def prefill(prompt_ids, w: GPT2Weights, mc: ModelCache, logits: str = "last") -> np.ndarray:
    """Run the prompt through the model in one batched pass, filling the cache.

    prompt_ids: non-empty 1-D integer ids in [0, vocab). Token i sits at position
    mc.length + i, so a cache that already holds tokens is continued.
    Returns float32 (vocab,): the next-token logits after the last prompt token;
    with logits="all", float32 (T, vocab): the logits after every prompt token.
    Raises TokenTypeError / TokenError for bad ids, CacheFullError when the
    prompt needs more than the cache's room, ConfigError when the cache was built
    for another config (or for another value of ``logits``); the cache is then unchanged.
    """
    checks.weights(w)
    if logits not in ("last", "all"):
        raise ConfigError(f'logits must be "last" or "all", got {logits!r}')
    rows = forward_pass([checked_prompt(prompt_ids, w, mc, "")], w, [mc], logits_head(w), every_row=logits == "all")
    return rows if logits == "all" else rows[0]


def decode_step(token_id: int, w: GPT2Weights, mc: ModelCache) -> np.ndarray:
    """Feed one token at position mc.length; return float32 (vocab,) next-token logits.

    Raises TokenTypeError / TokenError for a bad id, CacheFullError when the
    cache is full, ConfigError for a cache of another config; the cache is
    then unchanged.
    """
    checks.weights(w)
    return forward_pass([_token(token_id, w, mc, "")], w, [mc], logits_head(w))[0]


def prefill_batch(prompts, w: GPT2Weights, caches, *, out: np.ndarray | None = None,
                  every_row=None) -> np.ndarray:
    """Prefill B prompts into their B caches in one forward pass.

    prompts: B non-empty id sequences of any lengths; caches: B distinct
    ModelCaches of w's config, each continued from its own length. Row b of the
    float32 (B, vocab) result is what prefill(prompts[b], w, caches[b]) returns.
    ``every_row``, B bools: the prompts marked give the logits after every token (prefill's logits="all"),
    in order, the others after their last: (R, vocab), R the rows asked for.
    ``out``, a float32 (R, vocab) array, receives the logits instead of a new one.
    Raises what prefill raises, naming the prompt's index, and BatchError for an
    empty batch, counts that differ or a cache given twice; then no cache changes.
    """
    checks.weights(w)
    prompts, caches = _pairs(prompts, caches, "prompts")
    rows = [checked_prompt(ids, w, mc, f"prompt {b}: ") for b, (ids, mc) in enumerate(zip(prompts, caches))]
    if every_row is not None:
        every_row = [bool(e) for e in checks.sequence(every_row, "every_row")]
        if len(every_row) != len(rows):
            raise BatchError(f"every_row has {len(every_row)} entries for {len(rows)} prompts: give one a prompt")
    R = len(rows) if every_row is None else sum(len(ids) if e else 1 for ids, e in zip(rows, every_row))
    return forward_pass(rows, w, caches, logits_head(w, out, R), every_row=every_row or False)


def decode_batch(token_ids, w: GPT2Weights, caches, *, out: np.ndarray | None = None) -> np.ndarray:
    """One new token per cache, each at that cache's own length, in one forward pass.

    token_ids: B integer ids; caches: B distinct ModelCaches of w's config.
    Row b of the float32 (B, vocab) result is what decode_step(token_ids[b], w,
    caches[b]) returns. ``out`` as in prefill_batch. Raises what decode_step
    raises, naming the index, and BatchError as prefill_batch; then no cache changes.
    """
    checks.weights(w)
    if isinstance(token_ids, np.ndarray) and token_ids.ndim != 1:
        raise BatchError(f"token_ids must be 1-D, one id per cache; got an array of shape {token_ids.shape}")
    token_ids, caches = _pairs(token_ids, caches, "token_ids")
    rows = [_token(t, w, mc, f"token {b}: ") for b, (t, mc) in enumerate(zip(token_ids, caches))]
    return forward_pass(rows, w, caches, logits_head(w, out, len(rows)))


def embed_token(token_id: int, position: int, w: GPT2Weights) -> np.ndarray:
    """wte[token_id] + wpe[position], float32 (n_embd,)."""
    checks.weights(w)
    cfg = w.config
    token_id = checks.token_id(token_id, cfg.vocab_size)
    position = checks.position(position, cfg.n_positions)
    return _embed(np.array([token_id]), np.array([position]), w)[0]


def run_prefill(prompt_ids) -> np.ndarray:
    """Prefill ``prompt_ids`` into a fresh cache on the default weights; return the logits."""
    w = default_weights()
    return prefill(prompt_ids, w, ModelCache(w.config))


def set_threads(n: int) -> None:
    """Use ``n`` threads (1 to the number Numba started with, by default the cores); above the pool's size
    (a cgroup quota's, $GPT2NUMBA_THREADS'), the pool grows to n."""
    top = numba.config.NUMBA_NUM_THREADS
    if not checks.is_integer(n) or not 1 <= n <= top:
        raise ConfigError(f"threads must be an integer in [1, {top}], got {n!r}")
    numba.set_num_threads(int(n))
    pool.grow(int(n))


def get_threads() -> int:
    return numba.get_num_threads()


threadlayer.launch()  # TBB or workqueue beneath, never a second OpenMP runtime beside torch's (threadlayer.py)
if pool.enabled():
    pool.install()
_REGIONS_ON_LAYER = not pool.enabled()  # for good: a process picks where its regions run once


# --- validation: everything is checked before any cache is touched -----------------------------------

def _pairs(items, caches, what: str) -> tuple[list, list[ModelCache]]:
    """items and caches as two lists of the same non-zero length, no cache twice."""
    if isinstance(caches, ModelCache):
        raise BatchError(f"caches must be a sequence of ModelCache, one per sequence; got one ModelCache "
                         f"(for a single sequence use {'prefill' if what == 'prompts' else 'decode_step'})")
    items, caches = checks.sequence(items, what), checks.sequence(caches, "caches")
    if not caches:
        raise BatchError("the batch is empty: give at least one sequence and its cache")
    if len(items) != len(caches):
        raise BatchError(f"{len(items)} {what} but {len(caches)} caches: give one cache per sequence")
    first = {}
    for b, mc in enumerate(caches):
        if id(mc) in first:
            raise BatchError(f"caches {first[id(mc)]} and {b} are the same ModelCache: each sequence needs its own")
        first[id(mc)] = b
    kinds = [getattr(mc, "dtype", None) for mc in caches]  # (what is not a ModelCache is refused later)
    for b, kind in enumerate(kinds):
        if kind is not None and kinds[0] is not None and kind != kinds[0]:
            raise BatchError(f"cache 0 is {kinds[0]} but cache {b} is {kind}: one pass takes caches of one dtype")
    return items, caches


def _check_cache(w: GPT2Weights, mc, label: str) -> None:
    if not isinstance(mc, ModelCache):
        raise ConfigError(f"{label}expected a ModelCache, got {type(mc).__name__}")
    if mc.config != w.config:
        raise ConfigError(f"{label}the cache was built for {mc.config}, the weights are {w.config}")


def checked_prompt(prompt_ids, w: GPT2Weights, mc, label: str) -> np.ndarray:
    """One checked prompt, int64 (T,), that fits its cache; ``label`` starts every message."""
    _check_cache(w, mc, label)
    ids = checks.labelled(label, checks.token_ids, prompt_ids, w.config.vocab_size)
    if len(ids) > mc.room:
        raise CacheFullError(
            f"{label}a prompt of {len(ids)} tokens does not fit: the cache holds {mc.length} of "
            f"max_len={mc.max_len} positions, room for {mc.room}"
        )
    return ids


def _token(token_id, w: GPT2Weights, mc, label: str) -> np.ndarray:
    """One checked token as int64 (1,), with room in its cache."""
    _check_cache(w, mc, label)
    token_id = checks.labelled(label, checks.token_id, token_id, w.config.vocab_size)
    if mc.room == 0:
        raise CacheFullError(f"{label}the cache is full: all max_len={mc.max_len} positions hold tokens")
    return np.array([token_id], np.int64)


# --- the forward pass -----------------------------------------------------------------------------------

def forward_pass(seqs: list[np.ndarray], w: GPT2Weights, caches: list[ModelCache], head, every_row=False):
    """All blocks over the checked new ids of B sequences; then ``head`` on the final rows.

    seqs[b]: int64 (T_b,) ids at positions caches[b].length..; the caches are
    distinct and have room. head(h, n_chunks) takes h: float32 (R, C), the rows
    after ln_f (each sequence's last row; with every_row True all N rows in order; with every_row B bools,
    all rows of the sequences marked, the last of the others, in order),
    and returns the result: the logits, or what scoring keeps of them. The
    caches' lengths move only once the head has succeeded.
    """
    cfg, B = w.config, len(seqs)
    counts = np.array([len(s) for s in seqs], np.int64)
    row0 = np.zeros(B + 1, np.int64)  # sequence b's rows: row0[b]..row0[b+1]-1
    np.cumsum(counts, out=row0[1:])
    pos0 = np.array([mc.length for mc in caches], np.int64)  # (B,) position of each first row
    N = int(row0[-1])
    threads = numba.get_num_threads()
    n_chunks = dispatch.n_chunks(threads)  # of every parallel kernel's work, claimed as threads are free
    work = workspace(w, N, threads)
    x, h, qkv, a, f = work.x[:N], work.h[:N], work.qkv[:N], work.a[:N], work.f[:N]
    x[...] = _embed(np.concatenate(seqs), np.repeat(pos0 - row0[:-1], counts) + np.arange(N), w)
    ks, vs, runs, run0 = kvcache.stores(caches)
    half = caches[0].dtype == "float16"  # (for uint16 caches: float16 bits, else bfloat16)
    rounds, pairs = w.activations == "bfloat16", work.attend_pairs(w)  # attention's inputs rounded, and how
    written = np.repeat(pos0[:, None], cfg.n_layer, axis=1)  # (B, n_layer) positions each layer holds
    tiles, bounds = _attention_plan(row0, pos0, cfg.n_head, n_chunks)
    eps = cfg.layer_norm_epsilon
    with threadlayer.turns(_REGIONS_ON_LAYER), pool.pinned(), one_blas_thread():
        for layer in range(cfg.n_layer):
            _layernorm(x, w.ln_1_g[layer], w.ln_1_b[layer], eps, h)
            matmul(h, "c_attn_w", layer, w.c_attn_b[layer], qkv, False, w, work, n_chunks)
            _write_kv(qkv, ks, vs, runs, run0, row0, pos0, layer, written, half, rounds)
            _attend(qkv, ks, vs, runs, run0, layer, row0, pos0, tiles, bounds, a, work.attend, half, rounds, pairs)
            matmul(a, "attn_c_proj_w", layer, w.attn_c_proj_b[layer], x, True, w, work, n_chunks)

            _layernorm(x, w.ln_2_g[layer], w.ln_2_b[layer], eps, h)
            matmul(h, "c_fc_w", layer, w.c_fc_b[layer], f, False, w, work, n_chunks)
            _gelu(f)
            matmul(f, "mlp_c_proj_w", layer, w.mlp_c_proj_b[layer], x, True, w, work, n_chunks)
        wrong = np.flatnonzero((written != (pos0 + counts)[:, None]).any(axis=0))
        if wrong.size:
            raise GPT2NumbaError(f"internal error: layers {wrong.tolist()} did not write their cache rows")
        if isinstance(every_row, list):
            rows = x[_head_rows(row0, every_row)]
        else:
            rows = x if every_row else x[row0[1:] - 1]
        h = np.empty_like(rows)  # (R, C)
        _layernorm(rows, w.ln_f_g, w.ln_f_b, eps, h)
        result = head(h, n_chunks)
    for mc, layers in zip(caches, written):
        mc._commit(layers)
    return result


def _head_rows(row0: np.ndarray, every_row: list[bool]) -> np.ndarray:
    """The rows the head takes: all of sequence b's where every_row[b], else its last."""
    return np.concatenate([np.arange(row0[b] if every else row0[b + 1] - 1, row0[b + 1])
                           for b, every in enumerate(every_row)])


def _embed(ids: np.ndarray, positions: np.ndarray, w: GPT2Weights) -> np.ndarray:
    # (N,) ids at (N,) positions -> (N, C): wte[id] + wpe[position]
    rows = compact.expand("wte", w.wte[ids], w.scales["wte"][ids] if w.scales else None)
    return rows + w.wpe[positions]


def logits_head(w: GPT2Weights, out: np.ndarray | None = None, rows: int | None = None):
    """The head that returns logits: h (R, C) -> float32 (R, V), into ``out`` (rows, V) if given."""
    V = w.config.vocab_size
    if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (rows, V)
                            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ConfigError(f"out must be a writeable, C-contiguous float32 array of shape {(rows, V)}")

    def head(h: np.ndarray, n_chunks: int) -> np.ndarray:
        # the tied head wte; BLAS already pinned by forward_pass
        logits = np.empty((len(h), V), np.float32) if out is None else out
        head_logits(w, h, logits, n_chunks)
        return logits
    return head

"""The reference: GPT-2's forward pass in float64 NumPy, no cache, no Numba.

Written to be read beside the paper, not to be fast; the cached, compiled path in
forward.py must agree with it. Shapes: T = sequence length, C = n_embd.
"""

import numpy as np

from . import checks
from .errors import TokenError
from .weights import GPT2Weights


def layer_norm(x, g, b, eps):
    # [T, C] -> [T, C], biased variance as in GPT-2
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * g + b


def gelu(x):
    # GPT-2's tanh approximation
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention(q, k, v):
    # [T, D] x3 -> [T, D]; position i sees positions <= i
    T, D = q.shape
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    scores = q @ k.T / np.sqrt(D)
    scores[future] = -np.inf
    return softmax(scores) @ v


def block(x, w: GPT2Weights, layer: int):
    # [T, C] -> [T, C]
    f64 = lambda a: a[layer].astype(np.float64)  # noqa: E731
    eps = w.config.layer_norm_epsilon
    n_head = w.config.n_head

    h = layer_norm(x, f64(w.ln_1_g), f64(w.ln_1_b), eps)
    qkv = h @ f64(w.c_attn_w) + f64(w.c_attn_b)  # [T, C] -> [T, 3C]
    q, k, v = np.split(qkv, 3, axis=-1)  # 3 x [T, C]
    heads = [attention(*hv) for hv in zip(*(np.split(a, n_head, axis=-1) for a in (q, k, v)))]
    x = x + np.hstack(heads) @ f64(w.attn_c_proj_w) + f64(w.attn_c_proj_b)

    h = layer_norm(x, f64(w.ln_2_g), f64(w.ln_2_b), eps)
    a = gelu(h @ f64(w.c_fc_w) + f64(w.c_fc_b))  # [T, C] -> [T, 4C]
    return x + a @ f64(w.mlp_c_proj_w) + f64(w.mlp_c_proj_b)


def recompute_logits(ids, w: GPT2Weights) -> np.ndarray:
    """Next-token logits after the whole sequence ``ids``, from scratch, in float64.

    ids: 1-D sequence of token ids, 1 <= len(ids) <= n_positions. Compact
    weights are run on the float32 values they stand for.
    Returns a float64 array of shape (vocab_size,).
    """
    h, w = final_states(ids, w)
    return head(h[-1:], w)[0]


def recompute_all_logits(ids, w: GPT2Weights) -> np.ndarray:
    """The logits after every position of ``ids``, float64 (len(ids), vocab_size); as recompute_logits."""
    h, w = final_states(ids, w)
    return head(h, w)


def final_states(ids, w: GPT2Weights):
    """(ln_f(x) of every position [T, C] float64, the float32-valued weights), checked as the engine checks."""
    checks.weights(w)  # the same checks as the engine's, none of its arithmetic
    ids = checks.token_ids(ids, w.config.vocab_size)
    if len(ids) > w.config.n_positions:
        raise TokenError(f"{len(ids)} tokens is more than n_positions={w.config.n_positions}")
    w = w.dequantized()
    T = len(ids)
    x = w.wte[ids].astype(np.float64) + w.wpe[:T].astype(np.float64)  # [T, C]
    for layer in range(w.config.n_layer):
        x = block(x, w, layer)
    return layer_norm(x, w.ln_f_g.astype(np.float64), w.ln_f_b.astype(np.float64), w.config.layer_norm_epsilon), w


def head(h, w: GPT2Weights):
    # [T, C] -> [T, V], the tied head, one vocabulary block at a time to bound the float64 copy
    return np.concatenate([h @ blk.astype(np.float64).T for blk in np.array_split(w.wte, 8)], axis=1)

"""The reference: GPT-2's forward pass in float64 NumPy, no cache, no Numba.

Written to be read beside the paper, not to be fast; the cached, compiled path in
forward.py must agree with it. Shapes: T = sequence length, C = n_embd.
"""

import numpy as np

from ..errors import TokenError
from . import checks
from .compact import INTEGER
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


def exact(x):
    return x


def attention(q, k, v, inputs=exact):
    # [T, D] x3 -> [T, D]; position i sees positions <= i; its two products multiply inputs(their inputs)
    T, D = q.shape
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    scores = inputs(q) @ inputs(k).T / np.sqrt(D)
    scores[future] = -np.inf
    return inputs(softmax(scores)) @ inputs(v)


def int8_inputs(x):
    # [..., K] -> [..., K]: what the integer formats multiply instead of x (Q8_0's rounding):
    # each group of 32 along the last axis to the nearest multiple of its max|x| / 127
    groups = x.reshape(*x.shape[:-1], -1, 32)
    step = np.abs(groups).max(axis=-1, keepdims=True) / 127
    steps = np.divide(groups, step, out=np.zeros_like(groups), where=step > 0)
    return (np.rint(steps) * step).reshape(x.shape)


def bfloat16_inputs(x):
    # [..., K] -> [..., K]: what bfloat16 activations multiply instead of x: x as the engine holds it
    # (float32), to 8 significant bits, to nearest, ties to even (np.round), as bfloat16 keeps it
    mantissa, exponent = np.frexp(x.astype(np.float32).astype(np.float64))
    return np.ldexp(np.round(mantissa * 256) / 256, exponent)


def block(x, w: GPT2Weights, layer: int, inputs=exact, attend=exact):
    # [T, C] -> [T, C]; every matrix product multiplies inputs(its input), attention's attend(its inputs)
    f64 = lambda a: a[layer].astype(np.float64)  # noqa: E731
    eps = w.config.layer_norm_epsilon
    n_head = w.config.n_head

    h = layer_norm(x, f64(w.ln_1_g), f64(w.ln_1_b), eps)
    qkv = inputs(h) @ f64(w.c_attn_w) + f64(w.c_attn_b)  # [T, C] -> [T, 3C]
    q, k, v = np.split(qkv, 3, axis=-1)  # 3 x [T, C]
    heads = [attention(*hv, attend) for hv in zip(*(np.split(a, n_head, axis=-1) for a in (q, k, v)))]
    x = x + inputs(np.hstack(heads)) @ f64(w.attn_c_proj_w) + f64(w.attn_c_proj_b)

    h = layer_norm(x, f64(w.ln_2_g), f64(w.ln_2_b), eps)
    a = gelu(inputs(h) @ f64(w.c_fc_w) + f64(w.c_fc_b))  # [T, C] -> [T, 4C]
    return x + inputs(a) @ f64(w.mlp_c_proj_w) + f64(w.mlp_c_proj_b)


# How closely the engine's logits match these (np.allclose). The integer formats round every
# product's input to int8 per group, and a value on a rounding tie may go either way in float32
# (the engine) and float64 (here): one input then moves by a whole step. On random weights,
# whose residual stream is tiny beside layernorm's gain, that moves logits by up to 6e-3 on a
# 2-layer model (most prompts agree to 1e-7) and by 0.017-0.042 on GPT-2 small (12 prompts,
# logits up to 2.5). A wrong scale, nibble order or group moves them by order 1.
# bfloat16 activations round every product's input to 8 significant bits, and an input near the middle of
# two bfloat16 values may round either way in float32 and float64 just the same: on GPT-2 small's random
# weights 6 such inputs of 345,600 moved the oracle's own logits by 6.9e-3 (2 layers), and the engine's
# logits were up to 9.7e-3 from the oracle's (12 prompts; 2.9e-4 on the tests' tiny model); with attention's
# inputs rounded too, up to 1.13e-2 (12 prompts, a prefill and a decode step each; 7e-4 on the tiny model).
ATOL, RTOL = 1e-3, 1e-2
ATOL_INTEGER = 0.1
ATOL_BFLOAT16_INPUTS = 0.03


def rounds_inputs(w: GPT2Weights) -> bool:
    """Whether weights ``w`` round their products' inputs (the integer formats, bfloat16 activations)."""
    return w.dtype in INTEGER or w.activations == "bfloat16"


def tolerance(w: GPT2Weights) -> float:
    """The absolute tolerance of the logits of weights ``w`` against these."""
    if not rounds_inputs(w):
        return ATOL
    return ATOL_INTEGER if w.dtype in INTEGER else ATOL_BFLOAT16_INPUTS


def agreement(logits, ref, w: GPT2Weights) -> tuple[bool, str]:
    """Whether engine logits (V,) agree with these, ``ref``: allclose within the tolerance for
    the weights ``w``, and the same argmax unless the oracle's top two are within it."""
    atol = tolerance(w)
    diff = float(np.abs(logits - ref).max())
    if not np.allclose(logits, ref, atol=atol, rtol=RTOL):
        return False, f"max |diff| {diff:.3g} (atol={atol}, rtol={RTOL})"
    runner_up, top = np.sort(ref)[-2:]
    if top - runner_up > 2 * atol and logits.argmax() != ref.argmax():
        return False, f"argmax {logits.argmax()} != oracle's {ref.argmax()}"
    return True, f"max |diff| {diff:.3g}"


def recompute_logits(ids, w: GPT2Weights) -> np.ndarray:
    """Next-token logits after the whole sequence ``ids``, from scratch, in float64.

    ids: 1-D sequence of token ids, 1 <= len(ids) <= n_positions. Compact
    weights are run on the float32 values they stand for; with the integer formats
    every matrix product's input is rounded as theirs is (int8_inputs), and with
    bfloat16 activations to bfloat16 (bfloat16_inputs).
    Returns a float64 array of shape (vocab_size,).
    """
    h, w = final_states(ids, w)
    return head(h[-1:], w)[0]


def recompute_all_logits(ids, w: GPT2Weights) -> np.ndarray:
    """The logits after every position of ``ids``, float64 (len(ids), vocab_size); as recompute_logits."""
    h, w = final_states(ids, w)
    return head(h, w)


def final_states(ids, w: GPT2Weights):
    """(the head's input, inputs(ln_f(x)) at every position [T, C] float64, the float32-valued weights),
    checked as the engine checks."""
    checks.weights(w)  # the same checks as the engine's, none of its arithmetic
    ids = checks.token_ids(ids, w.config.vocab_size)
    if len(ids) > w.config.n_positions:
        raise TokenError(f"{len(ids)} tokens is more than n_positions={w.config.n_positions}")
    inputs = int8_inputs if w.dtype in INTEGER else bfloat16_inputs if w.activations == "bfloat16" else exact
    attend = bfloat16_inputs if w.activations == "bfloat16" else exact  # (int8's groups are the products' only)
    w = w.dequantized()
    T = len(ids)
    x = w.wte[ids].astype(np.float64) + w.wpe[:T].astype(np.float64)  # [T, C]
    for layer in range(w.config.n_layer):
        x = block(x, w, layer, inputs, attend)
    h = layer_norm(x, w.ln_f_g.astype(np.float64), w.ln_f_b.astype(np.float64), w.config.layer_norm_epsilon)
    return inputs(h), w


def head(h, w: GPT2Weights):
    # [T, C] -> [T, V], the tied head, one vocabulary block at a time to bound the float64 copy
    return np.concatenate([h @ blk.astype(np.float64).T for blk in np.array_split(w.wte, 8)], axis=1)

"""The oracle's pieces against values worked out by hand."""

import math

import numpy as np

from gpt2numba.model import oracle


def test_layer_norm_by_hand():
    # x = [1, 2, 3, 6]: mean 3, biased variance (4 + 1 + 0 + 9) / 4 = 3.5
    x = np.array([[1.0, 2.0, 3.0, 6.0]])
    y = oracle.layer_norm(x, g=np.array([1.0, 2.0, 1.0, 1.0]), b=np.array([0.0, 0.0, 0.5, 0.0]), eps=0.0)
    s = math.sqrt(3.5)
    np.testing.assert_allclose(y, [[-2 / s, 2 * -1 / s, 0.5, 3 / s]], rtol=1e-12)


def test_gelu_by_hand():
    # gelu(0) = 0; gelu(1) = 0.5 (1 + tanh(sqrt(2/pi) 1.044715)) = 0.841191990...
    # gelu(-1) = -1 + gelu(1) by the symmetry gelu(x) - gelu(-x) = x.
    np.testing.assert_allclose(oracle.gelu(np.array([0.0, 1.0, -1.0])),
                               [0.0, 0.8411919906082768, -0.1588080093917232], rtol=1e-12)


def test_softmax_by_hand():
    # softmax([0, ln 3]) = [1/4, 3/4], unchanged by a shift
    np.testing.assert_allclose(oracle.softmax(np.array([0.0, math.log(3)]) + 1000), [0.25, 0.75])


def test_attention_is_causal_by_hand():
    # Two positions, head_dim 1: the first sees only itself; the second weighs
    # both by softmax([q1 k0, q1 k1] / 1) = softmax([0, ln 3]).
    q = np.array([[5.0], [1.0]])
    k = np.array([[0.0], [math.log(3)]])
    v = np.array([[10.0], [20.0]])
    np.testing.assert_allclose(oracle.attention(q, k, v), [[10.0], [0.25 * 10 + 0.75 * 20]])

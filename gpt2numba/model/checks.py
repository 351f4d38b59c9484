"""Validation of what users pass in: token ids, positions, weights."""

from __future__ import annotations

import numpy as np

from ..errors import (BatchError, CacheFullError, CheckpointError, ConfigError, GPT2NumbaError, SamplingError,
                      TokenError, TokenTypeError)
from .config import GPT2Config


def check_finite(name: str, a: np.ndarray) -> None:
    """CheckpointError unless a checkpoint's tensor ``name`` holds finite values only."""
    if not np.isfinite(a).all():
        raise CheckpointError(f"tensor {name!r} holds non-finite values (nan or inf)")


def is_integer(value) -> bool:
    """A Python or NumPy integer, and not a bool (which Python counts as an int)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """A Python or NumPy integer or float, and not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def token_id(value, vocab_size: int, what: str = "token id") -> int:
    """``value`` as an int in [0, vocab_size), or TokenTypeError / TokenError."""
    if not is_integer(value):
        raise TokenTypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    if not 0 <= value < vocab_size:
        raise TokenError(f"{what} {value} is outside [0, {vocab_size})")
    return int(value)


def token_ids(values, vocab_size: int) -> np.ndarray:
    """A non-empty 1-D sequence of token ids as an int64 array, checked."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise TokenTypeError(f"token ids must have an integer dtype, got an array of {values.dtype}")
        if values.ndim != 1:
            raise TokenError(f"token ids must be a 1-D array, got shape {values.shape}")
        bad = np.flatnonzero((values < 0) | (values >= vocab_size))
        if bad.size:
            i = bad[0]
            raise TokenError(f"token id {values[i]} at index {i} is outside [0, {vocab_size})")
        ids = values.astype(np.int64)
    elif isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TokenTypeError(
            f"token ids must be a sequence of integers, got {type(values).__name__}"
            + ("; encode text with a tokenizer first" if isinstance(values, str) else "")
        )
    else:
        ids = np.array(
            [token_id(v, vocab_size, f"token id at index {i}:") for i, v in enumerate(values)],
            dtype=np.int64,
        )
    if ids.size == 0:
        raise TokenError("the prompt is empty; give at least one token id")
    return ids


def position(value, n_positions: int) -> int:
    """``value`` as an int in [0, n_positions), or TokenTypeError / TokenError."""
    if not is_integer(value):
        raise TokenTypeError(f"position must be an integer, got {value!r} ({type(value).__name__})")
    if not 0 <= value < n_positions:
        raise TokenError(f"position {value} is outside [0, {n_positions}) (n_positions)")
    return int(value)


# what the engine reads of a GPT2Weights: checked by duck type, so this module (which weights.py uses)
# does not import weights.py; a GPT2Weights validated its arrays when it was built
_WEIGHTS_ATTRIBUTES = ("wte", "wpe", "ln_f_g", "ln_f_b", "dtype", "scales", "matrix")


def weights(w) -> None:
    """ConfigError unless ``w`` is a GPT2Weights (anything with a GPT2Config and its arrays)."""
    if not isinstance(getattr(w, "config", None), GPT2Config) or not all(
            hasattr(w, name) for name in _WEIGHTS_ATTRIBUTES):
        raise ConfigError(f"expected GPT2Weights, got {type(w).__name__}")


def labelled(label: str, check, *args):
    """check(*args), with ``label`` (which sequence of a batch) put before any error's message."""
    try:
        return check(*args)
    except GPT2NumbaError as e:
        raise type(e)(f"{label}{e}") from None


def sequence(value, name: str) -> list:
    """``value`` as a list, or BatchError unless it is a sequence: any iterable but a str or bytes."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise BatchError(f"{name} must be a sequence, got {type(value).__name__}")
    return list(value)


def prompts(values, cfg: GPT2Config, max_new_tokens: int) -> list[list[int]]:
    """A non-empty sequence of prompts, each checked and with room for max_new_tokens in n_positions, as lists
    of ints; BatchError for none, TokenError / TokenTypeError / CacheFullError naming the prompt."""
    values = sequence(values, "prompts")
    if not values:
        raise BatchError("no prompts: give at least one")
    checked = []
    for i, prompt in enumerate(values):
        ids = [int(t) for t in labelled(f"prompt {i}: ", token_ids, prompt, cfg.vocab_size)]
        if len(ids) + max_new_tokens > cfg.n_positions:
            raise CacheFullError(f"prompt {i}: {len(ids)} tokens + max_new_tokens ({max_new_tokens}) = "
                                 f"{len(ids) + max_new_tokens} passes the model's context of {cfg.n_positions} "
                                 "positions")
        checked.append(ids)
    return checked


def known_settings(given, names) -> None:
    """SamplingError naming the first of ``given``'s keys that is not one of ``names``."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise SamplingError(f"unknown generation setting {unknown[0]!r}; this takes " + ", ".join(names))

"""Where a pass's time goes, kernel by kernel: timers around the kernels forward.py calls, and the bytes each
kind of kernel reads in a decode step (what its floor is made of). bench --floor and profiling/profile_step.py
use them."""

from __future__ import annotations

import time

from ..model import forward

MATRIX_KINDS = {"c_attn_w": "qkv (c_attn)", "attn_c_proj_w": "attn c_proj",
                "c_fc_w": "mlp c_fc", "mlp_c_proj_w": "mlp c_proj"}
_KINDS = {"_layernorm": lambda *a, **k: "layernorm", "_write_kv": lambda *a, **k: "cache write",
          "_attend": lambda *a, **k: "attention", "_gelu": lambda *a, **k: "gelu",
          "head_logits": lambda *a, **k: "head (wte)",
          "matmul": lambda x, field, *a, **k: MATRIX_KINDS[field]}


def instrument(totals):
    """Replace forward's kernels with wrappers that add each call's seconds to totals[kind] (the calls
    are synchronous: a call's wall time is its kernel's); return a function that puts the kernels back."""
    saved = {name: getattr(forward, name) for name in _KINDS}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            totals[_KINDS[name](*args, **kwargs)] += time.perf_counter() - t
            return out
        return wrapper

    for name, fn in saved.items():
        setattr(forward, name, timed(name, fn))
    return lambda: [setattr(forward, name, fn) for name, fn in saved.items()]


def decode_bytes(w, kv_bytes: float) -> dict:
    """{kind: bytes one decode step's kernels of that kind read} for weights w: each block matrix's (with its
    scales and bias) over the layers, the head's wte, and attention's ``kv_bytes`` of K and V rows."""
    out = {}
    for field, kind in MATRIX_KINDS.items():
        arrays = [getattr(w, field), getattr(w, field.replace("_w", "_b"))]
        out[kind] = sum(a.nbytes for a in arrays) + (w.scales[field].nbytes if w.scales else 0)
    out["head (wte)"] = w.wte.nbytes + (w.scales["wte"].nbytes if w.scales else 0)
    out["attention"] = kv_bytes
    return out

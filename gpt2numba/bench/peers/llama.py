"""llama.cpp behind the benchmark's calls (gpt2numba bench --llama and --neighbour), through llama-cpp-python
on a GGUF file of the same weights. Runs in a peer's worker, which never imports gpt2numba (peers/__init__.py);
llama-cpp-python is in the [peers] extra."""

from __future__ import annotations

import numpy as np


class _Llama:
    """llama.cpp behind the benchmark's calls: prefill(ids) and decode(token) return (vocab,) logits."""

    def __init__(self, llama_cpp, model, version):
        self.llama_cpp, self.model, self.version = llama_cpp, model, version

    def _logits(self):
        n_vocab = self.model.n_vocab()
        return np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(self.model.ctx, -1), shape=(n_vocab,)).copy()

    def prefill(self, ids):
        self.model.reset()
        self.model.eval([int(t) for t in ids])
        return self._logits()

    def decode(self, token):
        self.model.eval([int(token)])
        return self._logits()

    def threads(self):
        return self.model.n_threads


def system(kind, gguf_path, threads):
    """(system, kind, version) for Remote: kind "llama.cpp FMT" on a GGUF file; system and version are None
    when llama-cpp-python is not installed."""
    system = _load(gguf_path, threads)
    return system, kind, system.version if system else None


def _load(gguf_path, threads):
    try:
        import llama_cpp
    except ImportError:
        return None
    model = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                            n_threads_batch=threads, verbose=False)
    return _Llama(llama_cpp, model, f"llama-cpp-python {llama_cpp.__version__}")

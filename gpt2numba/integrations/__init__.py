"""Other people's engines, each an optional extra imported lazily: lm-evaluation-harness, Ray Data, GGUF.

harness.py (lm-eval's model "gpt2numba"), distributed.py (scoring and generation with Ray Data),
gguf_export.py (weights as GGUF for llama.cpp, the benchmark's peer). Ray Serve is in serve/ray.py.
"""

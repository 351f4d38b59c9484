"""GPT-2 itself: its sizes, its weights, its cache, the forward pass and the float64 reference.

Start at forward.py (the one layer loop; prefill, decode_step and their batch forms validate and call it).
config.py (the sizes), weights.py (GPT2Weights, seeded ones), checkpoints.py (safetensors files), compact.py
(bfloat16, int8, int4), models.py (where weights come from), kvcache.py (ModelCache), products.py (which
kernel multiplies), checks.py (what users pass in), oracle.py (no cache, no Numba: what the kernels are
checked against). Uses cpu/ only.
"""

"""bfloat16 activations beside transformers in bfloat16: prefill 128 and 512, and scoring 8 documents x 256.

    python profiling/bf16_activations.py [--rounds 3] [--repeat 5] [--transformers-python PATH]

Writes seeded random GPT-2 small to a temporary checkpoint, then alternates, round after round, a process of
transformers (bfloat16 and float32, run by --transformers-python: a Python with torch and transformers that
never imports gpt2numba; skipped when none is given or it lacks them) and a process of gpt2numba (bfloat16
activations, bfloat16, float32, int8), each timing medians of --repeat on 2 threads. Prints each figure's
median over the rounds with every round's, others' CPU share during each process, and the largest |logit -
the same system's float32| (4 prompts of 64 tokens) and |log-probability - float32| (the scored documents).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORK = ("prefill 128", "prefill 512", "score 8x256")

# One system's figures: argv = checkpoint, repeats, npz path for the accuracy arrays, formats.
_COMMON = """
import sys, time, json
import numpy as np
ckpt, reps, out, formats = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
rng = np.random.default_rng(0)
p128, p512, docs = rng.integers(0, 50257, 128), rng.integers(0, 50257, 512), rng.integers(0, 50257, (8, 256))
prompts = [np.random.default_rng(10 + i).integers(0, 50257, 64) for i in range(4)]
def timed(f):
    f(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1e3)
"""
_THEIRS = _COMMON + """
import torch
from transformers import GPT2LMHeadModel
torch.set_num_threads(2)
res, saved = {}, {}
with torch.inference_mode():
    for f in formats:
        m = GPT2LMHeadModel.from_pretrained(ckpt, torch_dtype=getattr(torch, f)).eval()
        last = lambda ids: m(torch.tensor(ids)[None]).logits[0, -1].float().numpy()
        def score():
            lp = torch.log_softmax(m(torch.tensor(docs)).logits.float(), -1)
            return lp[:, :-1].gather(-1, torch.tensor(docs)[:, 1:, None])[..., 0].numpy()
        res[f"prefill 128 {f}"], res[f"prefill 512 {f}"] = timed(lambda: last(p128)), timed(lambda: last(p512))
        res[f"score 8x256 {f}"] = timed(score)
        saved[f"logits {f}"], saved[f"logprobs {f}"] = np.stack([last(p) for p in prompts]), score()
np.savez(out, **saved)
print(json.dumps(res))
"""
_OURS = _COMMON + """
import gpt2numba as g
g.set_threads(2)
res, saved = {}, {}
for f in formats:
    dtype, act = ("bfloat16", "bfloat16") if f == "bfloat16-act" else (f, "float32")
    w = g.load_weights(ckpt, dtype=dtype, activations=act)
    last = lambda ids: g.prefill(ids, w, g.ModelCache(w.config, len(ids)))
    score = lambda: np.stack([s.logprobs for s in g.score_batch(list(docs), w)])
    res[f"prefill 128 {f}"], res[f"prefill 512 {f}"] = timed(lambda: last(p128)), timed(lambda: last(p512))
    res[f"score 8x256 {f}"] = timed(score)
    saved[f"logits {f}"], saved[f"logprobs {f}"] = np.stack([last(p) for p in prompts]), score()
np.savez(out, **saved)
print(json.dumps(res))
"""
THEIRS, OURS = ("bfloat16", "float32"), ("bfloat16-act", "bfloat16", "float32", "int8")


def _busy() -> float:
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _run(python, script, ckpt, repeat, out, formats):
    """(figures, others' CPU share) of one system's process."""
    b0, t0, r0 = _busy(), time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    env = None if python == sys.executable else {**os.environ, "PYTHONPATH": ""}  # (a peer: none of ours)
    done = subprocess.run([python, "-c", script, str(ckpt), str(repeat), str(out), ",".join(formats)],
                          capture_output=True, text=True, env=env)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{python} failed: {done.stderr.strip()[-2000:]}")
    own = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    share = max(0.0, _busy() - b0 - own) / ((time.time() - t0) * os.cpu_count())
    return json.loads(done.stdout.strip().splitlines()[-1]), share


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--transformers-python", help="a Python with torch and transformers (a venv's bin/python)")
    args = p.parse_args()
    import gpt2numba as g
    from gpt2numba.cpu.dispatch import cpu_name, describe_bf16

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp, "gpt2-small")
        g.save_weights(g.random_weights(g.GPT2Config.small(), seed=3), ckpt)
        systems = [("ours", sys.executable, _OURS, OURS)]
        if args.transformers_python:
            systems.insert(0, ("transformers", args.transformers_python, _THEIRS, THEIRS))
        rounds, shares = [], []
        for r in range(args.rounds):
            figures = {}
            for name, python, script, formats in systems:
                got, share = _run(python, script, ckpt, args.repeat, Path(tmp, f"{name}{r}.npz"), formats)
                figures.update({f"{k} {name}": v for k, v in got.items()})
                shares.append(share)
            rounds.append(figures)
        acc = {name: np.load(Path(tmp, f"{name}0.npz")) for name, *_ in systems}
    print(f"{cpu_name()}; bfloat16 products: {describe_bf16()}; 2 threads, {args.rounds} rounds alternating, "
          f"medians of {args.repeat}; others {100 * min(shares):.0f}-{100 * max(shares):.0f}% of the CPU")
    columns = [f"{f} {name}" for name, _, _, formats in systems for f in formats]
    print(f"{'ms':<12}" + "".join(f"{c:>22}" for c in columns))
    for work in WORK:
        cells = [[rnd[f"{work} {c.split()[0]} {c.split()[1]}"] for rnd in rounds] for c in columns]
        print(f"{work:<12}" + "".join(f"{np.median(v):>22.1f}" for v in cells))
        print(f"{'  rounds':<12}" + "".join(f"{'/'.join(f'{x:.0f}' for x in v):>22}" for v in cells))
    formats_of = {name: formats for name, _, _, formats in systems}
    for name, arrays in acc.items():
        for f in (f for f in formats_of[name] if f != "float32"):
            logit, logprob = (float(np.abs(arrays[f"{kind} {f}"] - arrays[f"{kind} float32"]).max())
                              for kind in ("logits", "logprobs"))
            print(f"{name} {f}: max |logit - float32| {logit:.4f}, |log-probability - float32| {logprob:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""gpt2numba bench --neighbour: each workload alone and beside a busy process, alternating, per system.

The neighbour is a plain Python busy loop (one core's worth of work) in its own process,
at nice 0 and at nice 10. Each system runs in its own worker process, as in the rest of
the benchmark: gpt2numba in each of --dtypes, CTranslate2 (float32, int8_float32) when
ctranslate2, torch and transformers are installed, llama.cpp (F32, Q8_0) when
llama-cpp-python is (the [peers] extra); --neighbour-systems chooses. For every
workload and format the runs alternate (alone, then beside each neighbour,
--neighbour-repeat times, in a rotating order), each after waiting for the machine to
be idle. The table gives, per system, the median alone, the median beside each
neighbour and the slowdown (neighbour / alone), and the largest CPU share that processes
other than the system's and the neighbour's took during a run (above a few %, the
figures are noisy).

Workloads (128-token prompts where there are prompts):
  decode   one sequence at context 128: seconds per decode step
  gen8     generate_batch of 8 prompts, --neighbour-tokens greedy tokens, no end-of-text stop
  gen32    the same with 32 prompts
  prefill  prefill of 512 tokens
  score    score_batch of --neighbour-docs documents of 100-300 tokens
CTranslate2 has no prefill alone: its prefill is a generate of one token (the prompt but
its last id forwarded at once, the last id as the decoding loop's step). llama-cpp-python's
Llama holds one sequence, so llama.cpp runs decode and prefill only.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..argtypes import COUNT
from ..cpu import pool
from ..model.config import GPT2Config
from . import ct2, llama
from .core import Load, Remote, gpt2numba_system, start_peer, wait_for_idle

NEIGHBOURS = {"nice 0": 0, "nice 10": 10}
BUSY_LOOP = "while True: pass"
WORKLOADS = ("decode", "gen8", "gen32", "prefill", "score")
SYSTEMS = ("gpt2numba", "ct2", "llama")
CT2_TYPES, LLAMA_FORMATS = ("float32", "int8_float32"), ("F32", "Q8_0")
LLAMA_WORKLOADS = ("decode", "prefill")


def add_arguments(p) -> None:
    group = p.add_argument_group("neighbour", "gpt2numba bench --neighbour runs this section alone")
    group.add_argument("--neighbour", action="store_true", help="each workload alone and beside a busy loop")
    group.add_argument("--neighbour-workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    group.add_argument("--neighbour-systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS,
                       help="gpt2numba in --dtypes, CTranslate2 and llama.cpp (each where installed)")
    group.add_argument("--neighbour-tokens", type=COUNT, default=64, help="new tokens per prompt in gen8 and gen32")
    group.add_argument("--neighbour-docs", type=COUNT, default=200, help="documents in score")
    group.add_argument("--neighbour-steps", type=COUNT, default=32, help="decode steps per run in decode")
    group.add_argument("--neighbour-repeat", type=COUNT, default=3, help="runs per condition (median)")


def run(args, model_dir, w) -> dict:
    jobs, rows, notes = _jobs(w.config, args), [], []
    where = pool.describe()  # this process's, until a gpt2numba worker tells its own
    with tempfile.TemporaryDirectory() as tmp:
        for system, fmt, start, workloads in _systems(args, model_dir, w, Path(tmp), notes):
            remote = start()
            if remote is None:
                notes.append(f"{system} {fmt}: its library did not load; skipped")
                continue
            try:
                for name in (n for n in args.neighbour_workloads if n in workloads):
                    medians, others = _measure(_timer(remote, name, jobs[name]), args.neighbour_repeat,
                                               remote.process.pid)
                    rows.append({"system": system, "workload": name, "dtype": fmt, "seconds": medians,
                                 "others": others})
                    print(f"  {system} {name} {fmt}: " + ", ".join(f"{k} {v:.4g} s" for k, v in medians.items()),
                          file=sys.stderr, flush=True)
                if system == "gpt2numba":
                    where = remote.call("threads_run_on", None)[1]
            finally:
                remote.close()
    return {"neighbour": rows, "threads_run_on": where, "busy_loop": BUSY_LOOP,
            "notes": notes}


def _systems(args, model_dir, w, tmp, notes):
    """(system, format, a function that starts its worker (a Remote, or None), its workloads) for each system
    and format that --neighbour-systems asks for and this machine has; what is skipped goes to ``notes``."""
    threads = args.threads
    if "gpt2numba" in args.neighbour_systems:
        for dtype in args.dtypes:
            yield "gpt2numba", dtype, lambda d=dtype: Remote(gpt2numba_system, d, model_dir, threads), WORKLOADS
    if "ct2" in args.neighbour_systems:
        if ct2.missing():
            notes.append(f"CTranslate2 skipped: {', '.join(ct2.missing())} not installed "
                         "(pip install -e \".[peers,bench]\")")
        else:
            models = ct2.convert(w, tmp, CT2_TYPES)
            for ct in CT2_TYPES:
                yield "CTranslate2", ct, lambda c=ct: start_peer(ct2.system, c, models[c], threads), WORKLOADS
    if "llama" in args.neighbour_systems:
        if importlib.util.find_spec("llama_cpp") is None:
            notes.append("llama.cpp skipped: llama-cpp-python is not installed (pip install -e \".[peers]\"; "
                         "it compiles llama.cpp at install, many minutes)")
        else:
            from ..integrations.gguf_export import write_gguf

            vocab = GPT2Config.small().vocab_size
            if w.config.vocab_size != vocab:  # a GGUF carries GPT-2's own vocabulary, which a test model may not have
                notes.append(f"llama.cpp skipped: a GGUF carries GPT-2's vocabulary of {vocab} tokens; "
                             f"this model has {w.config.vocab_size}")
                return
            paths = {fmt: write_gguf(w, tmp / f"gpt2-{fmt}.gguf", fmt) for fmt in LLAMA_FORMATS}
            notes.append(f"llama.cpp runs {' and '.join(LLAMA_WORKLOADS)} only: llama-cpp-python's Llama holds "
                         "one sequence, so it has no generate_batch or score_batch to set beside ours")
            for fmt, path in paths.items():
                yield ("llama.cpp", fmt, lambda f=fmt, p=path: start_peer(llama.system, f"llama.cpp {f}", p, threads),
                       LLAMA_WORKLOADS)


def _jobs(cfg, args) -> dict:
    """workload -> (the worker's method, its argument, whether the method returns its own seconds)."""
    rng = np.random.default_rng(0)
    V, P = cfg.vocab_size, cfg.n_positions  # the lengths shrink to fit a small test model
    context, steps = min(128, P // 2), min(args.neighbour_steps, P // 2)
    tokens = min(args.neighbour_tokens, P - context)
    prompts = [rng.integers(0, V, context) for _ in range(32)]
    long_prompt = rng.integers(0, V, min(512, P))
    docs = [rng.integers(0, V, n) for n in rng.integers(min(100, P), min(300, P) + 1, args.neighbour_docs)]
    return {"decode": ("decode_steps", (prompts[0], steps), True),  # timed inside: the prefill apart
            "gen8": ("generate", (prompts[:8], tokens), False), "gen32": ("generate", (prompts, tokens), False),
            "prefill": ("prefill", long_prompt, False), "score": ("score_docs", docs, False)}


def _timer(remote, name, job):
    """A function that runs the workload once in the worker and returns its seconds."""
    method, arg, timed_inside = job
    if timed_inside:
        return lambda: remote.call(method, arg)[1]
    return lambda: remote.call(method, arg)[0]


def print_report(r) -> None:
    print(f"\n{r['model']}, {r['threads']} threads on {r['threads_run_on']}; "
          f"the neighbour: `python -c '{r['busy_loop']}'`")
    print(f"{'system':<12} {'workload':<9} {'format':<13} {'alone':>10}"
          + "".join(f" {n:>10} {'slowdown':>8}" for n in NEIGHBOURS) + f" {'others':>7}")
    previous = None
    for row in r["neighbour"]:
        s = row["seconds"]
        unit, scale = ("ms", 1e3) if s["alone"] < 1 else ("s", 1.0)
        cells = "".join(f" {scale * s[n]:>8.2f}{unit:<2} {s[n] / s['alone']:>7.2f}x" for n in NEIGHBOURS)
        system = row.get("system", "gpt2numba")
        print(f"{system if system != previous else '':<12} {row['workload']:<9} {row['dtype']:<13} "
              f"{scale * s['alone']:>8.2f}{unit:<2}{cells} {100 * row['others']:>6.1f}%")
        previous = system
    for note in r.get("notes", []):
        print(f"({note})")


class _Neighbour:
    """A busy loop in its own process at nice ``nice`` (None: no neighbour) for a block."""

    def __init__(self, nice):
        self.nice, self.proc = nice, None

    def __enter__(self):
        if self.nice is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=lambda: os.nice(self.nice))
            time.sleep(0.2)  # let it reach its loop
        return self

    def __exit__(self, *exc):
        if self.proc:
            self.proc.kill()
            self.proc.wait()


def _measure(run, repeat: int, worker: int) -> tuple[dict, float]:
    """Median seconds alone and beside each neighbour, alternating in a rotating order; and the
    largest CPU share that others (not the worker ``worker``, a pid, nor the neighbour) took during a run."""
    conditions = [("alone", None), *NEIGHBOURS.items()]
    times = {name: [] for name, _ in conditions}
    others = 0.0
    run()  # warm up: load the kernels, touch the buffers
    for r in range(repeat):
        for name, nice in conditions[r % 3:] + conditions[:r % 3]:
            wait_for_idle()
            with _Neighbour(nice) as n, Load(worker, *([n.proc.pid] if n.proc else [])) as load:
                times[name].append(run())
            others = max(others, load.share or 0.0)
    return {name: statistics.median(s) for name, s in times.items()}, others

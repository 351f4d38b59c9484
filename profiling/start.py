"""A cold process's start: the import, a one-token generate, the weights' load, and the memory two processes hold.

    python profiling/start.py [--model DIR] [--config small|xl] [--gguf TYPE] [--dtype FORMAT] [--rounds 5]
                              [--before CHECKOUT] [--idle-patience S]

Every figure is one process of its own, started fresh; medians of --rounds, each run after waiting for an idle
machine (the others' CPU share over the runs is printed). The checkpoint is a save_pretrained directory of
seeded random weights written once under /tmp (or --model); Numba's cache and the weights' mapped copy are
made by a first, untimed run. --gguf F32|F16|Q8_0|Q4_0 times a GGUF file of those weights instead (our
export; Q4_0 by the gguf package), converted to its mapped copy by that first run; --dtype is the format
the weights are loaded in (load_weights' dtype, generate's --dtype). Printed:

- `python -c "import gpt2numba"`: wall time;
- `gpt2numba generate Hello --max-new-tokens 1 --model DIR` (python -m gpt2numba): wall time, process start to
  exit, and its summary line (where the start went);
- `load_weights(DIR)` inside a fresh process, its modules imported first: mapped (the copy made), and read into
  memory (mapped=False);
- the proportional set size (PSS) of one process that loaded the weights and ran a prefill, and of two such
  processes at once, summed: what a second process on the machine costs.

--before CHECKOUT runs the same in turns with the gpt2numba of another checkout (an earlier commit, its own
Numba cache), through PYTHONPATH; a checkout without `mapped=` loads as it did.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gpt2numba.bench.core import Load, in_turns, machine, set_idle_patience

LOAD = """
import sys, time, inspect
import gpt2numba as g
import gpt2numba.model.checkpoints  # (the loader's modules, Numba and NumPy among them, are not timed)
t_import = time.perf_counter()
kw = {{"mapped": {mapped}}} if "mapped" in inspect.signature(g.load_weights).parameters else {{}}
w = g.load_weights(sys.argv[1], dtype={dtype!r}, **kw)
print(time.perf_counter() - t_import)
"""

HOLD = """
import sys, time
import gpt2numba as g
w = g.load_weights(sys.argv[1], dtype=sys.argv[2])
g.prefill([464, 2068], w, g.ModelCache(w.config, 8))
print("ready", flush=True)
sys.stdin.readline()
"""


def checkpoint(config: str, model: Path | None, gguf: str | None) -> Path:
    """``model``, or a save_pretrained directory of seeded random weights of ``config`` written once; with
    ``gguf``, a GGUF of its weights in that type beside it, written once."""
    import gpt2numba as g

    folder = model or Path(tempfile.gettempdir()) / f"gpt2numba-start-{config}"
    if model is None and not (folder / "model.safetensors").exists():
        g.save_weights(g.random_weights(getattr(g.GPT2Config, config)(), seed=0), folder)
    if gguf is None:
        return folder
    from gpt2numba.integrations.gguf_export import write_gguf

    file = folder.parent / f"{folder.name}-{gguf}.gguf"
    if not file.exists() or file.stat().st_mtime < (folder / "model.safetensors").stat().st_mtime:
        part = file.with_suffix(".partial")  # (renamed once whole: an interrupted run leaves no file to reuse)
        write_gguf(g.load_weights(folder, mapped=False), part, gguf, quantizer="gguf")
        part.rename(file)
    return file


def wall(argv, env) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"{argv} failed: {r.stderr[-2000:]}")
    return seconds, r.stdout + r.stderr


def pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))


def held(n: int, model: Path, dtype: str, env) -> int:
    """The PSS of ``n`` processes holding the weights in ``dtype`` at once, summed (KiB)."""
    runs = [subprocess.Popen([sys.executable, "-c", HOLD, str(model), dtype], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    try:
        for run in runs:
            assert run.stdout.readline().strip() == "ready"
        return sum(pss_kib(run.pid) for run in runs)
    finally:
        for run in runs:
            run.communicate("\n", timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: seeded random weights)")
    parser.add_argument("--config", default="small", choices=["small", "medium", "large", "xl"])
    parser.add_argument("--gguf", choices=["F32", "F16", "Q8_0", "Q4_0"], help="time a GGUF of the weights")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, help="a checkout of an earlier commit to run in turns")
    parser.add_argument("--idle-patience", type=float, default=30.0, help="seconds to wait for a quiet machine")
    args = parser.parse_args()
    set_idle_patience(args.idle_patience)
    model = checkpoint(args.config, args.model, args.gguf)
    trees = {"this tree": dict(os.environ)}
    if args.before is not None:
        trees["before"] = {**os.environ, "PYTHONPATH": str(args.before.resolve())}
    generate = [sys.executable, "-m", "gpt2numba", "generate", "Hello", "--max-new-tokens", "1", "--model", str(model),
                "--dtype", args.dtype]
    def load_script(mapped):
        return LOAD.format(mapped=mapped, dtype=args.dtype)

    jobs = {
        "import gpt2numba": lambda env: wall([sys.executable, "-c", "import gpt2numba"], env),
        "generate, 1 token": lambda env: wall(generate, env),
        "load_weights, mapped": lambda env: wall([sys.executable, "-c", load_script(True), str(model)], env),
        "load_weights, in memory": lambda env: wall([sys.executable, "-c", load_script(False), str(model)], env),
    }
    for env in trees.values():  # (untimed: Numba's caches, the mapped copy, the page cache)
        for job in jobs.values():
            job(env)
    print(f"{machine()['cpu']}; {model} ({args.config}); medians of {args.rounds} processes")
    figures = {(tree, name): [] for tree in trees for name in jobs}
    lines = {}
    with Load() as load:
        for _, (tree, name) in in_turns([(t, n) for t in trees for n in jobs], args.rounds):
            seconds, out = jobs[name](trees[tree])
            inside = out.strip().splitlines()[-1] if name.startswith("load") else None
            figures[tree, name].append(float(inside) if inside else seconds)
            lines[tree, name] = next((x for x in out.splitlines() if x.startswith("gpt2numba: 1 prompt")), "")
    for (tree, name), values in figures.items():
        print(f"{tree:10} {name:24} {np.median(values):7.3f} s  (min {min(values):.3f}, max {max(values):.3f})"
              + (f"\n{'':36}{lines[tree, name][11:]}" if lines[tree, name] else ""))
    print(f"others' CPU share over the runs: {100 * (load.share or 0):.0f}%")
    for tree, env in trees.items():
        one, two = held(1, model, args.dtype, env), held(2, model, args.dtype, env)
        print(f"{tree:10} PSS: one process {one / 1024:.0f} MiB, two at once {two / 1024:.0f} MiB ({two / one:.2f}x)")


if __name__ == "__main__":
    main()

"""transformers in a process that imported gpt2numba first and ran a pass, against a process that never did
(issue 58).

    python profiling/studies/beside_torch.py [--python PATH] [--before DIR] [--rounds 5] [--repeat 7] [--tokens 128]

Each round starts one fresh process per condition, in turns (the order reversed each round, each after
waiting for a quiet machine): "alone" imports torch and transformers only; "after gpt2numba" imports
gpt2numba, runs a prefill on its own weights, then imports torch and transformers. Both load the same seeded
random GPT-2 small (written once, in the model's layout) in float32 and in bfloat16, time --repeat forward
passes over --tokens tokens after two untimed ones, and report their median. Printed per dtype: the median
over rounds of each condition's median, their ratio, the OpenMP runtimes each process held (threadpoolctl)
and, for "after gpt2numba", where its regions ran (pool.describe()). --python runs the processes in another
environment (a virtual environment's interpreter, as a user's); --before DIR adds a third condition, "after
gpt2numba" with DIR first on PYTHONPATH (a checkout of the code before a change: `git worktree add DIR REV`).
Needs torch and transformers there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from gpt2numba.cpu.dispatch import cpu_name
from gpt2numba.bench.core import Load, in_turns

WORKER = """
import json, sys, time
model_dir, first, tokens, repeat = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
where = None
if first:
    import numpy as np
    import gpt2numba as g
    from gpt2numba.cpu import pool
    w = g.load_weights(model_dir)
    g.prefill(np.arange(16), w, g.ModelCache(w.config))
    where = pool.describe()
import torch, transformers, threadpoolctl
transformers.logging.set_verbosity_error()
torch.set_num_threads(2)
ids = torch.arange(tokens)[None] % 50257
out = {"where": where, "torch_threads": torch.get_num_threads()}
for dtype in ("float32", "bfloat16"):
    model = transformers.GPT2LMHeadModel.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype)).eval()
    times = []
    with torch.inference_mode():
        for k in range(repeat + 2):
            t = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - t)
    out[dtype] = sorted(times[2:])[repeat // 2] * 1e3
out["openmp"] = sorted(i["filepath"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "openmp")
print(json.dumps(out))
"""

CONDITIONS = ("alone", "after gpt2numba", "after gpt2numba before")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=sys.executable, help="the interpreter the processes run (default: this one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=7, help="timed forward passes per process (median)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--before", help="a checkout of gpt2numba to run as a third condition, first on PYTHONPATH")
    args = p.parse_args(argv)

    import gpt2numba as g

    conditions = CONDITIONS if args.before else CONDITIONS[:2]
    runs = {c: [] for c in conditions}
    with tempfile.TemporaryDirectory() as model_dir:
        g.save_weights(g.random_weights(g.GPT2Config.small(), seed=0), model_dir)
        with Load() as load:
            for _, condition in in_turns(conditions, args.rounds):
                env = dict(os.environ)
                if condition.endswith("before"):
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.before, env.get("PYTHONPATH")]))
                out = subprocess.run([args.python, "-c", WORKER, model_dir, str(int(condition != "alone")),
                                      str(args.tokens), str(args.repeat)],
                                     capture_output=True, text=True, check=True, env=env)
                runs[condition].append(json.loads(out.stdout.splitlines()[-1]))
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {args.python}; {args.rounds} rounds; prefill of {args.tokens} "
          f"tokens, medians of {args.repeat}; other processes took {100 * (load.share or 0):.0f}% of the CPU")
    for dtype in ("float32", "bfloat16"):
        medians = {c: statistics.median(r[dtype] for r in runs[c]) for c in conditions}
        print(f"  {dtype}: " + "   ".join(f"{c} {ms:.1f} ms ({ms / medians['alone']:.2f}x)" for c, ms in medians.items()))
    for c in conditions:
        last = runs[c][-1]
        where = f"; gpt2numba's regions: {last['where']}" if last["where"] else ""
        print(f"  {c}: torch threads {last['torch_threads']}; OpenMP runtimes {last['openmp'] or 'none'}{where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

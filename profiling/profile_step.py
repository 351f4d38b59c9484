"""Where the time of one prefill and one decode step goes, per kernel kind.

    python profiling/profile_step.py [--prompt 512] [--context 128] [--repeat 5] [--dtype int8] [--batch 16]

Wraps each kernel the forward pass calls with a timer (the calls are synchronous,
so wall time per call is the kernel's time), runs the step --repeat times after a
warm-up, and prints the median total per kind in ms and its share. With --batch B, also one
decode_batch step of B sequences, all at --context and then a ragged mix of
contexts 16..900 (seeded): the difference between the two is the extra attention.

With --neighbour NICE, each step also runs beside a busy loop (`python -c 'while True: pass'`)
at that nice, alternating with the runs alone, and the table gives each kind alone, beside
it, and the ratio; then, from the kernel's scheduler statistics for this process's threads
(/proc/self/task/*/schedstat, Linux), per step: the CPU time they got, how long they were
runnable but waiting for a CPU, and how many times they went to sleep. That says where a
neighbour's time goes: into waiting for a core, or into running slower on one.
"""

import argparse
import collections
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import gpt2numba as g
from gpt2numba.bench.kernels import instrument
from gpt2numba.model import compact


def thread_stats() -> np.ndarray:
    """For this (the calling) thread and, summed, the others (the pool's workers): CPU ns, ns
    runnable but waiting for a CPU, and voluntary context switches (times a thread went to sleep).
    Zeros where /proc has no schedstat."""
    total, me = np.zeros((2, 3)), str(threading.get_native_id())
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            cpu, delay, _ = (task / "schedstat").read_text().split()
            status = (task / "status").read_text()
            sleeps = next(line.split()[1] for line in status.splitlines() if line.startswith("voluntary_ctxt"))
            total[int(task.name != me)] += (int(cpu), int(delay), int(sleeps))
    return total


@contextlib.contextmanager
def busy_loop(nice):
    """A plain Python busy loop in its own process at ``nice`` (None: nothing) while the block runs. Spawned,
    not forked: a fork would run the threading layer's fork handlers here (TBB stops and restarts its
    workers), and the threads measured would not be the ones a user's process has."""
    if nice is None:
        yield
        return
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", f"import os; os.nice({nice})\nwhile True: pass"],
                         os.environ)
    time.sleep(0.2)  # let it reach its loop
    try:
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def profile(step, repeat, nices=(None,)):
    """Per condition (a neighbour's nice, None alone), alternating: the median wall seconds, the median
    seconds per kernel kind (the rest of the wall time as "(python, embed)"), and the median thread
    statistics (thread_stats) of ``repeat`` runs."""
    runs = {nice: ([], [], []) for nice in nices}
    step()  # warm up
    for i in range(repeat):
        for nice in nices[i % len(nices):] + nices[:i % len(nices)]:
            walls, kinds, stats = runs[nice]
            totals = collections.defaultdict(float)
            with busy_loop(nice):
                undo = instrument(totals)
                before, t = thread_stats(), time.perf_counter()
                try:
                    step()
                finally:
                    walls.append(time.perf_counter() - t)
                    stats.append(thread_stats() - before)
                    undo()
            kinds.append(totals)
    out = {}
    for nice, (walls, kinds, stats) in runs.items():
        wall, rows = np.median(walls), {k: np.median([r[k] for r in kinds]) for k in kinds[0]}
        out[nice] = wall, {**rows, "(python, embed)": wall - sum(rows.values())}, np.median(stats, axis=0)
    return out


def report(label, results, repeat):
    """Print one step's profile: each kind's ms and share alone, and beside the neighbour when there is one."""
    wall, rows, _ = results[None]
    others = [nice for nice in results if nice is not None]
    print(f"\n{label}: median {1e3 * wall:.2f} ms over {repeat} runs"
          + "".join(f"; beside a busy loop at nice {n}: {1e3 * results[n][0]:.2f} ms "
                    f"({results[n][0] / wall:.2f}x)" for n in others))
    for kind, sec in sorted(rows.items(), key=lambda kv: -kv[1]):
        line = f"  {kind:<16} {1e3 * sec:8.2f} ms  {100 * sec / wall:5.1f}%"
        for n in others:
            beside = results[n][1][kind]
            line += f"   {1e3 * beside:8.2f} ms  {beside / sec if sec else float('nan'):5.2f}x"
        print(line)
    if others:
        print(f"  {'threads':<22} {'CPU ms':>8}  {'waiting for a CPU ms':>20}  {'sleeps':>6}")
        for n in [None, *others]:
            for who, (cpu, delay, sleeps) in zip(("calling", "workers"), results[n][2]):
                label = f"{'alone' if n is None else f'nice {n}'}, {who}"
                print(f"  {label:<22} {cpu / 1e6:8.2f}  {delay / 1e6:20.2f}  {sleeps:6.0f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--dtype", default="float32", choices=compact.DTYPES)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--batch", type=int, default=0, help="also a decode step of this many sequences")
    p.add_argument("--neighbour", type=int, metavar="NICE", help="also beside a busy loop at this nice")
    args = p.parse_args()
    nices = (None,) if args.neighbour is None else (None, args.neighbour)
    w = (g.load_weights(args.model, dtype=args.dtype) if args.model
         else g.random_weights(g.GPT2Config.small(), seed=0, dtype=args.dtype))
    rng = np.random.default_rng(0)
    mc = g.ModelCache(w.config)
    g.prefill(rng.integers(0, w.config.vocab_size, 4), w, mc)  # compile or load the kernels

    prompt = rng.integers(0, w.config.vocab_size, args.prompt)

    def one_prefill():
        mc.reset()
        g.prefill(prompt, w, mc)
    report(f"prefill of {args.prompt} tokens", profile(one_prefill, args.repeat, nices), args.repeat)

    mc.reset()
    g.prefill(prompt[: args.context], w, mc)

    def one_decode():
        g.decode_step(1, w, mc)
        mc._length -= 1  # decode the same position again (test-only rewind)
        mc._lengths[:] -= 1
    report(f"decode step after {args.context} tokens", profile(one_decode, args.repeat, nices), args.repeat)

    if args.batch:
        top = min(900, w.config.n_positions - 1)
        for label, contexts in [(f"at context {args.context} each", [args.context] * args.batch),
                                (f"at contexts {min(16, top)}..{top} (ragged)",
                                 rng.integers(min(16, top), top + 1, args.batch))]:
            caches = [g.ModelCache(w.config, max_len=int(n) + 1) for n in contexts]
            g.prefill_batch([rng.integers(0, w.config.vocab_size, n) for n in contexts], w, caches)
            print(f"\n(attention over {sum(contexts)} cached positions in all)", end="")

            def one_batch_step():
                g.decode_batch([1] * len(caches), w, caches)
                for mc in caches:  # decode the same positions again (test-only rewind)
                    mc._length -= 1
                    mc._lengths[:] -= 1
            report(f"decode step of {args.batch} sequences {label}", profile(one_batch_step, args.repeat, nices),
                   args.repeat)


if __name__ == "__main__":
    main()

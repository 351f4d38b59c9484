"""How fast each format multiplies a layer's matrices by many rows, on this machine.

    python profiling/matrix_rate.py [--rows 8 32 128 512] [--repeat 9] [--dtypes float32 int8 int4] [--model DIR]

The products go through products.matmul, as a pass runs them (one pinned thread pool, BLAS
on one thread inside it), so each format takes the kernel a pass picks at that many rows:
a few rows read the weights as stored (_rows_product, _int_rows); more go to BLAS (float32;
bfloat16 widened first) or to the integer tiles (inttiles.py), the inputs quantised in the
call. Per number of rows the formats alternate over the four matrices of a layer (GPT-2
small's shapes with random weights, or --model's first layer). The table gives each
format's median time for the four, its rate in multiply-adds per second, and its speed
against float32. That ratio bounds what a format can gain over float32 on many rows (a
batch, a prompt, a scored document): the rest of a pass (attention, GELU, layer norms)
costs every format the same. `others` is the CPU share of other processes during the runs;
the script waits for a quiet machine before each number of rows (up to --idle-patience seconds).
"""

import argparse
import dataclasses
import time

import numpy as np

import gpt2numba as g
from gpt2numba.cpu import dispatch, pool
from gpt2numba.model import compact, forward, products
from gpt2numba.bench.core import Load, machine, set_idle_patience, wait_for_idle

def layer_products(w, rows, threads):
    """A function that runs the four matrix products of layer 0 for ``rows`` rows of w's format, and
    their multiply-adds."""
    cfg = w.config
    C = cfg.n_embd
    work = products.workspace(w, rows, threads)
    n_chunks = dispatch.n_chunks(threads)
    rng = np.random.default_rng(0)
    shapes = {"c_attn_w": (C, 3 * C), "attn_c_proj_w": (C, C),  # (inputs, outputs)
              "c_fc_w": (C, 4 * C), "mlp_c_proj_w": (4 * C, C)}
    jobs = [(rng.standard_normal((rows, K), dtype=np.float32), field, np.zeros(N, np.float32),
             np.empty((rows, N), np.float32)) for field, (K, N) in shapes.items()]

    def run():
        for x, field, b, out in jobs:
            products.matmul(x, field, 0, b, out, False, w, work, n_chunks)
    return run, sum(rows * x.shape[1] * out.shape[1] for x, _, _, out in jobs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128, 512])
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--dtypes", nargs="+", default=["float32", "int8", "int4"], choices=compact.DTYPES)
    p.add_argument("--model", help="a checkpoint directory (default: GPT-2 small's shapes, random weights)")
    p.add_argument("--idle-patience", type=float, default=30.0, metavar="SECONDS",
                   help="wait up to this long for a quiet machine before each number of rows (0: do not wait)")
    args = p.parse_args()
    set_idle_patience(args.idle_patience)
    threads = forward.get_threads()
    if args.model:
        weights = {d: g.load_weights(args.model, dtype=d) for d in args.dtypes}
    else:
        cfg = dataclasses.replace(g.GPT2Config.small(), n_layer=1)  # one layer's matrices are all it multiplies
        weights = {d: g.random_weights(cfg, seed=0, dtype=d) for d in args.dtypes}
    about = machine()
    print(f"matrix products of a layer (its four matrices, n_embd {next(iter(weights.values())).config.n_embd}), "
          f"{threads} threads; {about['cpu']}, the integer tiles multiply with {about['integer_tiles']}")
    print(f"{'rows':>5} {'format':8} {'ms':>8} {'GMAC/s':>8} {'vs float32':>10} {'others':>6}")
    for rows in args.rows:
        runs = {d: layer_products(w, rows, threads) for d, w in weights.items()}
        times = {d: [] for d in runs}
        wait_for_idle()
        with pool.pinned(), products.one_blas_thread(), Load() as load:
            for run, _ in runs.values():
                run()  # compile or load, and touch the buffers
            for _ in range(args.repeat):
                for d, (run, _) in runs.items():
                    t = time.perf_counter()
                    run()
                    times[d].append(time.perf_counter() - t)
        base = np.median(times["float32"]) if "float32" in times else None
        for d, ts in times.items():
            median = float(np.median(ts))
            ratio = f"{base / median:.2f}x" if base else "-"
            share = "-" if load.share is None else f"{100 * load.share:.0f}%"
            print(f"{rows:>5} {d:8} {1e3 * median:8.2f} {runs[d][1] / median / 1e9:8.1f} {ratio:>10} {share:>6}")


if __name__ == "__main__":
    main()

"""Throughput: many sequences at once (gpt2numba bench; --no-throughput skips it). Tokens/s of B sequences
decoding together (decode_batch, against transformers' batched generate), a ragged mix of contexts, and
prefill_batch against one prefill after another, beside the floors of a step of B rows."""

from __future__ import annotations

import numpy as np

from .core import Load, gemm_rate, percent, progress, summary, system_rows, versus, wait_for_idle

RAGGED_BATCH, RAGGED_CONTEXTS = 16, (16, 900)  # the ragged mix: 16 sequences, contexts uniform in [16, 900]
PREFILL_BATCH = 8  # prompts of --batch-context tokens: one prefill_batch against one prefill after another


def gemm_floors(cfg, args) -> dict:
    """The BLAS rate at B rows through c_fc's shape, for each batch size: the GEMM floor of a step."""
    # B rows through c_fc's shape: small M is a skinny product, far below the 512-row rate. Two
    # BLAS threads on two busy cores run a skinny product tens of times slower: wait for quiet.
    wait_for_idle()
    return {"batch_gemm_shape": (cfg.n_embd, 4 * cfg.n_embd),
            "batch_gemm_gflop_s": {B: gemm_rate(B, cfg.n_embd, 4 * cfg.n_embd, args.threads) / 1e9
                                   for B in sorted({*args.batch_sizes, RAGGED_BATCH})}}


def run(ours, theirs, w, floors, args):
    """Tokens/s of B sequences decoding together, a ragged mix of contexts, prefill_batch against prefills.

    ours: the gpt2numba workers; theirs: transformers' worker, or None.
    """
    cfg, steps = w.config, args.batch_steps
    result = {"context": args.batch_context, "steps": steps, "batches": {}, "notes": []}
    sizes = args.batch_sizes
    if args.batch_context + steps + 2 > cfg.n_positions:
        result["notes"].append(f"batch sizes skipped: context {args.batch_context} + {steps} steps + 2 "
                               f"> n_positions {cfg.n_positions}")
        sizes = []
    rng = np.random.default_rng(3)
    pace = {}  # transformers' seconds per prompt token, padding included, in its last generate
    blocks = [*((B, "uniform") for B in sizes), (RAGGED_BATCH, "ragged"), (PREFILL_BATCH, "prefill")]
    for B, kind in progress(blocks, "throughput"):
        if kind == "prefill":
            result["prefill"] = _batch_prefill(ours, w, args, result["notes"])
            continue
        if kind == "uniform":
            contexts = np.full(B, args.batch_context)
        else:  # as many of 16..900 as fit beside the steps: n_positions 64 gives 16..60
            high = min(RAGGED_CONTEXTS[1], cfg.n_positions - steps - 2)
            if high < 1:
                result["notes"].append(f"ragged mix skipped: n_positions {cfg.n_positions} leaves no context "
                                       f"for {steps} steps")
                continue
            contexts = np.random.default_rng(4).integers(min(RAGGED_CONTEXTS[0], high), high + 1, B)
        prompts = [rng.integers(0, cfg.vocab_size, n) for n in contexts]
        row = _batch_decode(ours, theirs, prompts, args, pace, result["notes"], f"B={B} {kind}")
        entry = {"decode": row, "floor_ms": {name: _batch_floor(floors, cfg, name, B, int(contexts.sum()))
                                             for name, _ in system_rows(row)}}
        if kind == "uniform":
            result["batches"][B] = entry
        else:
            result["ragged"] = {"contexts": contexts.tolist(),
                                "attention_ratio": float(contexts.sum() / (B * args.batch_context)), **entry}
    return result


def _batch_decode(ours, theirs, prompts, args, pace, notes, label):
    """B sequences decoding together: the gpt2numba formats step by step in turn, then transformers' generate.

    prompts: B id arrays, lengths may differ. Returns the table's row: step-time stats with tok_s per
    system, others' CPU share, and how many sequences' greedy tokens transformers matched (float32).
    """
    B, steps = len(prompts), args.batch_steps
    for s in ours:  # the prefill's token, a warm-up step's, then the timed steps', and one row spare
        s.call("batch_caches", [len(ids) + steps + 2 for ids in prompts])
    chosen = {s.name: [s.call("prefill_batch", prompts)[1]] for s in ours}  # per step: B greedy tokens
    for s in ours:  # one untimed step each: warm-up
        chosen[s.name].append(s.call("decode_batch", chosen[s.name][-1])[1])
    times = {s.name: [] for s in ours}
    theirs_tokens = None
    padded = B * max(map(len, prompts))  # transformers computes the left padding too
    wait_for_idle()
    with Load(*(s.process.pid for s in [*ours, *([theirs] if theirs else [])])) as load:
        for _ in range(steps):
            for s in ours:
                seconds, greedy, _ = s.call("decode_batch", chosen[s.name][-1])
                chosen[s.name].append(greedy)
                times[s.name].append(seconds)
        predicted = pace.get("s_per_token", 0.0) * padded
        if theirs and predicted > args.transformers_max_s:
            notes.append(f"transformers skipped at {label}: about {predicted:.0f} s predicted from the last "
                         f"batch > --transformers-max-s {args.transformers_max_s:g}")
        elif theirs:
            seconds, out, _ = theirs.call("generate", _left_padded(prompts, steps + 2))
            pace["s_per_token"] = seconds / padded
            times["transformers"] = np.diff(out["put_s"])[2:]  # after the prefill's gap and a warm-up step's
            theirs_tokens = out["tokens"]
    row = {"sequences": B}
    for name, ts in times.items():
        row[name] = summary(ts)
        row[name]["tok_s"] = 1e3 * B / row[name]["median_ms"]
    row["others_cpu"] = load.share
    if theirs_tokens is not None and "gpt2numba" in chosen:
        same = np.array(chosen["gpt2numba"]).T == np.array(theirs_tokens)  # (B, steps + 2)
        row["same_greedy_sequences"] = int(same.all(axis=1).sum())
    return row


def _left_padded(prompts, new_tokens):
    """generate's arguments for a batch: every prompt ends in the last column, masked padding before it."""
    T = max(map(len, prompts))
    ids = np.zeros((len(prompts), T), np.int64)  # (B, T)
    mask = np.zeros((len(prompts), T), np.int64)  # (B, T): 1 on a prompt, 0 on padding
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    return ids, mask, new_tokens


def _batch_floor(floors, cfg, name, B, context_sum):
    """Floors of one decode step of B sequences, ms: reading the weights and the K/V rows of the contexts
    (over 600 MB at B = 64 x 128, more than GPT-2 small's weights), and the matrix products of B rows."""
    kv_bytes = context_sum * 2 * cfg.n_layer * cfg.n_embd * 4  # float32 K and V, every layer
    matrix_params = cfg.n_layer * 12 * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd  # 4 per block, wte
    read_b_s = 1e9 * floors["read_gb_s"]
    return {"read": 1e3 * (floors["decode_bytes"][name] + kv_bytes) / read_b_s, "kv_read": 1e3 * kv_bytes / read_b_s,
            "gemm": 1e3 * 2 * B * matrix_params / (1e9 * floors["batch_gemm_gflop_s"][B])}


def _batch_prefill(ours, w, args, notes):
    """PREFILL_BATCH prompts as one prefill_batch against one prefill after another, in each format."""
    T = args.batch_context
    if T > w.config.n_positions:
        notes.append(f"prefill_batch skipped: {T} tokens > n_positions {w.config.n_positions}")
        return None
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, w.config.vocab_size, T) for _ in range(PREFILL_BATCH)]
    diffs = {}
    for s in ours:  # warm-up; both ways must give the same logits
        s.call("batch_caches", [T] * PREFILL_BATCH)
        batch = s.call("prefill_batch", prompts, logits=True)[2]
        diffs[s.name] = float(np.abs(batch - s.call("prefill_each", prompts, logits=True)[2]).max())
    times = {s.name: {"batch": [], "sequential": []} for s in ours}
    wait_for_idle()
    with Load(*(s.process.pid for s in ours)) as load:
        for _ in range(args.repeat):
            for s in ours:
                times[s.name]["batch"].append(s.call("prefill_batch", prompts)[0])
                times[s.name]["sequential"].append(s.call("prefill_each", prompts)[0])
    result = {"prompts": PREFILL_BATCH, "length": T, "runs": args.repeat, "others_cpu": load.share}
    for name, t in times.items():
        result[name] = {"batch": summary(t["batch"]), "sequential": summary(t["sequential"]),
                        "max_abs_logit_diff": diffs[name]}
    return result


# --- the table ----------------------------------------------------------------------------------------

def print_report(t, floors):
    shape = "x".join(map(str, floors["batch_gemm_shape"]))
    print(f"\nthroughput: B sequences decoding together at context {t['context']} each, median of {t['steps']} "
          f"decode_batch steps; transformers: batched greedy generate")
    print(f"floors per step: read = (weight bytes + the contexts' K/V rows) / read rate; GEMM = 2 B x matrix "
          f"parameters / BLAS rate at Bx{shape}: "
          + ", ".join(f"B={B} {rate:.0f}" for B, rate in floors["batch_gemm_gflop_s"].items()) + " GFLOP/s")
    first = min(t["batches"], default=None)
    base = {name: o["tok_s"] for name, o in system_rows(t["batches"][first]["decode"])} if first else {}
    print(f"\n{'batch':>6}  {'system':<22} {'step ms':>8} {'tok/s':>6} {f'vs B={first or 1}':>7} {'read ms':>8} "
          f"{'GEMM ms':>8} {'/floor':>7} {'vs transformers':>15} {'others':>6}")
    ragged = t.get("ragged")
    for B, entry in t["batches"].items():
        _print_batch(str(B), entry, base)
        if B == RAGGED_BATCH and ragged:
            _print_ragged(ragged, t, base)
            ragged = None
    if ragged:
        _print_ragged(ragged, t, base)
    p = t.get("prefill")
    if p:
        print(f"\nprefill {p['prompts']} x {p['length']} tokens: one prefill_batch against {p['prompts']} "
              f"prefills one after another (median of {p['runs']}), "
              f"others {percent(p['others_cpu'])}")
        for name, o in system_rows(p):
            batch, each = o["batch"]["median_ms"], o["sequential"]["median_ms"]
            print(f"{'':>8}{name:<22} {batch:>8.1f} ms against {each:>8.1f} ms: {each / batch:.2f}x; "
                  f"max |batch - one by one| logits {o['max_abs_logit_diff']:.1e}")
    for note in t["notes"]:
        print(f"throughput: {note}")


def plot(t, path) -> None:
    """A PNG at ``path``: each system's tokens/s against the sequences of a decode_batch step (the rows of
    its matrix products), both axes logarithmic. Needs matplotlib (the [bench] extra)."""
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    sizes = sorted(t["batches"], key=int)
    names = dict.fromkeys(name for B in sizes for name, _ in system_rows(t["batches"][B]["decode"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        have = [B for B in sizes if name in t["batches"][B]["decode"]]
        ax.plot([int(B) for B in have], [t["batches"][B]["decode"][name]["tok_s"] for B in have], marker="o",
                label=name)
    ax.set(xscale="log", yscale="log", xlabel="sequences per decode_batch step (rows of its matrix products)",
           ylabel="tokens/s", title=f"B sequences decoding together at context {t['context']}")
    ax.set_xticks([int(B) for B in sizes], [str(B) for B in sizes])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_batch(label, entry, base):
    row = entry["decode"]
    for name, o in system_rows(row):
        f = entry["floor_ms"][name]
        vs_base = f"{o['tok_s'] / base[name]:.2f}x" if name in base else ""
        print(f"{label:>6}  {name:<22} {o['median_ms']:>8.2f} {o['tok_s']:>6.0f} {vs_base:>7} {f['read']:>8.1f} "
              f"{f['gemm']:>8.1f} {o['median_ms'] / max(f['read'], f['gemm']):>6.2f}x {versus(row, name):>15} "
              f"{percent(row['others_cpu']):>6}")
    if "same_greedy_sequences" in row:
        print(f"{'':>8}same greedy tokens as transformers: {row['same_greedy_sequences']} of "
              f"{row['sequences']} sequences")


def _print_ragged(r, t, base):
    contexts = r["contexts"]
    print(f"{'':>8}ragged: {len(contexts)} sequences at contexts {min(contexts)} to {max(contexts)}, "
          f"{r['attention_ratio']:.2f}x the attention work of {len(contexts)} x {t['context']}"
          + (f"; transformers pads each to {max(contexts)}" if "transformers" in r["decode"] else ""))
    _print_batch("ragged", r, base)


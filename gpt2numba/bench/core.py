"""The benchmark's shared machinery: systems in worker processes behind the same calls, runs that alternate
between them, this machine's floors, waiting for a quiet machine and saying how loud it was, the figures'
summaries and the helpers that print them. Each section (standard, throughput, scoring, llama) imports this
module and none of the others' private names.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from .peers import transformers
from .worker import BOOT

GEMM_SHAPE = (512, 768, 3072)  # (tokens, n_embd, 4 n_embd): GPT-2 small's c_fc at 512 tokens


# --- systems in worker processes, behind the same calls ----------------------------------------------------

class Remote:
    """One system in a worker process of its own (worker.py); call() runs one prefill or decode there and times it.

    A peer (any ``make`` but gpt2numba_system) runs in a process that never imports gpt2numba; every worker
    starts in process_environment.
    """

    def __init__(self, make, kind, model_dir, threads):
        """make(kind, model_dir, threads) -> (system, name, version), run in the worker: gpt2numba_system
        here, or a peer module's ``system`` (a module of bench/peers/, or any file that imports no gpt2numba)."""
        spec, self.peer = make_spec(make)
        self.conn, child = multiprocessing.Pipe()
        try:
            self.process = subprocess.Popen([sys.executable, "-c", BOOT, WORKER, spec, str(child.fileno())],
                                            pass_fds=[child.fileno()], env=process_environment(self.peer))
        except OSError:
            self.conn.close()
            raise
        finally:
            child.close()
        try:
            self.conn.send((kind, str(model_dir), threads))
            self.name, self.version = self.conn.recv()
        except (EOFError, BrokenPipeError):
            self.conn.close()
            raise RuntimeError(f"the worker for {make.__module__}.{make.__name__}({kind!r}) ended before it "
                               f"started (exit status {self.process.wait()}; its error is above)") from None

    def call(self, method, arg, logits=False):
        """(seconds, greedy, logits or None) of system.method(arg), timed in the worker.

        greedy: the argmax of each row of logits, an int for (vocab,) and a list for (B, vocab);
        a method that returns no logits has its result here instead.
        """
        time.sleep(0.02)  # let the other process's threads stop spinning
        self.conn.send((method, arg, logits))
        reply = self.conn.recv()
        if isinstance(reply, str):
            raise RuntimeError(f"{self.name} failed: {reply}")
        return reply

    def close(self):
        """Let the worker end (killed after 30 s), whatever state it is in."""
        try:
            self.conn.send(None)
        except OSError:  # (it has ended already)
            pass
        self.conn.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


WORKER = str(Path(__file__).with_name("worker.py"))


def make_spec(make) -> tuple[str, bool]:
    """(what worker.load takes for the function ``make``, whether it is a peer's): gpt2numba_system by its
    module's name, a peer's ``system`` by its file's path, so that its process never imports gpt2numba."""
    if make is gpt2numba_system:
        return f"{make.__module__}:{make.__name__}", False
    return f"{sys.modules[make.__module__].__file__}:{make.__name__}", True


def peer_settings(remotes) -> dict:
    """What each peer's worker ran with (worker.environment): its threads, the thread variables it started
    with, whether gpt2numba or Numba were in it."""
    return {r.name: r.call("environment", None)[1] for r in remotes}


def print_peer_settings(settings: dict) -> None:
    for name, e in settings.items():
        variables = ", ".join(f"{k}={v}" for k, v in sorted(e["variables"].items())) or "none set"
        print(f"{name} ran in a process of its own: {e['threads']} threads; thread settings in its environment: "
              f"{variables}; gpt2numba or Numba imported in it: {', '.join(e['imported']) or 'no'}")


def start_peer(make, kind, path, threads):
    """Remote(make, kind, path, threads), or None when the peer's library is not installed (its ``make``
    then gives version None)."""
    remote = Remote(make, kind, path, threads)
    if remote.version is None:
        remote.close()
        return None
    return remote


class Ours:
    def __init__(self, g, w):
        self.g, self.w = g, w
        self.name = dtype_name(format_of(w))
        self.mc = g.ModelCache(w.config)
        self.caches = []  # the batch's, one per sequence

    def prefill(self, ids):
        self.mc.reset()
        return self.g.prefill(ids, self.w, self.mc)

    def decode(self, token):
        return self.g.decode_step(token, self.w, self.mc)

    def threads(self):
        return self.g.get_threads()

    def decode_kernels(self, job):
        """Prefill ``ids`` (untimed), then ``steps`` greedy decode steps with every kernel timed (kernels.py):
        {kind: seconds per step}. job: (ids, steps)."""
        from .kernels import instrument

        ids, steps = job
        token = int(self.prefill(ids).argmax())
        totals = collections.defaultdict(float)
        undo = instrument(totals)
        try:
            for _ in range(steps):
                token = int(self.decode(token).argmax())
        finally:
            undo()
        return {kind: seconds / steps for kind, seconds in totals.items()}

    def threads_run_on(self, arg) -> str:
        """Where the worker's parallel regions run (pool.describe()), after the passes it ran."""
        from ..cpu import pool

        return pool.describe()

    def batch_caches(self, max_lens):
        """New caches for a batch, each just long enough: 64 of 1024 positions would be 4.8 GB."""
        self.caches = []  # the old ones go first
        self.caches = [self.g.ModelCache(self.w.config, max_len=n) for n in max_lens]

    def prefill_batch(self, prompts):
        for mc in self.caches:
            mc.reset()
        return self.g.prefill_batch(prompts, self.w, self.caches)  # (B, vocab)

    def prefill_each(self, prompts):
        """The same prompts one prefill after another: what prefill_batch saves."""
        for mc in self.caches:
            mc.reset()
        return np.stack([self.g.prefill(ids, self.w, mc) for ids, mc in zip(prompts, self.caches)])

    def decode_batch(self, tokens):
        return self.g.decode_batch(tokens, self.w, self.caches)  # (B, vocab)

    def score_long(self, job):
        """One long document in sliding windows: (tokens scored, [nll])."""
        ids, stride = job
        s = self.g.score(ids, self.w, stride=stride)
        return s.n_tokens, [s.nll]

    def score_docs(self, docs):
        """Many short documents: (tokens scored, nll per document)."""
        scores = self.g.score_batch(docs, self.w)
        return sum(s.n_tokens for s in scores), [s.nll for s in scores]

    def logprobs(self, docs):
        """log p of each token but the first, per document: float64 (len(doc) - 1,) arrays."""
        return [s.logprobs for s in self.g.score_batch(docs, self.w)]

    def generate(self, job):
        """Greedy generate_batch of (prompts, new_tokens) without an end-of-text stop: tokens per prompt."""
        prompts, new_tokens = job
        tokens = [[] for _ in prompts]
        for i, token in self.g.generate_batch(prompts, self.w, max_new_tokens=new_tokens, temperature=0.0,
                                              stop_at_eos=False):
            tokens[i].append(token)
        return tokens

    def beam(self, job):
        """beam_search_batch of (prompts, new_tokens, num_beams) without an end-of-text stop (min_new_tokens
        = new_tokens): the best hypothesis's tokens per prompt."""
        prompts, new_tokens, num_beams = job
        found = self.g.beam_search_batch(prompts, self.w, num_beams=num_beams, max_new_tokens=new_tokens,
                                         min_new_tokens=new_tokens)
        return [hypotheses[0].ids for hypotheses in found]



def gpt2numba_system(dtype, model_dir, threads):
    """(system, name, version) of gpt2numba in the format ``dtype`` (a bench format, weights_format): a ``make``
    for Remote."""
    import gpt2numba as g

    g.set_threads(threads)
    stored, activations = weights_format(dtype)
    system = Ours(g, g.load_weights(model_dir, dtype=stored, activations=activations))
    return system, system.name, "gpt2numba"


BF16_ACTIVATIONS = "bfloat16-act"  # the bench's format of bfloat16 weights with bfloat16 activations


def weights_format(name: str) -> tuple[str, str]:
    """(dtype, activations) of a bench format: a weights dtype (float32 activations), or BF16_ACTIVATIONS."""
    return ("bfloat16", "bfloat16") if name == BF16_ACTIVATIONS else (name, "float32")


def format_of(w) -> str:
    """The bench format of weights ``w``."""
    return BF16_ACTIVATIONS if w.activations == "bfloat16" else w.dtype


def dtype_name(dtype):
    return "gpt2numba" if dtype == "float32" else f"gpt2numba {dtype}"


# --- alternating runs --------------------------------------------------------------------------------

def progress(items, what):
    """A progress bar on stderr over ``items`` (the benchmark takes minutes)."""
    from tqdm import tqdm

    return tqdm(items, desc=what, unit="block", file=sys.stderr, leave=False)


def prefill_runs(systems, w, args):
    rng = np.random.default_rng(0)
    results = {}
    for T in progress(args.lengths, "prefill"):
        if T > w.config.n_positions:
            continue
        ids = rng.integers(0, w.config.vocab_size, T)
        logits = {s.name: s.call("prefill", ids, logits=True)[2] for s in systems}  # warm-up; must agree
        times = {s.name: [] for s in systems}
        wait_for_idle()
        with Load(*(s.process.pid for s in systems)) as load:
            for _ in range(args.repeat):
                for s in systems:
                    times[s.name].append(s.call("prefill", ids)[0])
        results[T] = {name: summary(ts) for name, ts in times.items()}
        results[T]["others_cpu"] = load.share
        if "transformers" in logits and "gpt2numba" in logits:
            results[T]["max_abs_logit_diff"] = float(np.abs(logits["gpt2numba"] - logits["transformers"]).max())
    return results


RUN = 8  # decode steps a system runs back to back, as a generation loop does, before the next one's turn


def decode_runs(systems, w, args):
    """Per context: args.steps greedy decode steps per system, in turns of RUN steps (each turn after the
    others' threads have gone quiet, Remote.call); each step timed on its own."""
    rng = np.random.default_rng(1)
    results = {}
    for context in progress(args.contexts, "decode"):
        if context + args.steps + 1 > w.config.n_positions:
            continue
        ids = rng.integers(0, w.config.vocab_size, context)
        tokens = {s.name: s.call("prefill", ids)[1] for s in systems}
        for s in systems:  # one untimed step each: warm-up
            tokens[s.name] = s.call("decode", tokens[s.name])[1]
        times, greedy = {s.name: [] for s in systems}, {s.name: [] for s in systems}
        wait_for_idle()
        with Load(*(s.process.pid for s in systems)) as load:
            for done in range(0, args.steps, RUN):
                for s in systems:
                    seconds, steps = s.call("decode_run", (tokens[s.name], min(RUN, args.steps - done)))[1]
                    times[s.name] += seconds
                    greedy[s.name] += steps
                    tokens[s.name] = steps[-1]
        results[context] = {name: summary(ts) for name, ts in times.items()}
        results[context]["others_cpu"] = load.share
        if "transformers" in greedy and "gpt2numba" in greedy:
            results[context]["same_greedy_tokens"] = greedy["gpt2numba"] == greedy["transformers"]
    return results


def alternate(systems, method, jobs, repeat):
    """Each system's method(jobs[its name]) once untimed (warm-up), then ``repeat`` timed runs in turns
    (A B A B ...), after waiting for quiet. Returns (the first call's result by name, seconds by name, the CPU
    share that other processes took meanwhile)."""
    first = {s.name: s.call(method, jobs[s.name])[1] for s in systems}
    times = {s.name: [] for s in systems}
    wait_for_idle()
    with Load(*(s.process.pid for s in systems)) as load:
        for _ in range(repeat):
            for s in systems:
                times[s.name].append(s.call(method, jobs[s.name])[0])
    return first, times, load.share


def summary(seconds):
    ms = 1e3 * np.asarray(seconds)
    return {"median_ms": float(np.median(ms)), "min_ms": float(ms.min()), "max_ms": float(ms.max()), "n": len(ms)}


# --- the machine's floors ---------------------------------------------------------------------------

def measure_floors(stored, args):
    """Read bandwidth and GEMM rate of this machine, and what they make the floors of decode and prefill.

    stored: dtype -> the weights in that format."""
    bandwidth = read_bandwidth(args.bandwidth_mib)
    gemm = gemm_rate(*GEMM_SHAPE, args.threads)
    cfg = stored["float32"].config
    # decode reads every matrix once, the output head included, but only one row of wpe
    decode_bytes = {dtype_name(d): wd.nbytes - wd.wpe.nbytes for d, wd in stored.items()}
    decode_bytes["transformers"] = decode_bytes[dtype_name("float32")]
    decode_bytes[transformers.BF16] = decode_bytes["transformers"] // 2  # (every tensor of it in bfloat16)
    floors = {"read_gb_s": bandwidth / 1e9, "gemm_gflop_s": gemm / 1e9, "decode_bytes": decode_bytes,
              "decode_floor_ms": {k: 1e3 * b / bandwidth for k, b in decode_bytes.items()},
              "prefill_floor_ms": {T: 1e3 * prefill_flops(cfg, T) / gemm for T in args.lengths}}
    return floors


def read_bandwidth(mib):
    """Bytes/s of the best of five streaming reads of a float32 array of ``mib`` MiB (stream.stream_sum, on
    the threads set), after waiting for a quiet machine: what the memory can do."""
    from .stream import stream_sum

    wait_for_idle()
    a = np.ones(mib * 2**20 // 4, np.float32)
    stream_sum(a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        stream_sum(a)
        times.append(time.perf_counter() - t)
    return a.nbytes / min(times)


def gemm_rate(M, K, N, threads):
    """FLOP/s of the best of ten float32 (M, K) @ (K, N) products, BLAS on ``threads`` threads."""
    from threadpoolctl import threadpool_limits

    x, b, out = np.ones((M, K), np.float32), np.ones((K, N), np.float32), np.empty((M, N), np.float32)
    with threadpool_limits(threads, user_api="blas"):
        np.matmul(x, b, out=out)
        times = []
        for _ in range(10):
            t = time.perf_counter()
            np.matmul(x, b, out=out)
            times.append(time.perf_counter() - t)
    return 2 * M * K * N / min(times)


def prefill_flops(cfg, T):
    """Multiply-adds x 2 of a T-token prefill: the blocks' matrices, attention, one row of the head."""
    C, L = cfg.n_embd, cfg.n_layer
    matrices = 2 * T * L * (C * 3 * C + C * C + 2 * C * 4 * C)
    attention = 2 * 2 * L * C * T * (T + 1) / 2  # scores and weighted values over the causal triangle
    return matrices + attention + 2 * cfg.vocab_size * C


def versus_float32(logits, f32) -> dict:
    """How far each row of logits is from the float32 model's for the same prompt: the largest |difference|,
    and the share of prompts with the same argmax."""
    return {"max_abs_diff_vs_float32": max(float(np.abs(a - b).max()) for a, b in zip(logits, f32)),
            "argmax_agreement_with_float32": float(np.mean([a.argmax() == b.argmax() for a, b in zip(logits, f32)]))}


# --- new processes --------------------------------------------------------------------------------------

# ru_maxrss survives execve on Linux (a child reports its parent's peak); VmHWM does not.
PEAK_RSS = """
def peak_rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
"""


def run_script(script, model_dir, *extra, env=None, peer=False):
    """The last figure a new ``python -c script model_dir *extra`` prints, in process_environment(peer)
    with ``env`` on top."""
    out = subprocess.run([sys.executable, "-c", script, str(model_dir), *extra], capture_output=True, text=True,
                         env={**process_environment(peer), **(env or {})}, timeout=900)
    if out.returncode:
        raise RuntimeError(f"benchmark subprocess failed: {out.stderr.strip().splitlines()[-1:]}")
    return float(out.stdout.split()[-1])


def process_environment(peer: bool) -> dict:
    """The environment of a process the benchmark starts: the one gpt2numba found at its import (its users'
    own); for gpt2numba's processes, with claims on CPUs off (they take turns: each pins its threads as a lone
    process would, where claims would leave all but the first unpinned)."""
    import gpt2numba

    env = dict(gpt2numba._ENVIRON_AT_IMPORT)
    if not peer:
        env["GPT2NUMBA_CLAIM_DIR"] = env.get("GPT2NUMBA_CLAIM_DIR") or "off"
        # the gpt2numba this process runs, importable there too: a checkout run without installing it (an
        # installed one is found as it is; its folder first on the path could hide the standard library)
        where = str(Path(gpt2numba.__file__).resolve().parent.parent)
        if where not in {str(Path(p).resolve()) for p in sysconfig.get_paths().values()}:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [where, env.get("PYTHONPATH")]))
    return env


# --- a shared machine: wait for quiet, and say how loud it was -----------------------------------

def _busy_jiffies():
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # (busy, total): idle and iowait excluded


class Load:
    """Share of the machine's CPU that processes other than the benchmark's used during a block."""

    def __init__(self, *pids):
        self.pids = pids

    def __enter__(self):
        self.share = None
        if os.path.exists("/proc/stat"):
            self._start = (_busy_jiffies(), self._ours())
        return self

    def __exit__(self, *exc):
        if os.path.exists("/proc/stat"):
            (busy0, total0), ours0 = self._start
            busy1, total1 = _busy_jiffies()
            ours = self._ours() - ours0
            self.share = max(0.0, (busy1 - busy0 - ours) / max(1, total1 - total0))

    def _ours(self):
        """Jiffies of CPU used by this process, its worker processes and the children it has waited for."""
        total = 0
        for pid in ("self", *self.pids):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
            if pid == "self":
                total += int(fields[13]) + int(fields[14])  # cutime, cstime: a subprocess.run's, once it ended
        return total


IDLE_PATIENCE_S = 30.0  # how long wait_for_idle waits by default: gpt2numba bench --idle-patience


def set_idle_patience(seconds: float) -> None:
    """wait_for_idle's default patience from now on, in this process (0: never wait)."""
    global IDLE_PATIENCE_S
    IDLE_PATIENCE_S = float(seconds)


def wait_for_idle(threshold=0.1, patience_s=None):
    """Wait (up to patience_s, default IDLE_PATIENCE_S) until others use under ``threshold`` of the CPU over
    half a second."""
    patience_s = IDLE_PATIENCE_S if patience_s is None else patience_s
    if not os.path.exists("/proc/stat") or patience_s <= 0:
        return
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        (b0, t0) = _busy_jiffies()
        time.sleep(0.5)
        (b1, t1) = _busy_jiffies()
        if (b1 - b0) / max(1, t1 - t0) < threshold:
            return


def in_turns(conditions, rounds):
    """(round, condition) for ``rounds`` rounds of every condition, each round in the order opposite to the
    last (A B C, C B A, ...), each after waiting for a quiet machine: how the studies take turns."""
    for r in range(rounds):
        for condition in (conditions if r % 2 == 0 else conditions[::-1]):
            wait_for_idle()
            yield r, condition


def machine():
    """What the figures were measured on: the CPU (as Linux names it), how the integer tiles multiply on it,
    whether Intel's matrix tiles (AMX) ran, and the row thresholds (defaults or `gpt2numba tune`'s)."""
    from ..cpu import amx, dispatch, inttiles

    return {"cpu": dispatch.cpu_name(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "integer_tiles": "vpdpbusd (VNNI)" if inttiles.QUADS else "pmaddwd", "amx": amx.describe(),
            "thresholds": dispatch.describe_tuning()}


# --- printing -------------------------------------------------------------------------------------------

def system_rows(row):
    return [(name, stats) for name, stats in row.items() if isinstance(stats, dict)]


def versus(row, name, peer="transformers"):
    """How many times faster than ``peer`` (its median over ours); "" for a peer's own rows."""
    if peer not in row or name.startswith("transformers"):
        return ""
    return f"{row[peer]['median_ms'] / row[name]['median_ms']:.2f}x faster"


def percent(share):
    return "-" if share is None else f"{100 * share:.0f}%"


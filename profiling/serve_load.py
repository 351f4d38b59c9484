"""Load on gpt2numba serve: N concurrent streams, tokens/s, time to first token and per output token.

    python profiling/serve_load.py [--model DIR] [--concurrency 1 4 16] [--json load.json]
    python profiling/serve_load.py --url http://127.0.0.1:8000   (a server already running)

Without --url it writes seeded random GPT-2 small to a temp dir (or takes --model),
starts `gpt2numba serve` on a free port with --max-batch of the largest N, and
stops it at the end. Each of N clients (asyncio + httpx) streams --rounds
completions one after another: a prompt of --prompt-tokens random ids, asking for
--max-tokens tokens (ignore_eos, so every request makes them all). Per level:
aggregate tokens/s (all tokens over the level's wall time), time to first token
and time per output token (after the first), p50 and p95; /health's latency while
the level runs. Before the server starts, the same decode steps in-process
(decode_step at the same context) give the floor for HTTP and JSON overhead at N = 1.
With --neighbour, every level runs again beside a busy loop (`python -c 'while True: pass'`,
nice 0) and the table gives each level's TPOT p95 beside it over its quiet value.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one)")
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--llama", action="store_true",
                   help="then the same load on llama.cpp's server (llama-cpp-python[server]) on an F32 GGUF of the "
                   "same weights")
    p.add_argument("--neighbour", action="store_true", help="then every level again beside a busy loop")
    p.add_argument("--schema", action="store_true",
                   help="then every level again with each stream under a JSON schema (guided_json; each client its "
                   "own, which no text completes within --max-tokens)")
    p.add_argument("--draft", action="append", metavar="WORD",
                   help="then every level again on a server started with these speculative decoding flags, a word "
                   "each: --draft=--draft --draft=int4, or --draft=--prompt-lookup --draft=8 (its drafted and kept "
                   "tokens from /metrics)")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args(argv)
    import httpx  # noqa: F401  (fails early without the [serve] extra)

    report = {"concurrency": {}, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        server = None
        if args.url:
            url = args.url
        else:
            model = Path(args.model) if args.model else _random_small(Path(tmp))
            report["in_process_ms"] = _in_process(model, args)
            url, server = _start(model, args, Path(tmp))
        try:
            report["concurrency"] = _levels(url, args)
            if args.neighbour:
                report["neighbour"] = _beside_busy_loop(url, args)
            if args.schema:
                report["schema"] = _levels(url, args, run=2, schema=True)
        finally:
            if server:
                server.terminate()
                server.wait(30)
        if args.draft and not args.url:
            url, server = _start(model, args, Path(tmp), args.draft)
            try:
                report["draft"] = _levels(url, args)  # (the same prompts: a new server, its prefix cache empty)
                report["draft"]["flags"] = " ".join(args.draft)
                report["draft"]["metrics"] = _spec_counts(url)
            finally:
                server.terminate()
                server.wait(30)
        if args.llama and not args.url:
            report["llama_cpp"] = _llama_levels(model, args, Path(tmp))
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _random_small(tmp: Path) -> Path:
    import gpt2numba as g

    path = tmp / "gpt2-small-random"
    g.save_weights(g.random_weights(g.GPT2Config.small(), seed=0), path)
    return path


def _in_process(model: Path, args) -> dict:
    """The requests' work in a new process (its threads gone after): the median decode_step ms at their
    contexts, and the median ms of a whole request (prefill, then max_tokens - 1 decode steps)."""
    script = f"""
import time, numpy as np, gpt2numba as g
g.set_threads({args.threads})
w = g.load_weights({str(model)!r}); mc = g.ModelCache(w.config)
steps, whole = [], []
for seed in range(4):
    ids = np.random.default_rng(seed).integers(0, w.config.vocab_size, {args.prompt_tokens})
    t0 = time.perf_counter(); mc.reset()
    token = int(g.prefill(ids, w, mc).argmax())
    for _ in range({args.max_tokens - 1}):
        t = time.perf_counter(); token = int(g.decode_step(token, w, mc).argmax()); steps.append(time.perf_counter() - t)
    whole.append(time.perf_counter() - t0)
print(1e3 * float(np.median(steps)), 1e3 * float(np.median(whole[1:])))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    step_ms, request_ms = map(float, out.stdout.split()[-2:])
    return {"decode_step_ms": step_ms, "request_ms": request_ms}


def _start(model: Path, args, tmp: Path, extra=()):
    port = _free_port()
    log = (tmp / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "gpt2numba", "serve", "--model", str(model), "--port", str(port),
                               "--threads", str(args.threads), "--max-batch", str(max(args.concurrency)), *extra],
                              stdout=log, stderr=subprocess.STDOUT)
    return _wait(server, f"http://127.0.0.1:{port}", "/health", tmp / "server.log"), server


def _levels(url: str, args, alive: str = "/health", run: int = 0, schema: bool = False) -> dict:
    """Every --concurrency level against the server at url; ``alive``: the path polled meanwhile. Each
    ``run`` draws its own prompts: a run that repeated another's would find them in the server's prefix cache."""
    return {n: asyncio.run(_level(url, n, args, alive, run, schema)) for n in args.concurrency}


def _schema(client: int) -> dict:
    """Client ``client``'s JSON schema: records of a few fields, more of them than a stream's tokens can write."""
    record = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8 + client},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c"]}},
              "required": ["name", "n", "ok", "kind"], "additionalProperties": False}
    return {"type": "array", "items": record, "minItems": 100}


def _beside_busy_loop(url: str, args) -> dict:
    """The levels again while a plain Python busy loop holds a core (issue: a busy machine)."""
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        return _levels(url, args, run=1)
    finally:
        loop.kill()
        loop.wait()


def _llama_levels(model: Path, args, tmp: Path) -> dict:
    """The same levels against llama.cpp's OpenAI-compatible server (python -m llama_cpp.server)."""
    import gpt2numba as g
    from gpt2numba.integrations.gguf_export import write_gguf

    gguf = write_gguf(g.load_weights(model), tmp / "model-f32.gguf", "F32")
    port = _free_port()
    log = (tmp / "llama-server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                               "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch",
                               str(args.threads), "--n_ctx", "1024", "--interrupt_requests", "False"],
                              stdout=log, stderr=subprocess.STDOUT)  # (by default a new request cuts the stream in flight)
    try:
        url = _wait(server, f"http://127.0.0.1:{port}", "/v1/models", tmp / "llama-server.log")
        import llama_cpp

        return {"version": f"llama-cpp-python {llama_cpp.__version__}",
                "concurrency": _levels(url, args, alive="/v1/models")}
    finally:
        server.terminate()
        server.wait(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(server, url: str, path: str, log: Path) -> str:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server stopped: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}{path}", timeout=1).status_code == 200:
                return url
        except httpx.TransportError:
            time.sleep(0.2)
    server.terminate()
    raise SystemExit("the server did not start in 300 s")


def _prompts(rng, count: int, args) -> list[str]:
    """Texts of --prompt-tokens random GPT-2 ids each (text, so that any server takes them; they
    re-encode to about as many tokens)."""
    from gpt2numba.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    return [tokenizer.decode(ids) for ids in rng.integers(0, tokenizer.eot_id, (count, args.prompt_tokens))]


async def _level(url: str, n: int, args, alive: str, run: int, schema: bool = False) -> dict:
    import httpx

    rng = np.random.default_rng([run, n])
    limits = httpx.Limits(max_connections=n + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await _stream(client, _prompts(rng, 1, args)[0], 4)  # warm-up
        stop = asyncio.Event()
        health = asyncio.create_task(_poll_health(client, stop, alive))
        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(_client(client, _prompts(rng, args.rounds, args), args.max_tokens,
                                                    _schema(k) if schema else None) for k in range(n)))
        wall = time.perf_counter() - t0
        stop.set()
        health_s = await health
        whole = []  # at N = 1, whole requests too: what HTTP costs without a chunk per token
        for prompt in (_prompts(rng, 3, args) if n == 1 else []):
            t = time.perf_counter()
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            (await client.post("/v1/completions", json=body)).raise_for_status()
            whole.append(time.perf_counter() - t)
    requests = [r for rs in per_client for r in rs]
    ttft = [r["ttft_s"] for r in requests]
    tpot = [r["tpot_s"] for r in requests]
    tokens = sum(r["tokens"] for r in requests)
    return {"requests": len(requests), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_ms": _percentiles(ttft), "tpot_ms": _percentiles(tpot), "health_ms": _percentiles(health_s),
            **({"whole_request_ms": _percentiles(whole)} if whole else {})}


def _spec_counts(url: str) -> dict:
    """The speculative decoding counters of the server's /metrics: tokens drafted and kept."""
    import httpx

    counts = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        for name in ("draft", "accepted"):
            if line.startswith(f"gpt2numba_spec_decode_num_{name}_tokens_total "):
                counts[name] = float(line.split()[-1])
    return counts


async def _client(client, prompts, max_tokens, schema=None):
    return [await _stream(client, prompt, max_tokens, schema) for prompt in prompts]


async def _stream(client, prompt: str, max_tokens, schema=None) -> dict:
    """One streamed completion: when each token's chunk came (a server without ignore_eos may stop early)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            **({"guided_json": schema} if schema else {})}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                    times.append(time.perf_counter())
    if not times:
        raise RuntimeError(f"asked for {max_tokens} tokens, got no chunk")
    return {"tokens": len(times), "ttft_s": times[0] - t0,
            "tpot_s": (times[-1] - times[0]) / max(1, len(times) - 1)}


async def _poll_health(client, stop, path) -> list[float]:
    seconds = []
    while not stop.is_set():
        t = time.perf_counter()
        (await client.get(path)).raise_for_status()
        seconds.append(time.perf_counter() - t)
        await asyncio.sleep(0.05)
    return seconds


def _percentiles(seconds) -> dict:
    ms = 1e3 * np.asarray(seconds)
    return {"p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95)), "max": float(ms.max())}


def _print(r):
    print(f"\ngpt2numba serve under load: streams of {r['prompt_tokens']}-token prompts (as text) asking for "
          f"{r['max_tokens']} tokens, {r['rounds']} per client; {r['threads']} threads; cpus {os.cpu_count()}")
    _table(r["concurrency"])
    levels = r["concurrency"]
    if "in_process_ms" in r and 1 in levels:
        ours, one = r["in_process_ms"], levels[1]
        http = one["tpot_ms"]["p50"]
        print(f"N = 1, streamed: {http:.2f} ms per output token over HTTP against {ours['decode_step_ms']:.2f} ms "
              f"for decode_step in-process: {100 * (http / ours['decode_step_ms'] - 1):+.1f}% (a chunk per token, "
              f"the client on the same cores)")
        whole = one["whole_request_ms"]["p50"]
        print(f"N = 1, not streamed: {whole:.0f} ms a request over HTTP against {ours['request_ms']:.0f} ms for "
              f"the same prefill and decode steps in-process: {100 * (whole / ours['request_ms'] - 1):+.1f}%")
    if "neighbour" in r:
        print("\nthe same beside a busy loop (nice 0):")
        _table(r["neighbour"])
        print("TPOT p95 beside it over quiet: " + ", ".join(
            f"N={n} {o['tpot_ms']['p95'] / levels[n]['tpot_ms']['p95']:.2f}x" for n, o in r["neighbour"].items()))
    if "draft" in r:
        draft = dict(r["draft"])
        flags, counts = draft.pop("flags"), draft.pop("metrics")
        print(f"\nthe same on a server with {flags} (drafted {counts.get('draft', 0):.0f} tokens, kept "
              f"{counts.get('accepted', 0):.0f}: {counts.get('accepted', 0) / max(1, counts.get('draft', 0)):.0%}):")
        _table(draft)
        print("tok/s with the draft over without: " + ", ".join(
            f"N={n} {o['tok_s'] / levels[n]['tok_s']:.2f}x" for n, o in draft.items()))
    if "schema" in r:
        print("\nthe same with every stream under a JSON schema (guided_json, each client its own):")
        _table(r["schema"])
        print("tok/s with schemas over without: " + ", ".join(
            f"N={n} {o['tok_s'] / levels[n]['tok_s']:.2f}x" for n, o in r["schema"].items()))
    if "llama_cpp" in r:
        theirs = r["llama_cpp"]
        print(f"\nllama.cpp's server ({theirs['version']}, python -m llama_cpp.server), an F32 GGUF of the same "
              f"weights, the same load (/health: its /v1/models):")
        _table(theirs["concurrency"])
        print("tok/s, gpt2numba over llama.cpp: " + ", ".join(
            f"N={n} {levels[n]['tok_s'] / o['tok_s']:.2f}x" for n, o in theirs["concurrency"].items() if n in levels))
    else:
        print("llama.cpp's server: not run (--llama, with llama-cpp-python[server] installed)")


def _table(levels):
    base = levels[min(levels)]
    print(f"{'N':>4} {'requests':>8} {'tok/s':>7} {'vs N=1':>7} {'TTFT p50':>9} {'p95':>7} {'TPOT p50':>9} "
          f"{'p95':>6} {'vs N=1':>7} {'/health p50':>11} {'max':>6}  (ms)")
    for n, o in levels.items():
        print(f"{n:>4} {o['requests']:>8} {o['tok_s']:>7.1f} {o['tok_s'] / base['tok_s']:>6.2f}x "
              f"{o['ttft_ms']['p50']:>9.1f} {o['ttft_ms']['p95']:>7.1f} {o['tpot_ms']['p50']:>9.2f} "
              f"{o['tpot_ms']['p95']:>6.2f} {o['tpot_ms']['p95'] / base['tpot_ms']['p95']:>6.2f}x "
              f"{o['health_ms']['p50']:>11.1f} {o['health_ms']['max']:>6.1f}")


if __name__ == "__main__":
    sys.exit(main())

"""The prefix cache in gpt2numba serve: requests that share a long beginning, with the cache on and off.

    python profiling/studies/serve_prefix.py [--model DIR] [--requests 200] [--json prefix.json]

Starts `gpt2numba serve` on seeded random GPT-2 small (or --model) twice, with --prefix-cache-mb 0 and
with --cache-mb, and sends each the same --requests requests from --clients clients at once: a
--prefix-tokens prefix of random ids shared by all, then --ending-tokens ids of each request's own,
asking for --max-tokens greedy tokens. Per server: requests/s, the median request time, and the
server's resident memory after start-up and at its peak (VmHWM), whose difference the prefix cache's
bound plus the batch's caches should cover. Issue 19's target: >= 3x the requests/s with the cache on.

Then, on the server with the cache, n choices of one prompt (its prefill shared by them): the time to
first token of a streamed request with n = --n against n = 1, on --n-prompt-tokens prompts asking for
--n-max-tokens tokens, alternating, --n-repeat times each, every prompt new (no cached prefix), or with
--n-cached sent once before (one token asked), so that its blocks are in the prefix cache.
Issue 19's target: n = 8 within 1.3x of n = 1; issue 44's, the same with --n-cached (the n choices read the
cached blocks and the first choice's rows in place, where they were copied).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # profiling/, for serve_load
from serve_load import _free_port, _random_small, _wait  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=400)
    p.add_argument("--ending-tokens", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--cache-mb", type=int, default=256, help="--prefix-cache-mb of the server with the cache on")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--n-prompt-tokens", type=int, default=512)
    p.add_argument("--n-max-tokens", type=int, default=32)
    p.add_argument("--n-repeat", type=int, default=3)
    p.add_argument("--n-cached", action="store_true", help="send each n-choices prompt once before it is timed")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 50256, args.prefix_tokens).tolist()
    prompts = [prefix + rng.integers(0, 50256, args.ending_tokens).tolist() for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else _random_small(Path(tmp))
        runs = {mb: _one_server(model, mb, prompts, args, Path(tmp)) for mb in (0, args.cache_mb)}
    n_ttft = runs[args.cache_mb].pop("n_ttft_s")
    report = {"requests": args.requests, "clients": args.clients, "prefix_tokens": args.prefix_tokens,
              "ending_tokens": args.ending_tokens, "max_tokens": args.max_tokens, "threads": args.threads,
              "off": runs[0], "on": runs[args.cache_mb], "cache_mb": args.cache_mb,
              "speedup": runs[args.cache_mb]["requests_s"] / runs[0]["requests_s"], "n": args.n,
              "n_prompt_tokens": args.n_prompt_tokens, "n_max_tokens": args.n_max_tokens, "n_ttft_s": n_ttft,
              "n_cached": args.n_cached,
              "n_ttft_ratio": float(np.median(n_ttft[str(args.n)]) / np.median(n_ttft["1"]))}
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _one_server(model: Path, mb: int, prompts: list[list[int]], args, tmp: Path) -> dict:
    port = _free_port()
    log = (tmp / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "gpt2numba", "serve", "--model", str(model), "--port", str(port),
                               "--threads", str(args.threads), "--max-batch", str(args.clients),
                               "--prefix-cache-mb", str(mb)], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = _wait(server, f"http://127.0.0.1:{port}", "/health", tmp / "server.log")
        started_mb = _rss_mb(server.pid, "VmRSS")
        seconds, wall = asyncio.run(_send(url, prompts, args))
        run = {"requests_s": len(prompts) / wall, "wall_s": wall, "request_ms_p50": 1e3 * float(np.median(seconds)),
               "rss_started_mb": started_mb, "rss_peak_mb": _rss_mb(server.pid, "VmHWM")}
        if mb:
            run["n_ttft_s"] = asyncio.run(_n_choices(url, args))
        return run
    finally:
        server.terminate()
        server.wait(30)


async def _send(url: str, prompts: list[list[int]], args) -> tuple[list[float], float]:
    """Every prompt, --clients at a time; (each request's seconds, the wall time of all)."""
    import httpx

    queue = list(reversed(prompts))
    seconds = []

    async def client_loop(client):
        while queue:
            body = {"prompt": queue.pop(), "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            t = time.perf_counter()
            (await client.post("/v1/completions", json=body)).raise_for_status()
            seconds.append(time.perf_counter() - t)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=args.clients)) as c:
        await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for _ in range(args.clients)))
        return seconds, time.perf_counter() - t0


async def _n_choices(url: str, args) -> dict:
    """Time to first token with n = 1 and n = --n, alternating: {"1": [s, ...], "n": [s, ...]}."""
    import httpx

    rng = np.random.default_rng(1)
    times = {"1": [], str(args.n): []}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(args.n_repeat):
            for n in (1, args.n):
                body = {"prompt": rng.integers(0, 50256, args.n_prompt_tokens).tolist(), "n": n, "stream": True,
                        "max_tokens": args.n_max_tokens, "temperature": 1.0, "ignore_eos": True}
                if args.n_cached:
                    (await client.post("/v1/completions", json={**body, "n": 1, "stream": False,
                                                                 "max_tokens": 1})).raise_for_status()
                t0 = time.perf_counter()
                first = None
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter() - t0
                times[str(n)].append(first)
    return times


def _rss_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _print(r) -> None:
    print(f"\n{r['requests']} requests from {r['clients']} clients: a shared {r['prefix_tokens']}-token prefix, "
          f"{r['ending_tokens']} tokens of their own, {r['max_tokens']} greedy tokens out; {r['threads']} threads")
    print(f"{'prefix cache':>14} {'requests/s':>11} {'request p50':>12} {'RSS started':>12} {'RSS peak':>9}")
    for name, mb in (("off", 0), ("on", r["cache_mb"])):
        row = r[name]
        print(f"{f'{mb} MB':>14} {row['requests_s']:>11.2f} {row['request_ms_p50']:>10.0f}ms "
              f"{row['rss_started_mb']:>10.0f}MB {row['rss_peak_mb']:>7.0f}MB")
    print(f"with the cache: {r['speedup']:.2f}x the requests/s")
    t = r["n_ttft_s"]
    print(f"\ntime to first token, {r['n_prompt_tokens']}-token prompts{' in the prefix cache' * r['n_cached']}, "
          f"{r['n_max_tokens']} tokens: n = 1 "
          f"{np.median(t['1']):.2f} s, n = {r['n']} {np.median(t[str(r['n'])]):.2f} s (medians of {len(t['1'])}): "
          f"{r['n_ttft_ratio']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())

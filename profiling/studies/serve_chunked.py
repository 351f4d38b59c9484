"""Chunked prefill in gpt2numba serve: the pace of running streams while a long prompt is prefilled.

    python profiling/studies/serve_chunked.py [--model DIR] [--step-tokens 16 32 64 128 0] [--json chunked.json]

For each --max-step-tokens value (0: the whole prompt in one step, as without chunking) it starts
`gpt2numba serve` on seeded random GPT-2 small (or --model), starts --streams streamed requests of
--prompt-tokens ids that decode for the whole run, lets them settle, then sends one --long-tokens prompt.
Per value: the streams' time per output token before the long prompt (mean of their gaps between tokens),
their gaps while it is prefilled (from its sending to its first token: p50, p99, max), the p99 over the
mean before, and the long prompt's time to first token. Issue 19's target: that ratio <= 2.5.
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

from gpt2numba.model.config import GPT2Config
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # profiling/, for serve_load
from serve_load import _free_port, _random_small, _wait  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--step-tokens", type=int, nargs="+", default=[16, 32, 64, 128, 0],
                   help="--max-step-tokens values to try; 0: the whole prompt in one step")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64, help="each stream's prompt")
    p.add_argument("--long-tokens", type=int, default=1000, help="the prompt that arrives later")
    p.add_argument("--settle", type=int, default=16, help="tokens each stream makes before the long prompt")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else _random_small(Path(tmp))
        positions = GPT2Config.from_json(model / "config.json").n_positions
        rows = {n: _one_server(model, n or positions, positions, args, Path(tmp)) for n in args.step_tokens}
    report = {"streams": args.streams, "prompt_tokens": args.prompt_tokens, "long_tokens": args.long_tokens,
              "threads": args.threads, "step_tokens": rows}
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _one_server(model: Path, budget: int, positions: int, args, tmp: Path) -> dict:
    port = _free_port()
    log = (tmp / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "gpt2numba", "serve", "--model", str(model), "--port", str(port),
                               "--threads", str(args.threads), "--max-batch", str(args.streams + 1),
                               "--max-step-tokens", str(budget)], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = _wait(server, f"http://127.0.0.1:{port}", "/health", tmp / "server.log")
        return asyncio.run(_measure(url, positions, args))
    finally:
        server.terminate()
        server.wait(30)


async def _measure(url: str, positions: int, args) -> dict:
    import httpx

    rng = np.random.default_rng(0)
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=args.streams + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await _first_token(client, [1, 2, 3])  # warm-up
        times = [[] for _ in range(args.streams)]
        streams = [asyncio.create_task(_stream(client, rng.integers(0, 50256, args.prompt_tokens).tolist(),
                                               positions, times[i], done)) for i in range(args.streams)]
        while min(len(t) for t in times) < args.settle:
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        t1 = t0 + await _first_token(client, rng.integers(0, 50256, args.long_tokens).tolist())
        while min(t[-1] for t in times) <= t1:  # a token after it in every stream: every gap across t1 has ended
            await asyncio.sleep(0.005)
        done.set()
        await asyncio.gather(*streams)
    before = [b - a for t in times for a, b in zip(t, t[1:]) if b <= t0 and a >= t[args.settle // 2]]
    during = [b - a for t in times for a, b in zip(t, t[1:]) if t0 < b and a < t1]
    before_ms = 1e3 * float(np.mean(before))
    p99 = 1e3 * float(np.percentile(during, 99))
    return {"tpot_before_ms": before_ms, "gaps_during_ms": {
        "p50": 1e3 * float(np.percentile(during, 50)), "p99": p99, "max": 1e3 * max(during), "n": len(during)},
        "p99_over_before": p99 / before_ms, "long_ttft_s": t1 - t0}


async def _first_token(client, ids: list[int]) -> float:
    """Seconds to the first token of a streamed request for one token."""
    t0 = time.perf_counter()
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no chunk")


async def _stream(client, ids: list[int], positions: int, times: list[float], done: asyncio.Event) -> None:
    """A stream that records when each token came, until ``done`` (then it hangs up)."""
    body = {"prompt": ids, "max_tokens": positions - len(ids), "temperature": 0, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
            if done.is_set():
                return
    raise RuntimeError("a stream ended before the measurement did: ask for fewer --settle tokens")


def _print(r) -> None:
    print(f"\n{r['streams']} streams of {r['prompt_tokens']}-token prompts decoding; a {r['long_tokens']}-token "
          f"prompt arrives; {r['threads']} threads")
    print(f"{'max-step-tokens':>16} {'TPOT before':>12} {'gaps p50':>9} {'p99':>9} {'max':>9} {'p99/before':>11} "
          f"{'long TTFT':>10}")
    for n, row in r["step_tokens"].items():
        gaps = row["gaps_during_ms"]
        print(f"{n or 'whole':>16} {row['tpot_before_ms']:>10.1f}ms {gaps['p50']:>7.1f}ms {gaps['p99']:>7.1f}ms "
              f"{gaps['max']:>7.1f}ms {row['p99_over_before']:>10.2f}x {row['long_ttft_s']:>9.2f}s")


if __name__ == "__main__":
    sys.exit(main())

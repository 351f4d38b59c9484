"""gpt2numba serve against a careless or hostile client (issue 20): the figures behind each target.

    python profiling/serve_abuse.py [--model DIR] [--only sizes fairness leavers idle] [--streams 64]
                                    [--idle 1000] [--json abuse.json]

Writes seeded random GPT-2 small to a temp dir (or takes --model), starts `gpt2numba serve` on a free
port with its defaults (--max-batch 16), and measures, printing as it goes:

sizes     requests of about 1 MiB (and small ones that ask for much; echo with max_tokens 0, as lm-eval
          asks, so that only the echo is computed): status, response bytes, the
          server's peak RSS over idle, and the slowest /health answer while each runs (/health and RSS
          are polled every 50 ms throughout);
fairness  a 4-token request alone, then the same sent 1.5 s into an n=128, max_tokens=64 request;
leavers   --streams streams of max_tokens=1000 that leave after 2 events: RSS at idle, at its peak,
          and 5 s after the last one left (nothing forces a garbage collection);
idle      --idle connections that send nothing, half a head, or a head and part of a body: /health and
          a completion from a new client meanwhile, and how long until the server has closed them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serve_load import _free_port, _random_small, _wait


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="+", default=["sizes", "fairness", "leavers", "idle"])
    p.add_argument("--streams", type=int, default=64, help="leavers: streams that leave early")
    p.add_argument("--idle", type=int, default=1000, help="idle: connections that send (almost) nothing")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args(argv)
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else _random_small(Path(tmp))
        port = _free_port()
        log = Path(tmp) / "server.log"
        server = subprocess.Popen([sys.executable, "-m", "gpt2numba", "serve", "--model", str(model), "--port",
                                   str(port), "--threads", str(args.threads)], stdout=log.open("w"),
                                  stderr=subprocess.STDOUT)
        try:
            url = _wait(server, f"http://127.0.0.1:{port}", "/health", log)
            probe = Probe(url, server.pid)
            for part in args.only:
                report[part] = asyncio.run(PARTS[part](probe, args))
        finally:
            server.terminate()
            report["exit_status"] = server.wait(120)
            text = log.read_text()
            report["log"] = {"bytes": len(text), "tracebacks": text.count("Traceback")}
    print(f"\nserver exit status {report['exit_status']}; its log: {report['log']['bytes']} bytes, "
          f"{report['log']['tracebacks']} tracebacks")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


class Probe:
    """The server's RSS and /health's latency, polled every 50 ms while something runs."""

    def __init__(self, url: str, pid: int):
        self.url, self.pid = url, pid

    def rss_mb(self) -> float:
        for line in open(f"/proc/{self.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    async def during(self, work) -> tuple[object, dict]:
        """Runs the coroutine ``work``; returns its result and {rss_peak_mb, health_max_ms, health_failures}."""
        import httpx

        peak, slowest, failures, done = self.rss_mb(), 0.0, 0, asyncio.Event()

        async def poll():
            nonlocal peak, slowest, failures
            async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
                while not done.is_set():
                    t = time.perf_counter()
                    try:
                        (await client.get("/health")).raise_for_status()
                    except httpx.HTTPError:
                        failures += 1
                    slowest = max(slowest, time.perf_counter() - t)
                    peak = max(peak, self.rss_mb())
                    await asyncio.sleep(0.05)

        poller = asyncio.create_task(poll())
        try:
            result = await work
        finally:
            done.set()
            await poller
        return result, {"rss_peak_mb": peak, "health_max_ms": 1e3 * slowest, "health_failures": failures}


def _sizes_cases() -> list[tuple[str, dict | bytes]]:
    ids = list(range(1000, 2000))  # a 1000-token prompt
    return [
        ("1 MiB: 170k one-token prompts", {"prompt": [[11]] * 170_000, "max_tokens": 1}),
        ("84 KB: 14k prompts x n=128", {"prompt": [[11]] * 14_000, "n": 128, "max_tokens": 1}),
        ("1 MiB: one text prompt", {"prompt": "lorem ipsum " * 87_000, "max_tokens": 1}),
        ("1 MiB: 256 text prompts of 4 KB", {"prompt": ["lorem ipsum " * 340] * 256, "max_tokens": 1}),
        ("1 MiB: nesting", b"[" * 2**19 + b"]" * 2**19),
        ("2 KB: echo logprobs=20 n=128 x 1000 tokens", {"prompt": ids, "n": 128, "max_tokens": 0, "echo": True,
                                                        "logprobs": 20}),
        ("8 KB: the same, 8 prompts", {"prompt": [ids] * 8, "n": 128, "max_tokens": 0, "echo": True,
                                       "logprobs": 20}),
        ("largest allowed echo: n=78 x 1000 tokens", {"prompt": ids, "n": 78, "max_tokens": 0, "echo": True,
                                                      "logprobs": 20}),
    ]


async def sizes(probe: Probe, args) -> dict:
    import httpx

    out = {}
    async with httpx.AsyncClient(base_url=probe.url, timeout=1200) as client:
        (await client.post("/v1/completions", json={"prompt": "warm", "max_tokens": 2})).raise_for_status()
        await asyncio.sleep(1)
        idle = probe.rss_mb()
        print(f"\nsizes: the server idle at {idle:.0f} MB RSS")
        print(f"{'request':<46} {'body':>8} {'status':>6} {'response':>10} {'s':>6} {'RSS +MB':>8} "
              f"{'/health max ms':>15}")
        for name, body in _sizes_cases():
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            t = time.perf_counter()
            r, seen = await probe.during(client.post("/v1/completions", content=content,
                                                     headers={"Content-Type": "application/json"}))
            seconds = time.perf_counter() - t
            row = {"body_bytes": len(content), "status": r.status_code, "response_bytes": len(r.content),
                   "seconds": seconds, "rss_growth_mb": seen["rss_peak_mb"] - idle, **seen}
            if r.status_code != 200:
                row["message"] = r.json()["error"]["message"][:160]
            out[name] = row
            print(f"{name:<46} {len(content):>8} {r.status_code:>6} {len(r.content):>10} {seconds:>6.1f} "
                  f"{row['rss_growth_mb']:>8.0f} {seen['health_max_ms']:>15.0f}"
                  + (f"  {row['message'][:90]}" if "message" in row else ""))
            del r
            await asyncio.sleep(1)
        out["idle_after_mb"] = probe.rss_mb()
        print(f"RSS after them: {out['idle_after_mb']:.0f} MB (idle before: {idle:.0f})")
    return out


async def fairness(probe: Probe, args) -> dict:
    import httpx

    small = {"prompt": "The small request", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    large = {"prompt": "The large request", "n": 128, "max_tokens": 64, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=probe.url, timeout=1200) as client:
        alone = []
        for _ in range(3):
            t = time.perf_counter()
            (await client.post("/v1/completions", json=small)).raise_for_status()
            alone.append(time.perf_counter() - t)
        big = asyncio.create_task(client.post("/v1/completions", json=large))
        t_big = time.perf_counter()
        await asyncio.sleep(1.5)
        t = time.perf_counter()
        (await client.post("/v1/completions", json=small)).raise_for_status()
        beside = time.perf_counter() - t
        (await big).raise_for_status()
        big_s = time.perf_counter() - t_big
    best = min(alone)
    print(f"\nfairness: a 4-token request alone {best:.2f} s (best of 3); sent 1.5 s into an n=128, "
          f"max_tokens=64 request ({big_s:.1f} s): {beside:.2f} s, {beside / best:.1f}x alone")
    return {"alone_s": alone, "beside_s": beside, "ratio": beside / best, "large_s": big_s}


async def leavers(probe: Probe, args) -> dict:
    import httpx

    body = {"prompt": "Leave early", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(base_url=probe.url, timeout=1200, limits=limits) as client:
        (await client.post("/v1/completions", json={"prompt": "warm", "max_tokens": 2})).raise_for_status()
        await asyncio.sleep(1)
        idle = probe.rss_mb()

        async def leave():
            async with client.stream("POST", "/v1/completions", json=body) as r:
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: {")
                    if events == 2:
                        return

        _, seen = await probe.during(asyncio.gather(*(leave() for _ in range(args.streams))))
        left = time.perf_counter()
        after = []
        while time.perf_counter() - left < 5:
            await asyncio.sleep(0.25)
            after.append(probe.rss_mb())
        health = (await client.get("/health")).json()
    print(f"\nleavers: {args.streams} streams of max_tokens=1000 that left after 2 events: RSS idle {idle:.0f} MB, "
          f"peak {seen['rss_peak_mb']:.0f} MB, 5 s after the last left {after[-1]:.0f} MB "
          f"({after[-1] - idle:+.0f} MB); /health then {health}")
    return {"idle_mb": idle, **seen, "after_5s_mb": after[-1], "growth_mb": after[-1] - idle, "health": health}


async def idle(probe: Probe, args) -> dict:
    import httpx

    host, port = probe.url.removeprefix("http://").split(":")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sends = [b"", head, head + b"Content-Length: 1000\r\n\r\n{\"prompt"]
    sockets = []
    t0 = time.perf_counter()
    for i in range(args.idle):
        s = socket.create_connection((host, int(port)))
        s.sendall(sends[i % 3])
        s.setblocking(False)
        sockets.append(s)
    async with httpx.AsyncClient(base_url=probe.url, timeout=60) as client:
        t = time.perf_counter()
        health = (await client.get("/health")).status_code
        health_s = time.perf_counter() - t
        t = time.perf_counter()
        completion = (await client.post("/v1/completions", json={"prompt": "Still here", "max_tokens": 8})).status_code
        completion_s = time.perf_counter() - t
    open_ = set(range(len(sockets)))
    while open_ and time.perf_counter() - t0 < 120:
        for i in list(open_):
            try:
                if sockets[i].recv(4096) == b"":
                    open_.discard(i)
            except BlockingIOError:
                pass
            except ConnectionResetError:
                open_.discard(i)
        await asyncio.sleep(0.1)
    closed_s = time.perf_counter() - t0
    for s in sockets:
        s.close()
    print(f"\nidle: {args.idle} connections (nothing, half a head, a head and part of a body): /health {health} in "
          f"{health_s:.2f} s, a completion {completion} in {completion_s:.2f} s; all closed by the server "
          f"{closed_s:.1f} s after the first opened ({len(open_)} still open)")
    return {"connections": args.idle, "health": health, "health_s": health_s, "completion": completion,
            "completion_s": completion_s, "all_closed_after_s": closed_s, "still_open": len(open_)}


PARTS = {"sizes": sizes, "fairness": fairness, "leavers": leavers, "idle": idle}


if __name__ == "__main__":
    sys.exit(main())

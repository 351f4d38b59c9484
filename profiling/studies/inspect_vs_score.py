"""POST /v1/inspect against score() in-process on the same text of --tokens tokens (issue 42's target: within 1.5x).

    python profiling/studies/inspect_vs_score.py [--model DIR] [--tokens 1000] [--repeat 5] [--threads 2] [--json out.json]

Starts `gpt2numba serve` on seeded random GPT-2 small (or --model) and times, in turn, --repeat times each:
/v1/inspect of the text with the default 5 alternatives and with 20 (the whole request, as a client sees it:
HTTP, the tokenizer, the forward pass with its head on the engine thread, the JSON), score() of
<|endoftext|> + the same ids in this process (the fused log-softmax head: no logits kept), and
tokenview.inspect_ids in this process (the inspection without HTTP and JSON). Prints each one's median and its
ratio to score's. The server and this process never compute at the same time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # profiling/, for serve_load
from serve_load import _free_port, _random_small, _wait  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, help="write every time here")
    args = p.parse_args(argv)

    import httpx

    import gpt2numba as g
    from gpt2numba.text.tokenview import inspect_ids

    g.set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else _random_small(Path(tmp))
        w, tokenizer = g.load_weights(model), g.load_tokenizer(model)
        text, ids = _text(tokenizer, args.tokens)
        port, log = _free_port(), Path(tmp) / "server.log"
        server = subprocess.Popen([sys.executable, "-m", "gpt2numba", "serve", "--model", str(model), "--port",
                                   str(port), "--threads", str(args.threads)],
                                  stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            url = _wait(server, f"http://127.0.0.1:{port}", "/health", log)
            with httpx.Client(base_url=url, timeout=600) as client:
                def inspect(k):
                    r = client.post("/v1/inspect", json={"text": text, "top_logprobs": k})
                    r.raise_for_status()
                    assert len(r.json()["tokens"]) == len(ids)

                runs = {"inspect_http_top5": lambda: inspect(5), "inspect_http_top20": lambda: inspect(20),
                        "score": lambda: g.score([tokenizer.eot_id, *ids], w),
                        "inspect_ids": lambda: inspect_ids(ids, w, tokenizer)}
                times = {name: [] for name in runs}
                for name, run in runs.items():  # a warm-up of each: compiled kernels, grown buffers
                    run()
                for _ in range(args.repeat):
                    for name, run in runs.items():
                        time.sleep(0.2)  # (the other side's threads asleep again)
                        t0 = time.perf_counter()
                        run()
                        times[name].append(time.perf_counter() - t0)
        finally:
            server.terminate()
            server.wait(60)
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    print(f"{len(ids)} tokens, {args.threads} threads, median of {args.repeat} (alternating):")
    for name, median in medians.items():
        print(f"  {name:20s} {1e3 * median:8.1f} ms   {median / medians['score']:.2f}x score   "
              f"(min {1e3 * min(times[name]):.1f}, max {1e3 * max(times[name]):.1f})")
    if args.json:
        args.json.write_text(json.dumps({"tokens": len(ids), "threads": args.threads, "seconds": times}, indent=1))
    return 0


def _text(tokenizer, tokens: int) -> tuple[str, list[int]]:
    """A text of ``tokens`` tokens: the start of this repository's docs/performance.md (text a reader
    would look at; random weights find any text as unlikely), cut where it re-encodes to as many."""
    source = (ROOT / "docs" / "performance.md").read_text()
    while len(tokenizer.encode(source)) < tokens + 8:
        source += "\n" + source
    ids = tokenizer.encode(source)
    for end in range(tokens, tokens + 8):
        text = tokenizer.decode(ids[:end])
        again = tokenizer.encode(text)
        if len(again) == tokens:
            return text, again
    raise SystemExit(f"no cut of the text re-encodes to {tokens} tokens")


if __name__ == "__main__":
    sys.exit(main())

"""What Ray adds to generation and to serving: generate_dataset against generate_batch in-process, and a Ray Serve
replica's time to first token against `gpt2numba serve`'s.

    python profiling/ray_overhead.py [--model DIR] [--threads 2] [--prompts 64] [--max-new-tokens 32] [--json F]

Starts a local Ray cluster of --threads CPUs (its start is not counted) on seeded random GPT-2 small (or --model).

generate: --prompts prompts of 8 to 24 random token ids, --max-new-tokens tokens each, seeded sampling (top_k 50):
generate_batch in this process (all of them in flight, --threads threads), and generate_dataset over the same
prompts as a Ray dataset, run by one worker of --threads threads taking them in one batch (the same cores, the
same batch), and by --threads workers of 1 thread taking a part each; timed from the call to the last row in
hand: the rows' numbering, the workers' start (a process, the weights, the kernels from Numba's cache) and Ray
Data's scheduling included. --repeat rounds, alternating; the first Ray job
(which starts Ray's worker processes) apart, and a job of one prompt and one token: what any job pays. Issue 43's
target: within 1.3x of in-process, the same tokens.

serve: `gpt2numba serve --threads --threads` and one Ray Serve replica of --threads threads (deployment(), behind
Ray Serve's HTTP proxy), both up at once; --ttft-requests streamed requests to each, alternating, one at a time,
each a new prompt of --ttft-tokens random ids asking for 8 tokens: the median time from the request to its first
token (the openai client's), and whether both answer a seeded request alike. Issue 43's target: within 1.3x.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from serve_load import _free_port, _random_small, _wait


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ttft-requests", type=int, default=20)
    p.add_argument("--ttft-tokens", type=int, default=64)
    p.add_argument("--skip", choices=["generate", "serve"], help="leave one part out")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args(argv)
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else _random_small(Path(tmp))
        t = time.perf_counter()
        ray.init(num_cpus=args.threads, include_dashboard=False, log_to_driver=False)
        report = {"threads": args.threads, "cluster_start_s": time.perf_counter() - t}
        try:
            ray.data.DataContext.get_current().enable_progress_bars = False
            if args.skip != "generate":
                report["generate"] = _generate(model, args)
            if args.skip != "serve":
                report["serve"] = _serve(model, args, Path(tmp))
        finally:
            ray.shutdown()
    _print(report, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _generate(model: Path, args) -> dict:
    import ray

    import gpt2numba as g
    from gpt2numba.integrations.distributed import generate_dataset

    g.set_threads(args.threads)
    w = g.load_weights(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50256, int(n)).tolist() for n in rng.integers(8, 25, args.prompts)]
    settings = dict(max_new_tokens=args.max_new_tokens, seed=0, top_k=50)
    list(g.generate_batch(prompts[:2], w, max_new_tokens=2))  # warm-up: the kernels from Numba's cache

    def in_process():
        tokens = [[] for _ in prompts]
        for i, token in g.generate_batch(prompts, w, **settings):
            tokens[i].append(token)
        return tokens

    def on_ray(items, workers=1, **options):
        ds = ray.data.from_items([{"prompt": ids, "id": i} for i, ids in enumerate(items)])
        rows = generate_dataset(ds, str(model), threads_per_worker=args.threads // workers, concurrency=workers,
                                batch_size=max(-(-len(items) // workers), 1), **options).take_all()
        return [list(r["completion_ids"]) for r in sorted(rows, key=lambda r: r["id"])]

    first_s, _ = _timed(lambda: on_ray(prompts, **settings))
    one_s, _ = _timed(lambda: on_ray(prompts[:1], max_new_tokens=1, seed=0))
    times = {"in_process": [], "ray": [], "ray_split": []}  # ray_split: --threads workers of 1 thread, a part each
    same = True
    for _ in range(args.repeat):
        s, here = _timed(in_process)
        times["in_process"].append(s)
        s, there = _timed(lambda: on_ray(prompts, **settings))
        times["ray"].append(s)
        s, split = _timed(lambda: on_ray(prompts, workers=args.threads, **settings))
        times["ray_split"].append(s)
        same = same and here == there == split
    medians = {k: float(np.median(v)) for k, v in times.items()}
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "max_new_tokens": args.max_new_tokens,
            "new_tokens": sum(map(len, here)), "times_s": times, "median_s": medians,
            "ratio": medians["ray"] / medians["in_process"], "ratio_split": medians["ray_split"] / medians["in_process"],
            "first_ray_job_s": first_s, "one_prompt_job_s": one_s, "same_tokens": same}


def _serve(model: Path, args, tmp: Path) -> dict:
    import openai
    from ray import serve

    from gpt2numba.serve.ray import deployment

    port = _free_port()
    log = tmp / "server.log"
    server = subprocess.Popen([sys.executable, "-m", "gpt2numba", "serve", "--model", str(model), "--port", str(port),
                               "--threads", str(args.threads)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        plain = _wait(server, f"http://127.0.0.1:{port}", "/health", log)
        ray_port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": ray_port})
        serve.run(deployment(str(model), threads=args.threads), name="gpt2numba", route_prefix="/")
        urls = {"serve": plain, "ray_serve": f"http://127.0.0.1:{ray_port}"}
        clients = {name: openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
                   for name, url in urls.items()}
        rng = np.random.default_rng(1)
        request = dict(model="m", prompt=rng.integers(0, 50256, args.ttft_tokens).tolist(), max_tokens=16,
                       seed=3, temperature=0.8, n=2)
        answers = {name: [c.text for c in client.completions.create(**request).choices]
                   for name, client in clients.items()}  # (the warm-up too)
        ttft = {name: [] for name in clients}
        for r in range(args.ttft_requests):
            prompt = rng.integers(0, 50256, args.ttft_tokens).tolist()  # new: no prefix cached
            for name in (list(clients) if r % 2 == 0 else list(clients)[::-1]):
                t = time.perf_counter()
                stream = clients[name].completions.create(model="m", prompt=prompt, max_tokens=8, stream=True)
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        ttft[name].append(time.perf_counter() - t)
                        break
                stream.close()
        serve.shutdown()
    finally:
        server.terminate()
        server.wait(60)
    medians = {name: float(np.median(v)) for name, v in ttft.items()}
    return {"prompt_tokens": args.ttft_tokens, "requests": args.ttft_requests, "ttft_s": ttft, "median_ttft_s": medians,
            "ratio": medians["ray_serve"] / medians["serve"], "same_answers": answers["serve"] == answers["ray_serve"]}


def _timed(call):
    t = time.perf_counter()
    out = call()
    return time.perf_counter() - t, out


def _print(r: dict, args) -> None:
    print(f"Ray overhead, local cluster of {r['threads']} CPUs (started in {r['cluster_start_s']:.1f} s, not counted)")
    if "generate" in r:
        x = r["generate"]
        m = x["median_s"]
        print(f"\ngenerate: {x['prompts']} prompts ({x['prompt_tokens']} tokens) x {x['max_new_tokens']} new tokens, "
              f"seeded top_k 50; {x['new_tokens']} tokens; median of {args.repeat}, alternating")
        print(f"  generate_batch in-process  {m['in_process']:6.2f} s   {x['new_tokens'] / m['in_process']:6.0f} tokens/s")
        print(f"  generate_dataset on Ray    {m['ray']:6.2f} s   {x['new_tokens'] / m['ray']:6.0f} tokens/s   "
              f"{x['ratio']:.2f}x (target <= 1.3x); 1 worker of {r['threads']} threads")
        print(f"  generate_dataset on Ray    {m['ray_split']:6.2f} s   {x['new_tokens'] / m['ray_split']:6.0f} tokens/s   "
              f"{x['ratio_split']:.2f}x; {r['threads']} workers of 1 thread, half the prompts each")
        print(f"  the same tokens in the three: {x['same_tokens']}")
        print(f"  the first Ray job {x['first_ray_job_s']:.2f} s; a job of 1 prompt x 1 token "
              f"{x['one_prompt_job_s']:.2f} s (the worker's start and Ray Data's scheduling)")
    if "serve" in r:
        x = r["serve"]
        m = x["median_ttft_s"]
        print(f"\nserve: time to first token, {x['requests']} streamed requests each of {x['prompt_tokens']} new "
              f"prompt tokens, alternating, one at a time")
        print(f"  gpt2numba serve            {1e3 * m['serve']:7.1f} ms")
        print(f"  Ray Serve, 1 replica       {1e3 * m['ray_serve']:7.1f} ms   {x['ratio']:.2f}x (target <= 1.3x); "
              f"a seeded request's answers alike: {x['same_answers']}")


if __name__ == "__main__":
    sys.exit(main())

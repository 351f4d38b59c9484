"""A multiple-choice lm-eval task with and without prefix sharing: the time, and the numbers per sample.

    python profiling/studies/shared_prefix.py [--docs 100] [--context 150 250] [--endings 5 20] [--choices 4]
                                      [--threads 2] [--model DIR] [--score-batch] [--json out.json]

Writes a local task (seeded random words: a context of --context tokens and --choices endings of
--endings tokens each, GPT-2's BPE) and runs it through lm_eval.simple_evaluate with the gpt2numba
model, share_prefix=True and then False, one run each after a warm-up (an evaluation of 2 documents),
on seeded random GPT-2 small (or --model). Prints each run's wall time and the time inside the model's
loglikelihood, the speed-up, and how far the two runs' log-likelihoods and is_greedy are apart, sample
by sample.
With --score-batch, also score_batch over the same sequences (context + ending), shared or not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task is local: nothing to look up on the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def words(tokenizer) -> list[str]:
    """Words that are one token each with a space before them (" the", " house"): lengths come out exact."""
    found = []
    for token in range(256, 20000):
        text = tokenizer.decode([token])
        if len(text) > 3 and text[0] == " " and text[1:].isalpha() and text[1:].islower() \
                and tokenizer.encode(text) == [token]:
            found.append(text)
    return found


def write_task(root: Path, tokenizer, args) -> list[dict]:
    """The task's documents as JSON lines and its YAML, under root; returns the documents."""
    rng = np.random.default_rng(0)
    vocab = words(tokenizer)

    def text(low, high):
        return "".join(rng.choice(vocab, int(rng.integers(low, high + 1))))

    docs = [{"context": text(*args.context).lstrip(), "choices": [text(*args.endings).lstrip()
                                                                  for _ in range(args.choices)],
             "answer": int(rng.integers(args.choices))} for _ in range(args.docs)]
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "shared_mc.yaml").write_text(
        f"task: shared_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    return docs


def evaluate(lm, tasks, limit: int | None = None) -> tuple[float, float, dict]:
    """(wall seconds, seconds inside the model's _loglikelihood_tokens, {(doc, choice): (logprob, greedy)})."""
    import lm_eval

    inside = [0.0]
    real = lm._loglikelihood_tokens

    def timed(requests, *a, **k):
        t = time.perf_counter()
        out = real(requests, *a, **k)
        inside[0] += time.perf_counter() - t
        return out
    lm._loglikelihood_tokens = timed
    t = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=["shared_mc"], task_manager=tasks,
                                  log_samples=True, verbosity="ERROR", limit=limit)
    lm._loglikelihood_tokens = real
    wall = time.perf_counter() - t
    samples = {(s["doc_id"], j): (float(r[0][0]), bool(r[0][1]))
               for s in out["samples"]["shared_mc"] for j, r in enumerate(s["resps"])}
    return wall, inside[0], samples


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--context", type=int, nargs=2, default=[150, 250], metavar=("LOW", "HIGH"))
    parser.add_argument("--endings", type=int, nargs=2, default=[5, 20], metavar=("LOW", "HIGH"))
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="a checkpoint directory (default: seeded random GPT-2 small)")
    parser.add_argument("--score-batch", action="store_true", help="also score_batch of the same sequences")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)

    import gpt2numba as g
    from gpt2numba.harness import GPT2NumbaLM

    lms = {share: GPT2NumbaLM(model=args.model, threads=args.threads, share_prefix=share) for share in (True, False)}
    tokenizer = lms[True].tokenizer
    report: dict = {"docs": args.docs, "choices": args.choices, "context": args.context, "endings": args.endings,
                    "threads": args.threads, "model": lms[True].source}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        docs = write_task(root, tokenizer, args)
        lengths = [len(tokenizer.encode(d["context"])) for d in docs]
        print(f"{args.docs} documents, contexts of {min(lengths)}-{max(lengths)} tokens, {args.choices} endings of "
              f"{args.endings[0]}-{args.endings[1]} tokens; {lms[True].source}, {args.threads} threads")
        # lm-eval's index of the local task, built once (its own ~10,000 tasks left out: indexing them takes
        # longer than the model's work here), then a warm-up: Numba's cache loads on the first call, and
        # lm-eval builds the dataset on its first evaluation; neither belongs to the run that goes first
        from lm_eval.tasks import TaskManager

        tasks = TaskManager(include_path=str(root), include_defaults=False)
        evaluate(lms[True], tasks, limit=2)
        runs = {share: evaluate(lms[share], tasks) for share in (True, False)}
    (wall_on, model_on, on), (wall_off, model_off, off) = runs[True], runs[False]
    diff = max(abs(on[key][0] - off[key][0]) for key in off)
    report.update(with_sharing={"wall_s": wall_on, "model_s": model_on},
                  without_sharing={"wall_s": wall_off, "model_s": model_off},
                  speedup_wall=wall_off / wall_on, speedup_model=model_off / model_on,
                  max_abs_logprob_diff=diff, greedy_differ=sum(on[key][1] != off[key][1] for key in off),
                  samples=len(off))
    print(f"lm-eval, with prefix sharing:    {wall_on:7.1f} s ({model_on:.1f} s in the model)")
    print(f"lm-eval, without prefix sharing: {wall_off:7.1f} s ({model_off:.1f} s in the model)")
    print(f"speed-up: {wall_off / wall_on:.2f}x wall, {model_off / model_on:.2f}x in the model; "
          f"{len(off)} samples, max |logprob difference| {diff:.2e}, is_greedy differs in "
          f"{report['greedy_differ']}")
    if args.score_batch:
        w = lms[True].w
        seqs = [tokenizer.encode(d["context"] + " " + choice) for d in docs for choice in d["choices"]]
        seconds = {}
        for share in (True, False):
            t = time.perf_counter()
            scores = g.score_batch(seqs, w, share=share)
            seconds[share] = time.perf_counter() - t
            if share:
                shared = scores
        gap = max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(shared, scores))
        report["score_batch"] = {"with_sharing_s": seconds[True], "without_sharing_s": seconds[False],
                                 "speedup": seconds[False] / seconds[True], "max_abs_logprob_diff": gap}
        print(f"score_batch of the {len(seqs)} sequences: {seconds[True]:.1f} s shared, {seconds[False]:.1f} s not: "
              f"{seconds[False] / seconds[True]:.2f}x; max |logprob difference| {gap:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    sys.exit(main() and None)

"""CTranslate2 beside gpt2numba (gpt2numba bench --ct2): the same weights, converted, side by side.

The weights are saved as a transformers GPT2LMHeadModel checkpoint and converted with
ctranslate2.converters.TransformersConverter, to float32 and to int8_float32 (int8
matrices, float32 arithmetic elsewhere), in a new process (torch stays out of this
one). CTranslate2 takes tokens as strings: its vocabulary here is the ids written
out ("0", "1", ...), so both systems read the same ids. Before any timing, its
float32 log-probabilities must match ours (they agree to about 1e-6). Then, each
system in its own worker process, runs alternating (A B C D A B C D ...):

  generate  B = 1, 8, 32 prompts of 128 ids, 64 greedy tokens each, no end-of-text stop:
            our generate_batch against Generator.generate_batch (end_token=[], the
            prompt forwarded at once: include_prompt_in_result=False)
  beam      8 of those prompts, 4 beams, 64 tokens, no end-of-text stop: our beam_search_batch against
            Generator.generate_batch(beam_size=4, end_token=[])
  score     200 documents of 100-300 tokens: our score_batch against
            Generator.score_batch (sorted by length, batches of at most 1024 tokens,
            as many rows as our score_batch puts in one pass)

in two pairs: gpt2numba float32 / CTranslate2 float32 and gpt2numba int8 / CTranslate2
int8_float32. ctranslate2 is in the [peers] extra; its converter needs torch and
transformers (the [bench] extra).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from ..argtypes import COUNT
from .core import (Remote, alternate, dtype_name, gpt2numba_system, peer_settings, percent, print_peer_settings,
                   progress, summary)
from .peers.ct2 import system

PAIRS = (("float32", "float32"), ("int8", "int8_float32"))  # (gpt2numba dtype, CTranslate2 compute type)
LIBRARIES = ("ctranslate2", "torch", "transformers")
SAME_MODEL_ATOL = 1e-4  # |log p| between the float32 systems; they agree to about 1e-6
CHECK_DOCS = 8  # documents whose every log-probability is compared


def add_arguments(p) -> None:
    group = p.add_argument_group("ctranslate2", "gpt2numba bench --ct2 runs this section alone")
    group.add_argument("--ct2", action="store_true",
                       help="CTranslate2 on the same weights instead of the above (the [peers] and [bench] extras)")
    group.add_argument("--ct2-batch-sizes", type=COUNT, nargs="+", default=[1, 8, 32], help="prompts per generate")
    group.add_argument("--ct2-prompt", type=COUNT, default=128, help="ids per prompt")
    group.add_argument("--ct2-tokens", type=COUNT, default=64, help="greedy tokens per prompt")
    group.add_argument("--ct2-beams", type=COUNT, default=4, help="beam search's beams")
    group.add_argument("--ct2-beam-prompts", type=COUNT, default=8, help="prompts per beam search")
    group.add_argument("--ct2-docs", type=COUNT, default=200, help="documents to score")
    group.add_argument("--ct2-doc-tokens", type=COUNT, nargs=2, default=[100, 300], metavar=("LOW", "HIGH"),
                       help="their lengths, uniform in [LOW, HIGH]")
    group.add_argument("--ct2-repeat", type=COUNT, default=3, help="timed runs per system and workload (median)")


def missing() -> list[str]:
    """The libraries of LIBRARIES that are not installed."""
    return [name for name in LIBRARIES if importlib.util.find_spec(name) is None]


# --- the conversion ---------------------------------------------------------------------------------------

def convert(w, out_dir, compute_types=tuple(ct for _, ct in PAIRS)) -> dict[str, str]:
    """Save ``w`` (float32 values) as a transformers checkpoint under out_dir and convert it to one
    CTranslate2 model per compute type, in a new process: {compute type: model directory}."""
    import gpt2numba as g

    source = Path(out_dir, "transformers")
    g.save_weights(w.astype("float32"), source)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_convert, str(source), str(out_dir), tuple(compute_types)).result()


def _convert(source, out_dir, compute_types):
    """Runs in the converting process: TransformersConverter with the ids as the vocabulary."""
    import transformers
    from ctranslate2.converters import TransformersConverter

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    vocab_size = transformers.AutoConfig.from_pretrained(source).vocab_size

    class Converter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return _Vocabulary(vocab_size)  # no tokenizer files needed: CTranslate2 only reads the tokens

    return {ct: Converter(source).convert(str(Path(out_dir, f"ct2-{ct}")), quantization=ct, force=True)
            for ct in compute_types}


class _Vocabulary:
    """What the converter reads of a tokenizer: token -> id, and the special tokens (GPT-2's <|endoftext|>
    is its last id; no run here stops on it)."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.bos_token = self.eos_token = self.unk_token = str(vocab_size - 1)

    def get_vocab(self):
        return {str(i): i for i in range(self.vocab_size)}


# --- gpt2numba bench --ct2 --------------------------------------------------------------------------------

def run(args, model_dir, w) -> dict:
    """The section's figures: {"ctranslate2", "same_model", "accuracy", "generate", "score"}."""
    if missing():
        raise SystemExit(f"{', '.join(missing())} not installed: pip install -e \".[peers,bench]\"")
    prompts, docs = _workload(w.config, args)
    report = {"prompt": args.ct2_prompt, "new_tokens": args.ct2_tokens, "repeat": args.ct2_repeat,
              "docs": {"documents": len(docs), "doc_tokens": list(args.ct2_doc_tokens)}}
    with tempfile.TemporaryDirectory() as tmp:
        models = convert(w, tmp)
        mine = [Remote(gpt2numba_system, dtype, model_dir, args.threads) for dtype, _ in PAIRS]
        theirs = [Remote(system, ct, models[ct], args.threads) for _, ct in PAIRS]
        systems = [s for pair in zip(mine, theirs) for s in pair]  # the pairs side by side in each turn
        try:
            report["ctranslate2"] = theirs[0].version
            report["peers"] = peer_settings(theirs)
            report["same_model"], report["accuracy"] = _accuracy(systems, docs[:CHECK_DOCS])
            if not report["same_model"] <= SAME_MODEL_ATOL:
                raise SystemExit(f"CTranslate2's float32 log-probabilities differ from ours by "
                                 f"{report['same_model']:.1e} > {SAME_MODEL_ATOL}: not the same model")
            report["generate"] = {B: _generate(systems, prompts[:B], args)
                                  for B in progress(args.ct2_batch_sizes, "ct2 generate")}
            report["beam"] = _beam(systems, prompts[: args.ct2_beam_prompts], args)
            first, times, others = alternate(systems, "score_docs", {s.name: docs for s in systems}, args.ct2_repeat)
            report["score"] = _rows(times, {name: tokens for name, (tokens, _) in first.items()}, others)
            nll = {name: np.array(nlls) for name, (_, nlls) in first.items()}
            report["score"]["max_rel_nll_diff"] = float(np.max(np.abs(nll[_CT2_F32] - nll[_OURS_F32])
                                                               / np.abs(nll[_OURS_F32])))
        finally:
            for remote in systems:
                remote.close()
    return report


_OURS_F32, _CT2_F32 = dtype_name("float32"), "CTranslate2 float32"


def _workload(cfg, args):
    """(max(batch sizes) prompts, the documents): seeded ids, the same in every process."""
    low, high = args.ct2_doc_tokens
    if args.ct2_prompt + args.ct2_tokens > cfg.n_positions:
        raise SystemExit(f"--ct2-prompt + --ct2-tokens must be <= {cfg.n_positions} (n_positions)")
    if not 2 <= low <= high <= cfg.n_positions:
        raise SystemExit(f"--ct2-doc-tokens must be 2 <= LOW <= HIGH <= {cfg.n_positions} (n_positions)")
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, cfg.vocab_size, args.ct2_prompt) for _ in range(max(args.ct2_batch_sizes))]
    return prompts, [rng.integers(0, cfg.vocab_size, n) for n in rng.integers(low, high + 1, args.ct2_docs)]


def _accuracy(systems, docs):
    """(max |log p CTranslate2 float32 - ours float32|, per compact system: max |log p - its own float32's|)
    over every scored token of ``docs``."""
    logprobs = {s.name: s.call("logprobs", docs)[1] for s in systems}

    def apart(a, b):
        return max(float(np.abs(x - y).max()) for x, y in zip(logprobs[a], logprobs[b]))

    compact = {}
    for dtype, ct in PAIRS:
        if dtype != "float32":
            compact[dtype_name(dtype)] = apart(dtype_name(dtype), _OURS_F32)
            compact[f"CTranslate2 {ct}"] = apart(f"CTranslate2 {ct}", _CT2_F32)
    return apart(_CT2_F32, _OURS_F32), {"documents": len(docs), "max_abs_logprob_diff_vs_own_float32": compact}


def _generate(systems, prompts, args):
    """One batch size: every system's seconds, tok/s, and how many sequences the float32 pair agree on."""
    job = (prompts, args.ct2_tokens)
    first, times, others = alternate(systems, "generate", {s.name: job for s in systems}, args.ct2_repeat)
    row = _rows(times, {name: len(prompts) * args.ct2_tokens for name in times}, others)
    row["sequences"] = len(prompts)
    row["same_greedy_sequences"] = sum(a == b for a, b in zip(first[_OURS_F32], first[_CT2_F32]))
    return row


def _beam(systems, prompts, args):
    """Beam search of ``prompts``: every system's seconds, and how many best hypotheses the float32 pair share."""
    job = (prompts, args.ct2_tokens, args.ct2_beams)
    first, times, others = alternate(systems, "beam", {s.name: job for s in systems}, args.ct2_repeat)
    row = _rows(times, {name: len(prompts) * args.ct2_tokens for name in times}, others)
    row.update(sequences=len(prompts), beams=args.ct2_beams,
               same_best_hypotheses=sum(a == b for a, b in zip(first[_OURS_F32], first[_CT2_F32])))
    return row


def _rows(times, tokens, others):
    """{system: summary + tokens + tok_s, "others_cpu": share} of one workload."""
    row = {"others_cpu": others}
    for name, ts in times.items():
        row[name] = {**summary(ts), "tokens": tokens[name]}
        row[name]["tok_s"] = 1e3 * tokens[name] / row[name]["median_ms"]
    return row


def print_report(r):
    print(f"\ngpt2numba bench --ct2: {r['model']}, {r['threads']} threads; against {r['ctranslate2']}")
    compact = r["accuracy"]["max_abs_logprob_diff_vs_own_float32"]
    print(f"same model: max |log p CTranslate2 float32 - gpt2numba float32| {r['same_model']:.1e} over every "
          f"token of {r['accuracy']['documents']} documents (<= {SAME_MODEL_ATOL:g}); max |log p - the same "
          "system's float32|: " + ", ".join(f"{name} {diff:.1e}" for name, diff in compact.items()))
    print(f"\n{'workload':<24} {'pair':<22} {'gpt2numba s':>11} {'tok/s':>7} {'CTranslate2 s':>13} {'tok/s':>7} "
          f"{'CT2 / ours':>10} {'others':>6}")
    d = r["docs"]
    rows = [(f"generate B={B}", row) for B, row in r["generate"].items()]
    if "beam" in r:
        rows.append((f"beam {r['beam']['beams']} x B={r['beam']['sequences']}", r["beam"]))
    rows.append((f"score {d['documents']} docs", r["score"]))
    for label, row in rows:
        for dtype, ct in PAIRS:
            ours, theirs = row[dtype_name(dtype)], row[f"CTranslate2 {ct}"]
            print(f"{label:<24} {dtype + ' / ' + ct:<22} {ours['median_ms'] / 1e3:>11.2f} {ours['tok_s']:>7.0f} "
                  f"{theirs['median_ms'] / 1e3:>13.2f} {theirs['tok_s']:>7.0f} "
                  f"{theirs['median_ms'] / ours['median_ms']:>9.2f}x {percent(row['others_cpu']):>6}")
            label = ""
        if "same_best_hypotheses" in row:
            print(f"{'':<25}float32: the same best hypothesis in {row['same_best_hypotheses']} of "
                  f"{row['sequences']} prompts")
        if "same_greedy_sequences" in row:
            print(f"{'':<25}float32: the same greedy tokens in {row['same_greedy_sequences']} of "
                  f"{row['sequences']} sequences")
    print(f"{'':<25}float32: max relative |NLL difference| per document {r['score']['max_rel_nll_diff']:.1e}")
    print(f"(medians of {r['repeat']} runs, alternating; generate: {r['prompt']}-id prompts, {r['new_tokens']} "
          f"greedy tokens each, no end-of-text stop; score: documents of {d['doc_tokens'][0]}-"
          f"{d['doc_tokens'][1]} tokens; CT2 / ours > 1: gpt2numba is faster; others: the CPU share of "
          f"processes not the benchmark's)")
    print_peer_settings(r.get("peers", {}))

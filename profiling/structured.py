"""Structured output's figures: validity on a model that knows no JSON, what a mask costs, compiling, and the
grammar libraries compared.

    python profiling/structured.py [--model DIR] [--seeds 10] [--max-new-tokens 256] [--steps 200]

On seeded random GPT-2 small (or --model), 2 threads:
- validity: 20 JSON schemas x --seeds seeds, sampled at temperature 1 as one generate_batch (16 in flight, each
  sequence its own schema), then 10 regexes alike. A "stop" text must parse with json and validate against its
  schema with jsonschema (a regex's must match in full); a "length" one must be a prefix the grammar accepts.
- cost: decode steps with a 20-field schema against none, one sequence (the gap between tokens of generate, each
  after an idle wait: the same work but the mask), and a batch of 16 with 16 different schemas against none
  (generate_batch's steps), in pairs of runs; and where a constrained step's extra time goes (the mask, its
  unpacking, gathering the allowed tokens' logits, the advance).
- compile: a 20-field schema compiled anew and from the cache.
- compare: llguidance, outlines-core and xgrammar, whichever are installed, on the 20-field schema over GPT-2's
  vocabulary: building the vocabulary, compiling, and a mask at each step of a random walk through the grammar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 24}, "active": {"type": "boolean"}}, "required": ["name", "age"],
    "additionalProperties": False}


def field_schema(fields: int = 20) -> dict:
    """A flat object of ``fields`` fields of every kind, half of them required."""
    kinds = [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0, "maximum": 1000},
             {"enum": ["red", "green", "blue"]}, {"type": "boolean"}, {"type": "number", "minimum": -5, "maximum": 5},
             {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}]
    props = {f"field{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)[::2], "additionalProperties": False}


SCHEMAS = [
    PERSON, field_schema(20), field_schema(5),
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -100, "maximum": 100}, "maxItems": 5},
    {"type": "array", "items": PERSON, "maxItems": 2},
    {"enum": ["alpha", "beta", "gamma", "delta"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}, "label": {"type": "string", "maxLength": 8}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 4}}, "required": ["tags"], "additionalProperties": False},
    {"type": "integer", "minimum": 1900, "maximum": 2100},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "string", "maxLength": 30},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100,
                                                                                  "maximum": 599}},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 6},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 20},
                                      "year": {"type": "integer", "minimum": 1000, "maximum": 2999},
                                      "rating": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["title", "year", "rating"], "additionalProperties": False},
    {"type": "boolean"},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                      "qty": {"type": "integer", "minimum": 1, "maximum": 50}},
     "required": ["id", "qty"], "additionalProperties": False},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180},
                                      "name": {"type": "string", "maxLength": 10}},
     "required": ["lat", "lon"], "additionalProperties": False},
]
REGEXES = [r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,2}",
           r"\+?[0-9]{1,3}-[0-9]{3}-[0-9]{4}", r"#[0-9a-f]{6}", r"[a-z]+@[a-z]+\.(com|org|net)",
           r"-?[0-9]+(\.[0-9]{1,3})?", r"\([0-9]{1,2}(,[0-9]{1,2}){0,3}\)", r"[A-Z]{2}[0-9]{2} [A-Z]{3}",
           r"(ab|cd|ef){2,5}!"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seeds", type=int, default=10, help="cases a schema or regex (default 10: 200 and 100)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="decode steps timed for each cost figure")
    p.add_argument("--sections", nargs="+", default=["validity", "cost", "compile", "compare"],
                   choices=["validity", "cost", "compile", "compare"])
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args(argv)
    import gpt2numba as g
    from gpt2numba.bench.core import machine

    g.set_threads(args.threads)
    report = {"machine": machine(), "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            g.save_weights(g.random_weights(g.GPT2Config.small(), seed=0), Path(tmp, "small"))
        w = g.load_weights(args.model or Path(tmp, "small"))
    tok = g.load_tokenizer(args.model)
    report["model"] = args.model or "random GPT-2 small (seed 0)"
    for section in args.sections:
        report[section] = globals()[f"_{section}"](g, w, tok, args)
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _validity(g, w, tok, args) -> dict:
    import jsonschema

    from gpt2numba.decoding.constraints import Matcher

    out = {}
    for kind, items in (("json_schema", SCHEMAS), ("regex", REGEXES)):
        each = [g.constraint(**{kind: item}) for item in items for _ in range(args.seeds)]
        prompts = [tok.encode("Output:")] * len(each)
        tokens = [[] for _ in each]
        t0 = time.perf_counter()
        for i, t in g.generate_batch(prompts, w, max_new_tokens=args.max_new_tokens, seed=0, batch_size=16,
                                     constraints=each):
            tokens[i].append(t)
        seconds = time.perf_counter() - t0
        stop = valid = prefix = 0
        for i, (ids, c) in enumerate(zip(tokens, each)):
            m = Matcher(c)
            for t in ids:
                m.advance(t)  # raises for a token outside the grammar: every cut text is an accepted prefix
            prefix += 1
            if m.done:
                stop += 1
                text = tok.decode([t for t in ids if t != tok.eot_id])
                item = items[i // args.seeds]
                if kind == "json_schema":
                    jsonschema.validate(json.loads(text), item)
                else:
                    import re

                    assert re.fullmatch(item, text, re.DOTALL), (item, text)
                valid += 1
        lengths = [len(ids) for ids in tokens]
        out[kind] = {"cases": len(each), "stop": stop, "valid": valid, "length_prefixes": prefix - stop,
                     "tokens_median": float(np.median(lengths)), "tokens_max": max(lengths), "seconds": seconds,
                     "example": tok.decode([t for t in tokens[args.seeds] if t != tok.eot_id])[:200]}
    return out


def _gaps(stamps: list[float]) -> list[float]:
    return list(np.diff(stamps)[1:])  # (after the first token: the prefill's gap, then a warm-up step)


def _cost(g, w, tok, args) -> dict:
    """Gaps between tokens with a schema and without, one sequence, then steps of 16 sequences: runs of each in
    turn, a pair of runs (one of each, the same seed) at a time, after an idle wait. The machine's own speed
    drifts between runs (a step of GPT-2 small took 10 ms for a while here, then 16), so each pair gives a
    ratio of its two medians, and the ratio reported is the median of the pairs'."""
    from gpt2numba.bench.core import wait_for_idle

    schema = field_schema(20)
    prompt = tok.encode("Record:")

    def one(seed, kind):
        stamps = [time.perf_counter() for _ in g.generate(prompt, w, max_new_tokens=24, seed=seed, stop_at_eos=False,
                                                          **kind)]
        return _gaps(stamps)

    # 16 different schemas that no sequence completes in its 24 tokens: the batch keeps its 16 rows
    schemas = [{"type": "array", "items": field_schema(5 + i), "minItems": 20} for i in range(16)]

    def batch(seed, kind):
        each = [g.constraint(json_schema=s) for s in schemas] if kind else None
        stamps, seen = [], set()
        for i, _, _, _ in _steps(g, w, [prompt] * 16, each, seed):
            if i in seen or not stamps:  # a new step begins when a sequence comes round again
                stamps.append(time.perf_counter())
                seen = set()
            seen.add(i)
        return _gaps(stamps)

    out = {}
    for name, run, pairs in (("one", one, max(2, args.steps // 20)), ("batch16", batch, max(2, args.steps // 40))):
        gaps, ratios = {"schema": [], "none": []}, []
        for seed in range(pairs):
            medians = {}
            for label, kind in (("schema", {"json_schema": schema}), ("none", {})):
                wait_for_idle()
                got = run(seed, kind)
                gaps[label] += got
                medians[label] = statistics.median(got)
            ratios.append(medians["schema"] / medians["none"])
        out[name] = {"schema_ms": statistics.median(gaps["schema"]) * 1e3,
                     "none_ms": statistics.median(gaps["none"]) * 1e3, "ratio": statistics.median(ratios),
                     "ratio_range": [min(ratios), max(ratios)], "pairs": pairs,
                     "steps": {k: len(v) for k, v in gaps.items()}}
    out["parts_us"] = _mask_parts(g, tok, schema)
    return out


def _steps(g, w, prompts, each, seed):
    from gpt2numba.decoding.sample import _batch_steps

    return _batch_steps(prompts, w, max_new_tokens=24, seed=seed, constraints=each, stop_at_eos=False)


def _mask_parts(g, tok, schema) -> dict:
    """Where a constrained step's extra time goes, in microseconds (medians over a walk through the schema)."""
    from gpt2numba.decoding.constraints import Matcher

    m = Matcher(g.constraint(json_schema=schema))
    rng = np.random.default_rng(0)
    times = {"mask": [], "unpack": [], "gather": [], "advance": []}
    z = rng.standard_normal(m.constraint.vocab_size)
    while len(times["mask"]) < 300 and not m.done:
        t0 = time.perf_counter()
        m._matcher.unsafe_compute_mask_ptr(m._bits.ctypes.data, m._bits.nbytes)
        t1 = time.perf_counter()
        allowed = np.unpackbits(m._bits.view(np.uint8), count=m.constraint.vocab_size, bitorder="little").view(bool)
        t2 = time.perf_counter()
        t3 = time.perf_counter()
        z[np.flatnonzero(allowed)]  # the Sampler's: the allowed tokens' logits, in id order
        t4 = time.perf_counter()
        token = int(rng.choice(np.flatnonzero(allowed)))
        t5 = time.perf_counter()
        m.advance(token)
        t6 = time.perf_counter()
        for name, dt in zip(times, (t1 - t0, t2 - t1, t4 - t3, t6 - t5)):
            times[name].append(dt)
    return {name: statistics.median(v) * 1e6 for name, v in times.items()}


def _compile(g, w, tok, args) -> dict:
    from gpt2numba.decoding import constraints

    schema = field_schema(20)
    g.constraint(regex="warm")  # the vocabulary's view, built once a process (its own figure below)
    fresh, cached = [], []
    for i in range(5):
        variant = dict(schema, description=f"run {i}")  # a new text: compiled anew
        t = time.perf_counter()
        g.constraint(json_schema=variant)
        fresh.append(time.perf_counter() - t)
        t = time.perf_counter()
        g.constraint(json_schema=variant)
        cached.append(time.perf_counter() - t)
    from gpt2numba.decoding.constraints import _lltokenizer

    t = time.perf_counter()
    _lltokenizer(g.load_tokenizer(), 50258)  # (a vocabulary size not seen: built anew)
    vocabulary = time.perf_counter() - t
    return {"fresh_ms": statistics.median(fresh) * 1e3, "cached_ms": statistics.median(cached) * 1e3,
            "vocabulary_ms": vocabulary * 1e3, "cache_size": constraints.CACHE_SIZE}


def _compare(g, w, tok, args) -> dict:
    """Each grammar library on the 20-field schema: vocabulary, compile, mask per step of a random walk."""
    schema = json.dumps(field_schema(20))
    enc = tok.encoding
    vocab = enc.n_vocab
    out = {}
    for name, run in (("llguidance", _llguidance), ("outlines-core", _outlines), ("xgrammar", _xgrammar)):
        try:
            out[name] = run(enc, vocab, schema)
        except ImportError as e:
            out[name] = {"missing": str(e)}
    return out


def _walk(mask_of, advance, vocab, steps=200):
    """Masks along a random walk through the grammar: (median ms of a mask, steps, allowed tokens' median)."""
    rng = np.random.default_rng(0)
    times, sizes = [], []
    for _ in range(steps):
        t = time.perf_counter()
        allowed = mask_of()
        times.append(time.perf_counter() - t)
        ids = np.flatnonzero(allowed[:vocab])
        if ids.size == 0:
            break
        sizes.append(ids.size)
        if not advance(int(rng.choice(ids))):
            break
    return {"mask_ms": statistics.median(times) * 1e3, "mask_p95_ms": float(np.percentile(times, 95)) * 1e3,
            "steps": len(times), "allowed_median": float(np.median(sizes)) if sizes else 0}


def _bits(words, vocab):
    return np.unpackbits(np.asarray(words).view(np.uint8), bitorder="little")[:vocab].astype(bool)


def _llguidance(enc, vocab, schema):
    import llguidance
    from llguidance.tiktoken import lltokenizer_from_encoding

    t = time.perf_counter()
    tokenizer = lltokenizer_from_encoding(enc, n_vocab=vocab)
    built = time.perf_counter() - t
    t = time.perf_counter()
    m = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(schema), log_level=0)
    compiled = time.perf_counter() - t
    words = np.zeros((vocab + 31) // 32, np.int32)

    def mask_of():
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        return _bits(words, vocab)

    walk = _walk(mask_of, lambda t: m.consume_token(t) and not m.is_stopped(), vocab)
    return {"version": llguidance.__version__, "vocabulary_ms": built * 1e3, "compile_ms": compiled * 1e3, **walk}


def _outlines(enc, vocab, schema):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    t = time.perf_counter()
    tokens = {}
    for i in range(vocab):
        if i != enc.eot_token:
            tokens.setdefault(enc.decode_single_token_bytes(i), []).append(i)
    vocabulary = outlines_core.Vocabulary(enc.eot_token, tokens)
    built = time.perf_counter() - t
    t = time.perf_counter()
    guide = outlines_core.Guide(outlines_core.Index(build_regex_from_schema(schema), vocabulary))
    compiled = time.perf_counter() - t
    allowed = np.zeros(vocab, bool)

    def mask_of():
        allowed[:] = False
        allowed[guide.get_tokens()] = True
        return allowed

    def advance(token):
        guide.advance(token)
        return not guide.is_finished()

    walk = _walk(mask_of, advance, vocab)
    from importlib.metadata import version

    return {"version": version("outlines_core"), "vocabulary_ms": built * 1e3, "compile_ms": compiled * 1e3, **walk}


def _xgrammar(enc, vocab, schema):
    import xgrammar

    t = time.perf_counter()
    info = xgrammar.TokenizerInfo([enc.decode_single_token_bytes(i) for i in range(vocab)],
                                  vocab_type=xgrammar.VocabType.RAW, vocab_size=vocab, stop_token_ids=[enc.eot_token])
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)
    built = time.perf_counter() - t
    t = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(schema))
    compiled = time.perf_counter() - t
    words = xgrammar.allocate_token_bitmask(1, vocab)

    def mask_of():
        matcher.fill_next_token_bitmask(words)
        return _bits(words[0].numpy(), vocab)

    walk = _walk(mask_of, lambda t: matcher.accept_token(t) and not matcher.is_terminated(), vocab)
    from importlib.metadata import version

    return {"version": version("xgrammar"), "vocabulary_ms": built * 1e3, "compile_ms": compiled * 1e3, **walk}


def _print(r) -> None:
    m = r["machine"]
    print(f"\nstructured output: {r['model']}, {r['threads']} threads; {m['cpu']}, {m['cpus']} CPUs")
    if "validity" in r:
        print(f"\n{'kind':<12} {'cases':>5} {'stop':>5} {'valid':>5} {'length (prefixes)':>17} {'tokens p50':>10} "
              f"{'max':>4} {'s':>6}")
        for kind, v in r["validity"].items():
            print(f"{kind:<12} {v['cases']:>5} {v['stop']:>5} {v['valid']:>5} {v['length_prefixes']:>17} "
                  f"{v['tokens_median']:>10.0f} {v['tokens_max']:>4} {v['seconds']:>6.1f}")
        print(f"(a schema's example: {r['validity']['json_schema']['example']!r})")
    if "cost" in r:
        c = r["cost"]
        for name, label in (("one", "one sequence"), ("batch16", "16 sequences, 16 schemas")):
            x = c[name]
            print(f"decode step, {label}: {x['schema_ms']:.2f} ms with a schema, {x['none_ms']:.2f} without "
                  f"(medians of {x['steps']['schema']} and {x['steps']['none']} steps); {x['ratio']:.3f}x, the median "
                  f"of {x['pairs']} pairs' ratios ({x['ratio_range'][0]:.3f}-{x['ratio_range'][1]:.3f})")
        parts = ", ".join(f"{k} {v:.1f}" for k, v in c["parts_us"].items())
        print(f"a constrained step's extra work (us, medians): {parts}")
    if "compile" in r:
        c = r["compile"]
        print(f"compile a 20-field schema: {c['fresh_ms']:.2f} ms anew, {c['cached_ms']:.3f} ms cached; the "
              f"vocabulary's view once a process {c['vocabulary_ms']:.0f} ms")
    if "compare" in r:
        print(f"\n{'library':<14} {'version':<8} {'vocabulary ms':>13} {'compile ms':>10} {'mask p50 ms':>11} "
              f"{'p95':>7} {'steps':>5}")
        for name, x in r["compare"].items():
            if "missing" in x:
                print(f"{name:<14} not installed ({x['missing']})")
                continue
            print(f"{name:<14} {x['version']:<8} {x['vocabulary_ms']:>13.0f} {x['compile_ms']:>10.1f} "
                  f"{x['mask_ms']:>11.3f} {x['mask_p95_ms']:>7.3f} {x['steps']:>5}")


if __name__ == "__main__":
    sys.exit(main())

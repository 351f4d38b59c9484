"""The command line, run as a user types it: a subprocess."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY, TINY_GPT2


def run(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "gpt2numba", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})}, cwd=cwd)


def test_check_on_a_checkpoint(tmp_path):
    write_dir(g.random_weights(TINY, seed=3), tmp_path)
    r = run("check", "--model", str(tmp_path), "--prompts", "2", "--prompt-len", "20", "--decode", "3")
    assert r.returncode == 0, r.stderr
    assert "2 layers" in r.stdout and "all of 2 prompts and the batch match the oracle" in r.stdout
    assert r.stdout.count(" ok;") == 3 and "batch of 2: the same prompts in one pass" in r.stdout
    from gpt2numba.cpu import amx

    tiles = "; AMX tiles off: "  # (no tile kernel yet: off on every CPU, with the reason)
    assert tiles + (amx.available() or "") in r.stdout, r.stdout


def test_check_compact_dtypes(tmp_path):
    write_dir(g.random_weights(TINY, seed=3), tmp_path)
    for dtype in ("bfloat16", "int8", "int4"):
        r = run("check", "--model", str(tmp_path), "--dtype", dtype, "--prompts", "1", "--prompt-len", "9",
                "--decode", "2")
        assert r.returncode == 0, r.stderr
        assert dtype in r.stdout and "all of 1 prompt and the batch match the oracle" in r.stdout


def test_check_default_weights_from_environment(tmp_path):
    write_dir(g.random_weights(TINY, seed=3), tmp_path)
    r = run("check", "--prompts", "1", "--prompt-len", "5", "--decode", "1", env={"GPT2NUMBA_WEIGHTS": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert str(tmp_path) in r.stdout


def test_errors_are_one_line(tmp_path):
    r = run("check", "--model", str(tmp_path / "missing"))
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr
    (tmp_path / "x.safetensors").write_text("not a checkpoint")
    r = run("check", "--model", str(tmp_path / "x.safetensors"))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "not a readable safetensors file" in r.stderr
    r = run("check", "--prompts", "0")
    assert r.returncode == 2 and "--prompts: must be at least 1" in r.stderr


def test_help():
    assert "generate" in run("--help").stdout
    assert "--prompt-len" in run("check", "--help").stdout
    assert "--top-p" in run("generate", "--help").stdout


def test_bench_takes_the_benchmarks_own_options():
    """Everything after "bench" reaches the benchmark's parser (which used to see none of it)."""
    r = run("bench", "--help")
    assert r.returncode == 0 and "--threads" in r.stdout and "--score-stride" in r.stdout
    r = run("bench", "--threads", "2", "--no-such-option")
    assert r.returncode == 2 and "gpt2numba bench: error: unrecognized arguments: --no-such-option" in r.stderr


def test_generate_streams_text_and_a_summary():
    r = run("generate", "Hello world", "--max-new-tokens", "8", "--seed", "3", "--top-k", "40")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello world") and len(r.stdout) > len("Hello world\n")
    assert "random GPT-2 small weights" in r.stderr and "2 prompt tokens, 8 new tokens" in r.stderr
    again = run("generate", "Hello world", "--max-new-tokens", "8", "--seed", "3", "--top-k", "40")
    assert again.stdout == r.stdout


def test_generate_bad_settings_are_one_line():
    for args, code, match in [(["--temperature", "-1"], 2, "--temperature: must be at least 0, got -1"),
                              (["--top-p", "2"], 2, "--top-p: must be in (0, 1], got 2"),
                              (["--max-new-tokens", "2000"], 1, "context of 1024 positions")]:
        r = run("generate", "Hi", *args)
        assert r.returncode == code and match in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_unknown_hub_model_is_one_line():
    r = run("generate", "Hi", "--model", "nobody/no-such-model", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and "Traceback" not in r.stderr and "no-such-model" in r.stderr


@pytest.mark.slow
def test_generate_a_prompts_file(tmp_path):
    """One JSON line per prompt, as it finishes; the same tokens whatever the batch size."""
    import json

    (tmp_path / "p.txt").write_text("Hello world\n\nThe meaning of life is\n{\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hello world"}\n{"prompt": "", "id": 7}\n')
    runs = [run("generate", "--prompts-file", str(tmp_path / "p.txt"), "--max-new-tokens", "4", "--seed", "1",
                "--batch-size", str(n)) for n in (1, 3)]
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert "3 prompts, 12 new tokens" in r.stderr and "tokens/s" in r.stderr
    records = [sorted((json.loads(line) for line in r.stdout.splitlines()), key=lambda x: x["index"]) for r in runs]
    assert records[0] == records[1]
    assert [x["prompt"] for x in records[0]] == ["Hello world", "The meaning of life is", "{"]
    assert all(len(x["tokens"]) == 4 and x["text"] for x in records[0])
    r = run("generate", "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "2", "--temperature", "0")
    assert r.returncode == 0 and [json.loads(line)["prompt"] for line in r.stdout.splitlines()] == ["Hello world", ""]
    r = run("generate", "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "0")
    assert r.returncode == 0 and [json.loads(line)["text"] for line in r.stdout.splitlines()] == ["", ""]


def test_bad_prompts_files_are_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "latin1.txt").write_bytes("fine\ncaf\u00e9\n".encode("latin-1"))
    for args, code, match in [
        (["--prompts-file", str(tmp_path / "bad.jsonl")], 1, "bad.jsonl, line 2: expected an object"),
        (["--prompts-file", str(tmp_path / "empty.txt")], 1, "no prompts"),
        (["--prompts-file", str(tmp_path / "missing.txt")], 1, "missing.txt"),
        (["Hi", "--prompts-file", str(tmp_path / "empty.txt")], 2, "not both"),
        (["Hi", "--batch-size", "2"], 2, "--batch-size goes with --prompts-file"),
        (["--prompts-file", str(tmp_path / "bad.jsonl"), "--slide"], 2, "--slide goes with a single PROMPT"),
        (["--prompts-file", str(tmp_path / "latin1.txt")], 1, "latin1.txt, line 2: bytes that are not UTF-8"),
    ]:
        r = run("generate", *args)
        assert r.returncode == code and match in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_score_files(tmp_path):
    """One JSON line per document, in order; the same figures as score_text in-process."""
    import json
    import math

    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog.")
    (tmp_path / "lines.txt").write_text("Hello world\n\nOnce upon a time\n")
    (tmp_path / "c.jsonl").write_text('{"text": "A cat sat."}\n{"text": "x", "id": 2}\n')
    r = run("score", str(tmp_path / "a.txt"), str(tmp_path / "c.jsonl"))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["source"].rsplit("/", 1)[-1], x["index"]) for x in rows] == [("a.txt", 0), ("c.jsonl", 0), ("c.jsonl", 1)]
    expected = g.score_text("The quick brown fox jumps over the lazy dog.", g.default_weights())
    assert rows[0]["tokens"] == expected.n_tokens and math.isclose(rows[0]["nll"], expected.nll, rel_tol=1e-6)
    assert math.isclose(rows[0]["bits_per_byte"], expected.nll / math.log(2) / 44, rel_tol=1e-6)
    assert rows[2]["tokens"] == 0 and rows[2]["perplexity"] is None  # one token: nothing to score
    assert "3 documents" in r.stderr and "tokens/s" in r.stderr
    r = run("score", "--lines", str(tmp_path / "lines.txt"), "--stride", "8", "--batch-size", "2")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["index"], x["tokens"]) for x in lines] == [(0, 1), (1, 3)]  # the blank line is no document


def test_score_reports_bad_bytes_and_keeps_what_came_before(tmp_path):
    import json

    (tmp_path / "bad.txt").write_bytes(b"good line\nanother good one\nbad \xff byte\nnever read\n")
    r = run("score", "--lines", str(tmp_path / "bad.txt"))
    assert r.returncode == 1 and "bad.txt, line 3: bytes that are not UTF-8" in r.stderr and "Traceback" not in r.stderr
    assert [json.loads(line)["index"] for line in r.stdout.splitlines()] == [0, 1]
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "score", "-", "--field", "body"], input='{"text": "a"}\n',
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and '<stdin>, line 1: no string field "body"' in r.stderr


@pytest.fixture(scope="module")
def gpt2_vocab(tmp_path_factory):
    """A tiny checkpoint with GPT-2's vocabulary (text in and out), its weights and tokenizer as the CLI loads them."""
    path = write_dir(g.random_weights(TINY_GPT2, seed=3), tmp_path_factory.mktemp("tiny_gpt2"))
    return str(path), g.load_weights(path), g.load_tokenizer(path)


def continuation(ids, tok):
    return tok.decode([t for t in ids if t != tok.eot_id])


def test_generate_beam_search_prints_the_hypotheses_of_beam_search(gpt2_vocab):
    """Each hypothesis as the prompt and its text, best first; the scores in the summary. Catches: --num-beams or
    --num-return-sequences not reaching beam_search (sampling, or one text), --length-penalty dropped (the
    scores), the hypotheses printed in another order."""
    path, w, tok = gpt2_vocab
    r = run("generate", "Hello world", "--model", path, "--num-beams", "3", "--num-return-sequences", "2",
            "--max-new-tokens", "8", "--length-penalty", "0.5")
    assert r.returncode == 0, r.stderr
    found = g.beam_search(tok.encode("Hello world"), w, num_beams=3, num_return_sequences=2, max_new_tokens=8,
                          length_penalty=0.5)
    assert len(found) == 2 and found[0].ids != found[1].ids
    assert r.stdout == "".join(f"Hello world{continuation(h.ids, tok)}\n" for h in found)
    scores = [float(x) for x in re.search(r"scores ([^;]*);", r.stderr).group(1).split(", ")]
    assert scores == pytest.approx([h.score for h in found], abs=1e-4)


def repeats_a_bigram(ids) -> bool:
    bigrams = list(zip(ids, ids[1:]))
    return len(set(bigrams)) < len(bigrams)


def test_generate_no_repeat_ngram_size(gpt2_vocab, tmp_path):
    """Greedy and beam search: with --no-repeat-ngram-size 2 no bigram of prompt and text occurs twice; without,
    the tiny model repeats itself at once (so the check can fail)."""
    path, _, tok = gpt2_vocab
    prompts = ["Hello world", "The meaning of life is"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    for search in (["--temperature", "0"], ["--num-beams", "3", "--num-return-sequences", "3"]):
        for flag, repeats in (([], True), (["--no-repeat-ngram-size", "2"], False)):
            r = run("generate", "--prompts-file", str(tmp_path / "p.txt"), "--model", path, "--max-new-tokens", "20",
                    *search, *flag)
            assert r.returncode == 0, r.stderr
            records = [json.loads(line) for line in r.stdout.splitlines()]
            texts = [(x["prompt"], h["tokens"]) for x in records for h in x.get("hypotheses", [x])]
            assert len(texts) == (2 if search[0] == "--temperature" else 6)
            assert all(len(ids) == 20 for _, ids in texts)
            assert any(repeats_a_bigram(tok.encode(p) + ids) for p, ids in texts) == repeats, (search, flag)
            if not repeats:
                assert not any(repeats_a_bigram(tok.encode(p) + ids) for p, ids in texts)


@pytest.mark.parametrize("args, match", [
    (["--num-beams", "3", "--temperature", "0.5"], "--temperature goes with sampling, not beam search (--num-beams 3)"),
    (["--num-beams", "2", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.1", "--typical-p", "0.5"],
     "--top-k, --top-p, --min-p, --typical-p go with sampling, not beam search"),
    (["--num-beams", "2", "--presence-penalty", "1", "--frequency-penalty", "1", "--seed", "1", "--no-stop"],
     "--presence-penalty, --frequency-penalty, --seed, --no-stop go with sampling"),
    (["--num-beams", "3", "--num-return-sequences", "4"], "--num-return-sequences 4 is more than --num-beams 3"),
    (["--num-beams", "2", "--max-new-tokens", "0"], "--max-new-tokens 0 goes with sampling, not beam search "
                                                    "(--num-beams 2)"),
    (["--length-penalty", "2"], "--length-penalty goes with beam search: add --num-beams N"),
    (["--num-beams", "1", "--early-stopping", "true", "--length-penalty", "1"],
     "--length-penalty, --early-stopping go with beam search"),
    (["--num-return-sequences", "2", "--temperature", "0"], "--num-return-sequences 2 with --temperature 0"),
    (["--num-return-sequences", "2", "--slide"], "--slide goes with one text"),
    (["--num-beams", "0"], "--num-beams: must be at least 1"),
    (["--early-stopping", "soon"], "--early-stopping: invalid choice: 'soon'"),
    (["--bad-words", ""], "--bad-words: must not be empty"),
    # zero is a value given, not a flag left out
    (["--num-beams", "3", "--temperature", "0"], "--temperature goes with sampling"),
    (["--num-beams", "3", "--seed", "0", "--top-k", "1"], "--top-k, --seed go with sampling"),
    (["--length-penalty", "0"], "--length-penalty goes with beam search"),
    (["--regex", "a", "--choice", "b"], "give at most one of --json-schema, --regex, --choice, --grammar; got "
                                        "--regex, --choice"),
    (["--draft", "int4", "--prompt-lookup", "3"], "give --draft or --prompt-lookup, not both"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens goes with --draft"),
    (["--prompt-lookup", "3", "--num-speculative-tokens", "3"], "--num-speculative-tokens goes with --draft"),
    (["--max-matching-ngram-size", "3"], "--max-matching-ngram-size goes with --prompt-lookup"),
    (["--draft", "int4", "--num-beams", "2"], "--draft goes with sampling, not beam search"),
    (["--prompt-lookup", "4", "--regex", "a+"], "--prompt-lookup goes without --regex: speculative decoding"),
    (["--draft", "int8", "--slide"], "--draft goes without --slide"),
    (["--num-speculative-tokens", "65", "--draft", "int4"], "--num-speculative-tokens: must be in [1, 64], got 65"),
])
def test_generate_flags_that_do_not_go_together(args, match, tmp_path):
    """Exit 2 naming the flags, before any work: the model named does not exist, and a run that got as far as
    loading it would exit 1 saying so."""
    r = run("generate", "Hi", "--model", str(tmp_path / "missing"), *args)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_batch_size_does_not_go_with_beams(tmp_path):
    r = run("generate", "--prompts-file", str(tmp_path / "missing.txt"), "--num-beams", "2", "--batch-size", "2")
    assert r.returncode == 2 and "--batch-size goes with sampling, not beam search" in r.stderr


def test_generate_out_of_range_settings_name_the_flag(gpt2_vocab):
    """Refused as typed (exit 2, before loading), or past the model's vocabulary once it is loaded (exit 1)."""
    path, *_ = gpt2_vocab
    for args, code, match in [(["--min-p", "2"], 2, "--min-p: must be in [0, 1], got 2"),
                              (["--presence-penalty", "3"], 2, "--presence-penalty: must be in [-2, 2], got 3"),
                              (["--num-beams", "2", "--length-penalty", "inf"], 2,
                               "--length-penalty: must be a finite number, got inf"),
                              (["--num-beams", "2", "--no-repeat-ngram-size", "-1"], 2,
                               "--no-repeat-ngram-size: must be at least 0, got -1"),
                              (["--eos-token-id", "60000"], 1, "--eos-token-id 60000: past the model's vocabulary")]:
        r = run("generate", "Hi", "--model", path, *args)
        assert r.returncode == code and match in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generate_a_prompts_file_with_beam_search(gpt2_vocab, tmp_path):
    """One JSON line per prompt with its hypotheses, best first: beam_search_batch's, with the settings both
    decodings share passed on. Catches: a prompt's hypotheses given to another, --repetition-penalty,
    --min-new-tokens, --eos-token-id or --early-stopping dropped."""
    path, w, tok = gpt2_vocab
    prompts = ["Hello world", "The meaning of life is", "{"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    settings = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, repetition_penalty=1.5)
    first = g.beam_search_batch([tok.encode(p) for p in prompts], w, **settings)
    eos = first[0][0].ids[3]  # prompt 0's best hypothesis ends early with this as an end-of-text id
    settings.update(eos_token_id=[eos, tok.eot_id], min_new_tokens=2, early_stopping=True)
    found = g.beam_search_batch([tok.encode(p) for p in prompts], w, **settings)
    assert any(len(h.ids) < 8 for h in found[0]) and eos in found[0][0].ids
    r = run("generate", "--prompts-file", str(tmp_path / "p.txt"), "--model", path, "--num-beams", "3",
            "--num-return-sequences", "2", "--max-new-tokens", "8", "--repetition-penalty", "1.5",
            "--eos-token-id", str(eos), str(tok.eot_id), "--min-new-tokens", "2", "--early-stopping", "true")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["index"], x["prompt"]) for x in records] == list(enumerate(prompts))
    for x, hypotheses in zip(records, found):
        assert [(h["text"], h["tokens"]) for h in x["hypotheses"]] == [(continuation(h.ids, tok), h.ids)
                                                                       for h in hypotheses]
        assert [h["score"] for h in x["hypotheses"]] == pytest.approx([h.score for h in hypotheses], rel=1e-6)
    assert "3 prompts, beam search of 3 beams: 6 hypotheses" in r.stderr


def test_generate_sampling_settings_reach_the_sampler(gpt2_vocab, tmp_path):
    """--num-return-sequences samples as generate_batch's n, one JSON line per sample (or the texts of one
    PROMPT); --min-p, --typical-p, the penalties, --min-new-tokens, --eos-token-id and --bad-words as the
    Sampler's settings; a bad word is tokenized with a space before it. Catches: a setting dropped, a bad
    word tokenized bare, samples numbered or seeded otherwise than generate_batch's."""
    path, w, tok = gpt2_vocab
    prompts = ["Hello world", "The meaning of life is"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    ids = [tok.encode(p) for p in prompts]
    settings = dict(max_new_tokens=8, seed=4, n=2, min_p=0.05, typical_p=0.9, presence_penalty=1.5,
                    frequency_penalty=0.5, min_new_tokens=2)

    def sample(**more):
        tokens = [[] for _ in range(4)]
        for i, t in g.generate_batch(ids, w, **settings, **more):
            tokens[i].append(t)
        return tokens
    # a word the samples write after a space, one token long: banned, it must go
    word = next(tok.decode([t]).strip() for text in sample() for t in text
                if re.fullmatch(r" [A-Za-z]+", tok.decode([t])) and tok.encode(tok.decode([t])) == [t])
    banned = tok.encode(" " + word)
    eos = sample(bad_words_ids=[banned])[1][4]
    expected = sample(bad_words_ids=[banned], eos_token_id=[eos, tok.eot_id])
    assert len(expected[1]) < 8 and tok.encode(word) != banned  # the end-of-text id ends a sample; bare differs
    flags = ["--model", path, "--max-new-tokens", "8", "--seed", "4", "--num-return-sequences", "2", "--min-p",
             "0.05", "--typical-p", "0.9", "--presence-penalty", "1.5", "--frequency-penalty", "0.5",
             "--min-new-tokens", "2", "--bad-words", word, "--eos-token-id", str(eos), str(tok.eot_id)]
    r = run("generate", "--prompts-file", str(tmp_path / "p.txt"), *flags)
    assert r.returncode == 0, r.stderr
    records = sorted((json.loads(line) for line in r.stdout.splitlines()), key=lambda x: (x["index"], x["sample"]))
    assert [(x["index"], x["sample"], x["prompt"], x["tokens"]) for x in records] == [
        (i // 2, i % 2, prompts[i // 2], tokens) for i, tokens in enumerate(expected)]
    assert all(banned[0] not in x["tokens"] for x in records)
    r = run("generate", prompts[0], *flags)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "".join(f"{prompts[0]}{continuation(tokens, tok)}\n" for tokens in expected[:2])


# --- every number a flag takes is checked where it is typed (argtypes.py) ----------------------------------

def _parsers():
    """(command, parser) of every command line: gpt2numba's, each of its commands', the benchmark's."""
    import argparse

    from gpt2numba import bench, cli

    top = cli.build_parser()
    found = [("gpt2numba", top)]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(f"gpt2numba {name}", sub) for name, sub in action.choices.items()]
    return found + [("gpt2numba bench", bench._parser())]


def _number_flags():
    for command, parser in _parsers():
        for action in parser._actions:
            if action.option_strings and action.type is not None:
                yield command, action


def test_every_number_flag_has_a_range():
    """A flag whose type is a bare int or float would take any value: each must have argtypes.in_range's."""
    bare = [f"{command} {a.option_strings[-1]}" for command, a in _number_flags() if a.type in (int, float)]
    assert not bare, f"number flags without a range: {bare}"
    assert sum(hasattr(a.type, "bounds") for _, a in _number_flags()) >= 50


def _outside(bounds):
    """Values just outside a range, as typed: below it, above it, not a number of its kind, not finite."""
    kind, low, high, low_open, high_open = bounds
    step = 1 if kind is int else 0.5
    values = ["x", "nan" if kind is float else "1.5"]
    if low is not None:
        values.append(str(low if low_open else low - step))
    if high is not None:
        values.append(str(high if high_open else high + step))
    return values


def test_a_number_out_of_range_is_refused_naming_the_flag():
    """Every number flag refuses values outside its range, in a message naming the flag as typed and the value,
    before anything loads (argparse's exit 2)."""
    import contextlib
    import io

    checked = 0
    for command, action in _number_flags():
        if not hasattr(action.type, "bounds"):
            continue
        parser = dict(_parsers())[command]
        flag = action.option_strings[-1]
        for value in _outside(action.type.bounds):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit:
                parser.parse_args([flag, value] + (["1"] * (action.nargs == 2)))
            assert exit.value.code == 2
            said = err.getvalue()
            assert f"argument {flag}: must be " in said and value in said, said
            assert action.type.range in said or "must be an integer, got" in said or "a number, got" in said, said
            checked += 1
    assert checked >= 100


@pytest.mark.parametrize("argv, said", [
    (["serve", "--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
    (["generate", "x", "--top-p", "2"], "argument --top-p: must be in (0, 1], got 2"),
    (["generate", "x", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["generate", "x", "--top-k", "0"], "argument --top-k: must be at least 1, got 0"),
    (["generate", "x", "--temperature", "-1"], "argument --temperature: must be at least 0, got -1"),
])
def test_the_issues_examples(argv, said):
    r = run(*argv)
    assert r.returncode == 2 and said in r.stderr, r.stderr


def test_generate_without_a_prompt_says_so():
    r = run("generate", "--max-new-tokens", "3")
    assert r.returncode == 2 and "give a PROMPT to continue, or --prompts-file" in r.stderr, r.stderr


def test_score_names_a_missing_file_before_loading(tmp_path):
    r = run("score", str(tmp_path / "missing.txt"), env={"GPT2NUMBA_WEIGHTS": str(tmp_path / "nowhere")})
    assert r.returncode == 1 and "missing.txt" in r.stderr and "no such file" in r.stderr, r.stderr
    assert "documents" not in r.stderr  # no summary of nothing


def test_past_the_context_names_the_flags(tmp_path):
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path)
    r = run("generate", "Hello", "--model", str(tmp_path), "--max-new-tokens", "100")
    assert r.returncode == 1 and "--max-new-tokens 100" in r.stderr and "--slide" in r.stderr, r.stderr


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"gpt2numba {g.__version__}"


# --- one rule each: hub names, blank lines, one-token documents, files' modes --------------------------------

@pytest.mark.parametrize("name, hub", [
    ("gpt2", True), ("openai-community/gpt2", True), ("gpt2-medium", True),
    ("./gpt2", False), ("a/b/c", False), ("model.safetensors", False), ("gpt2-q8_0.gguf", False), ("/abs/gpt2", False),
    ("here/gpt2", False),  # a folder "here" exists: a missing local path, not a hub name
    ("made", False),       # exists here: the local checkpoint wins
])
def test_hub_names_as_the_hub_reads_them(tmp_path, monkeypatch, name, hub):
    from gpt2numba.model import models

    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    (tmp_path / "made").mkdir()
    assert models.is_hub_name(name) is hub


def test_a_missing_path_is_reported_missing_and_a_hub_name_goes_to_the_hub(tmp_path, monkeypatch):
    from gpt2numba.model import models

    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    asked = []
    monkeypatch.setattr(models, "_download", lambda name: asked.append(name) or tmp_path / "nothing")
    with pytest.raises(g.CheckpointNotFoundError, match="here/gpt2"):
        models.resolve_model("here/gpt2")
    assert asked == []
    with pytest.raises(g.CheckpointNotFoundError):
        models.resolve_model("gpt2")
    assert asked == ["gpt2"]


def test_blank_lines_are_no_documents_in_score_as_in_generate():
    from gpt2numba.text.documents import split

    assert list(split(b"a\n\n  \nb\n", "f", lines=True)) == [("f", 0, "a"), ("f", 1, "b")]
    assert list(split(b'{"text": "a"}\n\n{"text": "b"}', "f", field="text")) == [("f", 0, "a"), ("f", 1, "b")]


def test_a_document_with_nothing_to_score_reports_no_perplexity(tmp_path):
    write_dir(g.random_weights(TINY_GPT2, seed=0), tmp_path / "ckpt")
    (tmp_path / "one.txt").write_text("Hello")  # one token: nothing is predicted
    r = run("score", str(tmp_path / "one.txt"), "--model", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.splitlines()[0])
    assert line["tokens"] == 0 and line["perplexity"] is None and line["bits_per_byte"] is None


@pytest.mark.slow
def test_score_on_random_weights_says_so(tmp_path):
    (tmp_path / "doc.txt").write_text("Hello world")
    r = run("score", str(tmp_path / "doc.txt"), env={"GPT2NUMBA_WEIGHTS": ""})
    assert r.returncode == 0 and "random GPT-2 small weights" in r.stderr, r.stderr


def test_saved_weights_have_the_configs_mode(tmp_path):
    """Under a umask of 022 both files are 0644 (safetensors alone writes 0600)."""
    script = ("import os, sys; os.umask(0o022); import gpt2numba as g; "
              "g.save_weights(g.random_weights(g.GPT2Config(n_layer=1, n_head=2, n_embd=64, n_positions=16, "
              "vocab_size=64), seed=0), sys.argv[1])")
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=300)
    modes = {name: oct((tmp_path / name).stat().st_mode & 0o777) for name in ("model.safetensors", "config.json")}
    assert modes == {"model.safetensors": "0o644", "config.json": "0o644"}, modes


def test_a_bad_weights_variable_is_named(tmp_path):
    r = run("generate", "Hi", env={"GPT2NUMBA_WEIGHTS": str(tmp_path / "nowhere")})
    assert r.returncode == 1 and "$GPT2NUMBA_WEIGHTS=" in r.stderr and "nowhere" in r.stderr, r.stderr


def test_generate_structured_output(gpt2_vocab, tmp_path):
    """--json-schema, --regex, --choice and --grammar reach generate, generate_batch and beam search: the texts
    are the library's, and valid; an error names the flag and its file."""
    path, w, tok = gpt2_vocab
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    r = run("generate", "Data:", "--model", path, "--json-schema", str(tmp_path / "s.json"), "--temperature", "0")
    assert r.returncode == 0, r.stderr
    ids = list(g.generate(tok.encode("Data:"), w, max_new_tokens=50, temperature=0, json_schema=schema))
    assert r.stdout == f"Data:{continuation(ids, tok)}\n" and json.loads(r.stdout[5:])["n"] in range(10)
    (tmp_path / "p.txt").write_text("A:\nB:\n")
    r = run("generate", "--prompts-file", str(tmp_path / "p.txt"), "--model", path, "--regex", "[0-9]{2}-[a-z]",
            "--seed", "3", "--num-return-sequences", "2")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(records) == 4 and all(re.fullmatch("[0-9]{2}-[a-z]", x["text"]) for x in records)
    r = run("generate", "Q:", "--model", path, "--num-beams", "3", "--num-return-sequences", "2", "--choice", "yes",
            "--choice", "no", "--choice", "not sure")
    assert r.returncode == 0 and set(r.stdout.splitlines()) <= {"Q:yes", "Q:no", "Q:not sure"}, r.stderr
    (tmp_path / "g.gbnf").write_text('root ::= "<" [a-c]+ ">"')
    r = run("generate", "T:", "--model", path, "--grammar", str(tmp_path / "g.gbnf"), "--seed", "1",
            "--max-new-tokens", "30")
    assert r.returncode == 0 and re.fullmatch(r"T:(<[a-c]+>|<[a-c]*)\n", r.stdout), r.stdout
    (tmp_path / "bad.json").write_text('{"type": "nothing"}')
    for args, match in [(["--json-schema", str(tmp_path / "bad.json")], f"--json-schema {tmp_path / 'bad.json'}: "
                         "Invalid type: nothing"),
                        (["--json-schema", str(tmp_path / "none.json")], "none.json: no such file"),
                        (["--regex", "(("], "--regex: "), (["--choice", ""], "--choice: entry 0 must be a non-empty string")]:
        r = run("generate", "x", "--model", path, *args)
        assert r.returncode == 1 and match in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generate_with_a_draft_gives_the_plain_tokens(gpt2_vocab, tmp_path):
    """--draft int4 and --prompt-lookup, greedy: the text of plain greedy decoding, for one prompt and a prompts
    file; a draft that is neither a format nor a checkpoint is named as the flag."""
    path, *_ = gpt2_vocab
    plain = run("generate", "Hello there", "--model", path, "--temperature", "0", "--max-new-tokens", "20")
    assert plain.returncode == 0, plain.stderr
    for args in (["--draft", "int4"], ["--draft", "int8", "--num-speculative-tokens", "2"], ["--prompt-lookup", "3"]):
        r = run("generate", "Hello there", "--model", path, "--temperature", "0", "--max-new-tokens", "20", *args)
        assert r.returncode == 0 and r.stdout == plain.stdout, (args, r.stderr)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nOnce upon\n")
    batch = [run("generate", "--prompts-file", str(prompts), "--model", path, "--temperature", "0", *args).stdout
             for args in ([], ["--draft", "int4"])]
    assert batch[0] == batch[1] and batch[0].count("\n") == 2
    r = run("generate", "Hi", "--model", path, "--draft", str(tmp_path / "nothing"))
    assert r.returncode == 1 and f"--draft {tmp_path / 'nothing'} is neither int4, int8, bfloat16 nor a checkpoint" \
        in r.stderr and "Traceback" not in r.stderr, r.stderr


# --- what a newcomer tripped on (issue 70): paths as typed, options that took the next word, summaries of no work ---

def test_a_path_is_named_as_typed(tmp_path, gpt2_vocab):
    """Every message that names a path names it as the user typed it: './nope', not 'nope' (pathlib drops a
    leading ./ and a trailing /), and a file inside a checkpoint directory as that directory was typed."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_text("not a checkpoint")
    (tmp_path / "bad_config").mkdir()
    (tmp_path / "bad_config" / "model.safetensors").write_text("")
    (tmp_path / "bad_config" / "config.json").write_text("{not json")
    (tmp_path / "blank.txt").write_text("\n")
    model = ["--model", gpt2_vocab[0]]
    for argv, said in [
        (["generate", "Hi", "--model", "./nope"], "checkpoint './nope' does not exist"),
        (["bench", "--model", "./nope"], "gpt2numba: error: checkpoint './nope' does not exist"),  # (its own parser)
        (["check", "--model", "./empty/"], "checkpoint directory './empty/' has no model.safetensors"),
        (["score", "--model", "./broken", "blank.txt"], "'./broken/model.safetensors' is not a readable safetensors"),
        (["generate", "Hi", "--model", "./bad_config"], "'./bad_config/config.json' is not a readable JSON file"),
        (["generate", "--prompts-file", "./none.txt"], "No such file or directory: './none.txt'"),
        (["generate", "--prompts-file", "./blank.txt"], "./blank.txt: no prompts in the file"),
        (["generate", "Hi", *model, "--json-schema", "./none.json"], "--json-schema ./none.json: no such file"),
        (["generate", "Hi", *model, "--draft", "./nope"], "--draft ./nope is neither int4, int8, bfloat16 nor a "
                                                           "checkpoint: checkpoint './nope' does not exist"),
    ]:
        r = run(*argv, cwd=tmp_path)
        assert r.returncode == 1 and said in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)


def test_an_option_with_an_optional_value_takes_no_file_or_prompt(tmp_path, gpt2_vocab):
    """--ray [ADDRESS] takes the word after it only when it is an address (auto, HOST:PORT, ray://...): a FILE or
    PROMPT stays one (`score --ray corpus.txt` said "--ray reads files, not stdin", the file taken for the
    cluster); --eos-token-id ID [ID ...] stops before a word that is no number. Refused before any Ray runs."""
    (tmp_path / "corpus.txt").write_text("Hello there")
    r = run("score", "--ray", "corpus.txt", "--kv-dtype", "float16", cwd=tmp_path)
    assert r.returncode == 1 and "--kv-dtype goes without --ray" in r.stderr, r.stderr  # the file is FILE
    r = run("generate", "--ray", "Hello")
    assert r.returncode == 2 and "--ray goes with --prompts-file" in r.stderr, r.stderr  # "Hello" is PROMPT
    r = run("generate", "--eos-token-id", "50256", "Hello", "--model", gpt2_vocab[0], "--max-new-tokens", "2")
    assert r.returncode == 0 and r.stdout.startswith("Hello"), r.stderr
    from gpt2numba.cli.options import build_parser, unswallowed  # (the words as the command line reads them)

    parse = build_parser().parse_args
    for argv, ray, files in [(["--ray", "a.txt"], "local", ["a.txt"]), (["a.txt", "--ray"], "local", ["a.txt"]),
                             (["--ray", "ray://head:10001", "a.txt"], "ray://head:10001", ["a.txt"]),
                             (["--ray", "10.0.0.1:6379", "a.txt", "b.txt"], "10.0.0.1:6379", ["a.txt", "b.txt"]),
                             (["--ray", "auto", "a.txt"], "auto", ["a.txt"]), (["--ray=odd", "a.txt"], "odd", ["a.txt"]),
                             (["--ray", "-"], "local", ["-"]), (["--ray", "--lines", "a.txt"], "local", ["a.txt"])]:
        args = parse(unswallowed(["score", *argv]))
        assert (args.ray, args.files) == (ray, files), argv
    args = parse(unswallowed(["generate", "--eos-token-id", "7", "8", "Hi", "--seed", "1"]))
    assert (args.eos_token_id, args.prompt, args.seed) == ([7, 8], "Hi", 1)


def test_an_abbreviated_flag_is_refused():
    """A flag is taken only as written in full, by every command and the benchmark: argparse took --ra for --ray
    and --eos for --eos-token-id, past unswallowed (which knows full names), so that `score --ra corpus.txt` took
    the file for the cluster's address and `generate --eos 13 Hello` the prompt for an id."""
    import contextlib
    import io

    from gpt2numba import bench
    from gpt2numba.cli.options import build_parser, unswallowed

    for parser, argv, said in [(build_parser(), ["score", "--ra", "corpus.txt"], "--ra"),
                               (build_parser(), ["generate", "--eos", "13", "Hello"], "--eos"),
                               (build_parser(), ["generate", "Hello", "--max-new", "3"], "--max-new"),
                               (bench._parser(), ["--thread", "2"], "--thread")]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit:
            parser.parse_args(unswallowed(argv))
        assert exit.value.code == 2 and f"unrecognized arguments: {said}" in err.getvalue(), (argv, err.getvalue())


def test_the_command_ends_its_process_with_its_output_and_exit_handlers(gpt2_vocab):
    """console() ends the process at once, but after the exit handlers and with what they wrote; under a profiler
    it leaves the end to Python, which writes the profile."""
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('a handler ran', end=''))\n"
              f"sys.argv = ['gpt2numba', 'generate', 'Hi', '--max-new-tokens', '1', '--model', {gpt2_vocab[0]!r}]\n"
              "from gpt2numba.cli import console\n"
              "console()\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hi") and r.stdout.endswith("a handler ran"), r.stdout
    assert "1 new token" in r.stderr
    profile = Path(gpt2_vocab[0]).parent / "cli.prof"
    r = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "gpt2numba", "generate", "Hi",
                        "--max-new-tokens", "1", "--model", gpt2_vocab[0]], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and profile.stat().st_size > 0, r.stderr


def test_a_summary_of_no_work_shows_no_rate(tmp_path, gpt2_vocab):
    """No new token, one new token, a batch of no new tokens, a corpus with nothing to score: the summary says what
    was done and shows no rate where nothing was timed (it said "prefill 1000000000 tokens/s", "decode nan
    ms/token", "0 tokens/s", "perplexity nan"); a noun is plural by its count (it said "1 documents")."""
    (tmp_path / "p.txt").write_text("Hi\nHello there\n")
    (tmp_path / "one.txt").write_text("Hello")  # one token: nothing to score
    model = ["--model", gpt2_vocab[0]]

    def summary(*argv):
        r = run(*argv, *model, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        line = [x for x in re.split(r"[\r\n]", r.stderr) if x.startswith("gpt2numba: ") and "random" not in x][-1]
        assert not re.search(r"\bnan\b|/s\b|1000000000", line), line
        return line

    assert "1 prompt token, 0 new tokens; " in summary("generate", "Hello", "--max-new-tokens", "0")
    line = summary("generate", "Hello", "--max-new-tokens", "1")
    assert "1 prompt token, 1 new token; first token after " in line and "no decode step" in line, line
    assert "2 prompts, 0 new tokens in " in summary("generate", "--prompts-file", "p.txt", "--max-new-tokens", "0")
    r = run("generate", "--prompts-file", "one.txt", "--max-new-tokens", "1", *model, cwd=tmp_path)  # (a rate)
    assert r.returncode == 0 and "gpt2numba: 1 prompt, 1 new token in " in r.stderr, r.stderr
    assert "1 document, 0 tokens scored; " in summary("score", "one.txt")

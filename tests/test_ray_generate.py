"""Generation on a local Ray cluster (2 CPUs, started once for the module): generate_dataset gives each row the
tokens generate_batch (or beam_search_batch) gives it in-process, whatever the workers and blocks; bad settings
are refused before Ray is asked to run anything; generate --ray writes the records of the in-process command."""

import json
import subprocess
import sys

import numpy as np
import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY, TINY_GPT2
from gpt2numba.decoding.sample import prompt_ids
from gpt2numba.cli import main

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e \".[ray]\")")

CONFIG = TINY_GPT2
TEXTS = ["The quick brown fox", "", "Once upon a time", "x", "A longer prompt, of a dozen tokens or so, to run",
         "Hello world", "1 2 3", "Why"]
EOT = 50256
COMMAND_S = 900  # a command that connects to the cluster and starts its workers: a minute on 2 busy cores


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray_generate") / "model"
    w = g.random_weights(CONFIG, seed=6)
    write_dir(w, path)
    return path, w


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def blocks(rows: list[dict]):
    """The rows in 4 blocks, so that 2 workers of batches of 2 rows each see prompts from the middle of the list."""
    return ray.data.from_items(rows, override_num_blocks=4)


@pytest.mark.slow
def test_seeded_sampling_equals_generate_batch(model, cluster):
    """Seeded sampling, 2 samples a prompt, over 4 blocks and 2 workers: each row's tokens are those of
    generate_batch over every prompt in one process (row r's sample j on the stream (seed, 2r + j), not on its
    place in its block); <|endoftext|> (made likely by a logit bias) ends a completion with "stop" and is not
    in its text; an empty prompt starts from <|endoftext|>; each log-probability is score()'s for that token."""
    from gpt2numba.integrations.distributed import generate_dataset

    path, w = model
    tok = g.load_tokenizer()
    settings = dict(max_new_tokens=6, seed=11, temperature=0.9, top_k=400, logit_bias={EOT: 4.0})
    ds = blocks([{"prompt": text, "id": i} for i, text in enumerate(TEXTS)])
    rows = sorted(generate_dataset(ds, str(path), num_return_sequences=2, logprobs=True, concurrency=2,
                                   batch_size=2, **settings).take_all(), key=lambda r: r["id"])
    prompts = [prompt_ids(text, tok) for text in TEXTS]
    expected = [[] for _ in range(2 * len(TEXTS))]
    for i, token in g.generate_batch(prompts, w, n=2, **settings):
        expected[i].append(token)
    assert [r["prompt"] for r in rows] == TEXTS and "__gpt2numba_row" not in rows[0]  # the input kept, the numbers not
    assert [ids for r in rows for ids in r["completion_ids"]] == expected
    finished = [reason for r in rows for reason in r["finish_reason"]]
    assert finished == ["stop" if ids[-1] == EOT else "length" for ids in expected]
    assert {"stop", "length"} <= set(finished)  # both kinds occur: the bias is strong enough
    assert [text for r in rows for text in r["completion"]] == [
        tok.decode([t for t in ids if t != EOT]) for ids in expected]
    for ids, row in zip(prompts, rows):
        for new, logprobs in zip(row["completion_ids"], row["logprobs"]):
            scored = g.score(ids + list(new), w).logprobs[len(ids) - 1:]
            np.testing.assert_allclose(logprobs, scored, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_greedy_from_token_ids_equals_generate_batch(model, cluster):
    """Greedy generation from lists of token ids (an empty list starts from <|endoftext|>), no seed: the tokens
    generate_batch gives, and one completion per row as plain columns; the same with a draft (speculative
    decoding)."""
    from gpt2numba.integrations.distributed import generate_dataset

    path, w = model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (3, 1, 9, 0, 5, 2)]
    ds = blocks([{"ids": ids, "id": i} for i, ids in enumerate(prompts)])
    rows = sorted(generate_dataset(ds, str(path), column="ids", max_new_tokens=5, temperature=0, concurrency=2,
                                   batch_size=2).take_all(), key=lambda r: r["id"])
    expected = [[] for _ in prompts]
    for i, token in g.generate_batch([ids or [EOT] for ids in prompts], w, max_new_tokens=5, temperature=0):
        expected[i].append(token)
    assert [list(r["completion_ids"]) for r in rows] == expected
    assert all(isinstance(r["completion"], str) and "logprobs" not in r for r in rows)
    drafted = sorted(generate_dataset(ds, str(path), column="ids", max_new_tokens=5, temperature=0, concurrency=2,
                                      batch_size=2, draft="int8", num_speculative_tokens=2).take_all(),
                     key=lambda r: r["id"])  # each worker drafts with its weights' int8
    assert [list(r["completion_ids"]) for r in drafted] == expected


@pytest.mark.slow
def test_beam_search_equals_beam_search_batch(model, cluster):
    """num_beams 3 with its own settings: the 2 best hypotheses of beam_search_batch, ids and scores, as lists;
    their log-probabilities, when asked, score()'s."""
    from gpt2numba.integrations.distributed import generate_dataset

    path, w = model
    tok = g.load_tokenizer()
    settings = dict(num_beams=3, max_new_tokens=4, length_penalty=0.5, no_repeat_ngram_size=2)
    ds = blocks([{"prompt": text, "id": i} for i, text in enumerate(TEXTS[:5])])
    rows = sorted(generate_dataset(ds, str(path), num_return_sequences=2, logprobs=True, concurrency=2, batch_size=2,
                                   **settings).take_all(), key=lambda r: r["id"])
    prompts = [prompt_ids(text, tok) for text in TEXTS[:5]]
    found = g.beam_search_batch(prompts, w, num_return_sequences=2, **settings)
    assert [[list(ids) for ids in r["completion_ids"]] for r in rows] == [[h.ids for h in hs] for hs in found]
    assert [s for r in rows for s in r["score"]] == pytest.approx([h.score for hs in found for h in hs], rel=1e-6)
    for ids, row in zip(prompts, rows):
        for new, logprobs in zip(row["completion_ids"], row["logprobs"]):
            np.testing.assert_allclose(logprobs, g.score(ids + list(new), w).logprobs[len(ids) - 1:], rtol=1e-4,
                                       atol=1e-4)


def test_bad_settings_are_refused_before_ray_runs_anything(model, cluster, monkeypatch):
    """Every bad setting raises the library's own error before generate_dataset asks Ray for anything: Ray's
    map_batches and to_arrow_refs (the numbering of a seeded run) are replaced by spies, which a good call does
    reach (the control at the end)."""
    from gpt2numba.integrations.distributed import generate_dataset

    path, _ = model
    asked = []
    monkeypatch.setattr(ray.data.Dataset, "map_batches", lambda self, *a, **k: asked.append("map_batches") or self)
    monkeypatch.setattr(ray.data.Dataset, "to_arrow_refs", lambda self: asked.append("to_arrow_refs") or [])
    ds = ray.data.from_items([{"prompt": "a"}])
    cases = [({"temperature": -1}, g.SamplingError, "temperature"), ({"top_p": 2.0}, g.SamplingError, "top_p"),
             ({"tempreature": 1.0}, g.SamplingError, "tempreature"), ({"seed": -1}, g.SamplingError, "seed"),
             ({"num_return_sequences": 0}, g.SamplingError, "num_return_sequences"),
             ({"eos_token_id": CONFIG.vocab_size}, g.TokenError, "eos_token_id"),  # the vocabulary from config.json
             ({"logit_bias": {CONFIG.vocab_size: 1.0}}, g.TokenError, "logit_bias"),
             ({"max_new_tokens": CONFIG.n_positions}, g.CacheFullError, "max_new_tokens"),
             ({"num_beams": 0}, g.SamplingError, "num_beams"),
             ({"num_beams": 2, "seed": 1}, g.SamplingError, "seed"),
             ({"num_beams": 2, "seed": None, "temperature": 0.5}, g.SamplingError, "temperature"),
             ({"num_beams": 2, "seed": None, "num_return_sequences": 3}, g.SamplingError, "num_return_sequences"),
             ({"num_beams": 2, "seed": None, "length_penalty": float("nan")}, g.SamplingError, "length_penalty"),
             ({"dtype": "int3"}, g.ConfigError, "dtype"), ({"kv_dtype": "int8"}, g.ConfigError, "kv_dtype"),
             ({"activations": "bfloat16"}, g.ConfigError, "needs bfloat16 weights"),
             ({"logprobs": "yes"}, g.ConfigError, "logprobs"), ({"column": 3}, g.ConfigError, "column"),
             ({"concurrency": 0}, g.ConfigError, "concurrency"), ({"batch_size": 0}, g.ConfigError, "batch_size"),
             ({"threads_per_worker": 0}, g.ConfigError, "threads_per_worker"),
             ({"num_speculative_tokens": 3}, g.ConfigError, "num_speculative_tokens=3 needs a draft"),
             ({"draft": "int4", "prompt_lookup_num_tokens": 2}, g.ConfigError, "not both"),
             ({"num_beams": 2, "seed": None, "draft": "int4"}, g.SamplingError, "draft: speculative decoding goes")]
    for change, error, match in cases:
        kwargs = {"max_new_tokens": 4, "seed": 0, **change}
        with pytest.raises(error, match=match):
            generate_dataset(ds, str(path), **kwargs)
    assert asked == []
    generate_dataset(ds, str(path), max_new_tokens=4, seed=0)
    assert asked == ["to_arrow_refs", "map_batches"]


def test_empty_dataset(model, cluster):
    """No rows in, no rows out, seeded (the numbering of no blocks) or not."""
    from gpt2numba.integrations.distributed import generate_dataset

    path, _ = model
    for seed in (0, None):
        assert generate_dataset(ray.data.from_items([]), str(path), max_new_tokens=3, seed=seed).take_all() == []


@pytest.mark.slow
def test_generate_command_on_ray_writes_the_in_process_records(model, cluster, tmp_path, capsys):
    """generate --prompts-file --ray ADDRESS (the module's cluster, from a process of its own): the JSON lines
    of the command without --ray (run here), in the prompts' order (in-process they come as they finish),
    samples and all; beam search's records with --output DIR --format parquet."""
    path, _ = model
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in TEXTS))
    args = ["generate", "--model", str(path), "--prompts-file", str(prompts), "--max-new-tokens", "5"]
    command = [sys.executable, "-m", "gpt2numba", *args]

    def in_process(*flags) -> list[dict]:
        capsys.readouterr()
        assert main([*args, *flags]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    sampling = ["--seed", "3", "--num-return-sequences", "2", "--top-k", "100"]
    on_ray = subprocess.run([*command, *sampling, "--ray", cluster], capture_output=True, text=True, timeout=COMMAND_S)
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    expected = sorted(in_process(*sampling), key=lambda r: (r["index"], r["sample"]))
    assert on_ray.stdout.splitlines() == [json.dumps(r) for r in expected]
    assert f"{len(TEXTS)} prompts x 2 on Ray" in on_ray.stderr

    beams = ["--num-beams", "3", "--num-return-sequences", "2"]
    written = subprocess.run([*command, *beams, "--ray", cluster, "--output", str(tmp_path / "out"), "--format",
                              "parquet"], capture_output=True, text=True, timeout=COMMAND_S)
    assert written.returncode == 0 and written.stdout == "", written.stderr[-3000:]
    rows = sorted(ray.data.read_parquet(str(tmp_path / "out")).take_all(), key=lambda r: r["index"])
    expected = in_process(*beams)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in expected] == TEXTS
    for row, record in zip(rows, expected):
        assert [(h["text"], list(h["tokens"])) for h in row["hypotheses"]] == [
            (h["text"], h["tokens"]) for h in record["hypotheses"]]
        assert [h["score"] for h in row["hypotheses"]] == pytest.approx([h["score"] for h in record["hypotheses"]])


def test_generate_command_refuses_ray_flags_out_of_place(capsys):
    """--ray needs --prompts-file; --output and --format need --ray: exit 2 before anything is loaded."""
    for flags, message in [(["PROMPT", "--ray"], "--ray goes with --prompts-file"),
                           (["--prompts-file", "p.txt", "--output", "out"], "--output goes with --ray"),
                           (["--prompts-file", "p.txt", "--format", "parquet"], "--format goes with --ray")]:
        assert main(["generate", *flags]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_row_that_fails_has_its_error_and_the_others_run(cluster, tmp_path):
    """A row whose generation fails in a worker (its prompt holds the one token the settings leave: every token
    banned for it) gets its error in the error column and nulls in the others; the dataset runs on, and every other
    row's completion is generate_batch's (issue 70)."""
    from gpt2numba.integrations.distributed import generate_dataset

    w = g.random_weights(TINY, seed=6)
    write_dir(w, tmp_path / "model")
    prompts = [[5, 6, 7], [8, 0, 9], [10, 11], [12], [0], [13, 14]]
    banned = {"no_repeat_ngram_size": 1, "bad_words_ids": [[t] for t in range(1, TINY.vocab_size)]}
    rows = sorted(generate_dataset(blocks([{"ids": ids, "id": i} for i, ids in enumerate(prompts)]),
                                   str(tmp_path / "model"), column="ids", max_new_tokens=1, temperature=0,
                                   concurrency=2, batch_size=2, **banned).take_all(), key=lambda r: r["id"])
    with pytest.raises(g.PartialBatchError) as raised:
        list(g.generate_batch(prompts, w, max_new_tokens=1, temperature=0, **banned))
    assert sorted(raised.value.errors) == [1, 4]
    assert [r["error"] is not None for r in rows] == [False, True, False, False, True, False]
    assert all(r["error"].startswith("SamplingError: every token is banned") for r in (rows[1], rows[4]))
    assert [r["completion_ids"] for r in rows] == [[0], None, [0], [0], None, [0]]

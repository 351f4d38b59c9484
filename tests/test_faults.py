"""One request's fault stays its own (issue 70). What a sequence's own work raises in a step (its sampling, its
constraint's matcher, its draft, whether it ends) fails that sequence alone, and every other sequence gets exactly
the tokens of a run without the fault: the library's batch functions raise PartialBatchError once the others are
done, carrying their results; the server fails that request alone (400 for a client's error, a 500 naming anything
else), its other choices cancelled, and its memory, queue and counters end as after a clean run.

Faults are planted (Faults: monkeypatched, for chosen prompts, from a generated position on); one is real (settings
that leave one prompt no token)."""

import collections
import concurrent.futures
import dataclasses
import json
import random

import numpy as np
import pytest

import gpt2numba as g
from conftest import TINY, TINY_GPT2
from gpt2numba.decoding import batching, processors, speculative
from gpt2numba.decoding.prefixes import BLOCK, PrefixCache
from gpt2numba.decoding.sample import Sampler

CONFIG = dataclasses.replace(TINY_GPT2, n_positions=128)


@dataclasses.dataclass(frozen=True)
class Planted:
    """A fault to raise for a prompt's sequences."""

    site: str  # "sample" (Sampler, Processors), "matcher", "draft" (prompt lookup, a model draft's start), "ends",
    # or "stop" (the server's handling of a token: its test plants it)
    at: int  # the generated position from which it raises
    error: type  # at "matcher", GrammarError is the real matcher's own: given a token it refuses


class Faults:
    """Faults planted for prompts: ``plan`` maps a prompt (a tuple of ids) to a Planted; a call at its site for a
    sequence of that prompt, at or past its position, raises (``fired`` holds the prompts it did so for)."""

    def __init__(self, monkeypatch):
        self.plan: dict[tuple, Planted] = {}
        self.fired: set[tuple] = set()
        faults = self
        call, probabilities, processed = Sampler.__call__, Sampler.probabilities, processors.Processors.__call__
        next_token, ends = batching.next_token, batching.Sequence.ends
        propose, start = speculative.PromptLookup.propose, speculative.ModelDraft._start

        def sampled(self, logits, previous, rng, prompt_len=0, allowed=None):
            faults.check("sample", previous[:prompt_len], len(previous) - prompt_len)
            return call(self, logits, previous, rng, prompt_len, allowed)

        def distribution(self, logits, previous, prompt_len=0):
            faults.check("sample", previous[:prompt_len], len(previous) - prompt_len)
            return probabilities(self, logits, previous, prompt_len)

        def process(self, z, ids, prompt_len):  # (beam search's sampling)
            faults.check("sample", ids[:prompt_len], len(ids) - prompt_len)
            return processed(self, z, ids, prompt_len)

        def chosen(sampler, logits, ids, rng, prompt_len, matcher):
            planted = faults.due("matcher", ids[:prompt_len], len(ids) - prompt_len) if matcher is not None else None
            if planted is not None and planted.error is g.GrammarError:
                matcher.advance(int(np.flatnonzero(~matcher.allowed())[0]))  # (raises)
            elif planted is not None:
                raise planted.error("planted matcher fault")
            return next_token(sampler, logits, ids, rng, prompt_len, matcher)

        def ended(self, token):
            faults.check("ends", self.ids[:self.prompt_len], self.new_tokens - 1)
            return ends(self, token)

        def looked_up(self, ids, k, sampler, rng, prompt_len):
            faults.check("draft", ids[:prompt_len], len(ids) - prompt_len)
            return propose(self, ids, k, sampler, rng, prompt_len)

        def started(self, ids, k):
            prompt = next((p for p in faults.plan if tuple(ids[:len(p)]) == p), ())
            faults.check("draft", prompt, len(ids) - len(prompt))
            return start(self, ids, k)

        monkeypatch.setattr(Sampler, "__call__", sampled)
        monkeypatch.setattr(Sampler, "probabilities", distribution)
        monkeypatch.setattr(processors.Processors, "__call__", process)
        monkeypatch.setattr(batching, "next_token", chosen)
        monkeypatch.setattr(batching.Sequence, "ends", ended)
        monkeypatch.setattr(speculative.PromptLookup, "propose", looked_up)
        monkeypatch.setattr(speculative.ModelDraft, "_start", started)

    def due(self, site: str, prompt, position: int) -> Planted | None:
        """The fault planted at ``site`` for ``prompt``, if ``position`` (of the token being chosen) has reached it."""
        prompt = tuple(prompt)
        planted = self.plan.get(prompt)
        if planted is None or planted.site != site or position < planted.at:
            return None
        self.fired.add(prompt)
        return planted

    def check(self, site: str, prompt, position: int) -> None:
        if (planted := self.due(site, prompt, position)) is not None:
            raise planted.error(f"planted {site} fault")


@pytest.fixture(scope="module")
def model():
    return g.random_weights(CONFIG, seed=5), g.load_tokenizer()


PROMPTS = [[464, 3290, 286], [11, 12, 13, 11, 12], [7454, 2402, 257, 640], [15496, 995], [40, 1101, 257, 3797, 13],
           [818, 262, 3726]]
REGEX = "[a-z]{2,5}( [a-z]{2,5}){0,4}"


def tokens_of(prompts, w, **settings) -> tuple[list[list[int]], g.PartialBatchError | None]:
    """generate_batch's tokens of each sequence, and its PartialBatchError if it raised one."""
    out = [[] for _ in range(len(prompts) * settings.get("n", 1))]
    try:
        for i, token in g.generate_batch(prompts, w, **settings):
            out[i].append(token)
    except g.PartialBatchError as e:
        return out, e
    return out, None


BANNED = {"no_repeat_ngram_size": 1, "bad_words_ids": [[t] for t in range(1, TINY.vocab_size)]}  # (0 alone left)


def test_settings_that_leave_one_prompt_no_token_fail_it_alone(tiny):
    """A real fault, nothing planted: every token but 0 banned, and no token twice (no_repeat_ngram_size 1): the
    prompts that hold 0 have no token left (SamplingError), the others' is 0. The failed prompts' slots take the
    prompts waiting (batch_size 2 of 6), and PartialBatchError names them. Catches: the SamplingError ending the
    whole batch (was), a failed sequence left in its slot (the waiting ones would never start)."""
    rng = np.random.default_rng(70)
    prompts = [rng.integers(1, TINY.vocab_size, 5).tolist() for _ in range(6)]
    prompts[1][2] = prompts[4][0] = 0
    got, error = tokens_of(prompts, tiny, max_new_tokens=1, batch_size=2, seed=1, **BANNED)
    assert error is not None and sorted(error.errors) == [1, 4] and error.total == 6 and error.results is None
    assert all(isinstance(e, g.SamplingError) and "every token is banned" in str(e) for e in error.errors.values())
    assert str(error).startswith("2 of 6 failed (1, 4), the others finished; 1: SamplingError: every token is banned")
    assert got == [[0], [], [0], [0], [], [0]]


CASES = [  # (site, error, settings): where the fault is planted, what it raises, the generation's settings
    ("sample", g.SamplingError, {"seed": 3, "top_k": 40}),
    ("sample", RuntimeError, {"temperature": 0, "draft": "int4", "num_speculative_tokens": 2}),  # greedy drafts
    ("sample", RuntimeError, {"seed": 3, "prompt_lookup_num_tokens": 3}),  # sampled: Sampler.probabilities
    ("draft", RuntimeError, {"temperature": 0, "prompt_lookup_num_tokens": 3}),
    ("draft", g.SamplingError, {"temperature": 0, "draft": "int8"}),  # a model draft's start
    ("matcher", g.GrammarError, {"seed": 3, "constraints": [1, 1, 0, 0, 1, 0]}),  # (1: REGEX)
    ("matcher", RuntimeError, {"temperature": 0, "constraints": [0, 1, 0, 1, 1, 1]}),
    ("ends", RuntimeError, {"seed": 3, "n": 2}),
]


@pytest.mark.parametrize("site, error, settings", CASES, ids=[f"{c[0]}-{c[1].__name__}" for c in CASES])
def test_a_planted_fault_fails_its_prompt_alone(model, monkeypatch, site, error, settings):
    """Prompts 1 (from its second token) and 4 (from its fourth) fail where planted, 3 at a time in flight: every other
    sequence's tokens are a clean run's (the same draws, drafts and caches), a failed one's a start of its own,
    and PartialBatchError names them with their errors. Catches: the fault ending the batch (was), a fault in one
    sequence's draft failing the others drafted with it, a failed sequence's draws or rows taken by another."""
    w, _ = model
    settings = dict(max_new_tokens=8, batch_size=3, stop_at_eos=False, **settings)
    if "constraints" in settings:
        pytest.importorskip("llguidance", reason="structured output needs the [structured] extra")
        regex = g.constraint(regex=REGEX, vocab_size=CONFIG.vocab_size)
        settings["constraints"] = [regex if c else None for c in settings["constraints"]]
    clean, none = tokens_of(PROMPTS, w, **settings)
    faults = Faults(monkeypatch)
    faults.plan = {tuple(PROMPTS[1]): Planted(site, 1, error), tuple(PROMPTS[4]): Planted(site, 3, error)}
    got, raised = tokens_of(PROMPTS, w, **settings)
    n = settings.get("n", 1)
    failed = [i for p in (1, 4) for i in range(p * n, p * n + n)]
    assert none is None and raised is not None and sorted(raised.errors) == failed
    assert all(type(e) is error for e in raised.errors.values())
    assert f"{len(failed)} of {len(PROMPTS) * n} failed ({', '.join(map(str, failed))})" in str(raised)
    for i, (mine, theirs) in enumerate(zip(got, clean)):
        if i in failed:
            assert mine == theirs[:len(mine)] and len(mine) < len(theirs)
        else:
            assert mine == theirs, i


def test_generate_text_batch_carries_the_others_texts(model, monkeypatch):
    w, tok = model
    texts = ["Hello world", "Once upon a time", "The cat"]
    clean = g.generate_text_batch(texts, w, max_new_tokens=6, seed=2)
    Faults(monkeypatch).plan = {tuple(tok.encode(texts[1])): Planted("sample", 2, g.SamplingError)}
    with pytest.raises(g.PartialBatchError, match=r"1 of 3 failed \(1\).*SamplingError: planted sample") as raised:
        g.generate_text_batch(texts, w, max_new_tokens=6, seed=2)
    assert raised.value.results == [clean[0], None, clean[2]]


def test_beam_search_batch_fails_one_prompt_alone(model, monkeypatch):
    """A prompt whose search fails at its third token: the others' hypotheses (ids and scores) are a clean run's,
    its place in PartialBatchError.results None; beam_search of that prompt alone raises its own error."""
    w, _ = model
    settings = dict(num_beams=3, max_new_tokens=5, num_return_sequences=2)
    clean = g.beam_search_batch(PROMPTS[:4], w, **settings)
    Faults(monkeypatch).plan = {tuple(PROMPTS[2]): Planted("sample", 2, RuntimeError)}
    with pytest.raises(g.PartialBatchError, match=r"1 of 4 failed \(2\).*RuntimeError: planted") as raised:
        g.beam_search_batch(PROMPTS[:4], w, **settings)
    got = raised.value.results
    assert got[2] is None and [[h.ids for h in hs] for hs in got[:2] + got[3:]] == [
        [h.ids for h in hs] for hs in clean[:2] + clean[3:]]
    assert [h.score for hs in got[:2] + got[3:] for h in hs] == pytest.approx(  # (a pass of fewer rows rounds
        [h.score for hs in clean[:2] + clean[3:] for h in hs], rel=1e-6)       # otherwise)
    assert isinstance(raised.value.errors[2], RuntimeError)
    with pytest.raises(RuntimeError, match="planted sample fault"):
        g.beam_search(PROMPTS[2], w, **settings)


def test_a_fault_leaves_the_batch_as_a_finished_sequence_does(model, monkeypatch):
    """In its step the failed sequence is a Fault (with its error) and has left the batch, its cache gone and its
    reservation released; the two sequences sharing a prompt (one prefilled it, the other reads its rows) and the
    prefix cache they filled go on as in a clean run, and once they are done nothing is reserved or held."""
    w, _ = model
    prompt = list(range(300, 300 + 2 * BLOCK + 1))

    def run(plan):
        Faults(monkeypatch).plan = plan
        prefixes = PrefixCache(CONFIG, 2**24)
        batch = batching.Batch(w, 4, prefixes, max_positions=1000)
        shared = batching.SharedPrompt(2)
        seqs = [batch.add(ids, max_new_tokens=4, sampler=Sampler(0.8), rng=np.random.default_rng(i), shared=both)
                for i, (ids, both) in enumerate([(prompt, shared), (prompt, shared), (PROMPTS[0], None)])]
        faults = []
        while batch.sequences:
            for out in batch.step():
                if isinstance(out, batching.Fault):
                    assert out.sequence.cache is None and out.sequence not in batch.sequences
                    assert batch.reserved == sum(s.reserved for s in batch.sequences)
                    faults.append((seqs.index(out.sequence), str(out.error)))
        assert batch.reserved == 0 and batch.positions() == (0, 0) and len(prefixes) == 2
        return [s.ids for s in seqs], faults

    clean, none = run({})
    got, faults = run({tuple(PROMPTS[0]): Planted("sample", 1, RuntimeError)})
    assert none == [] and faults == [(2, "planted sample fault")]
    assert got[:2] == clean[:2] and got[2] == clean[2][:len(PROMPTS[0]) + 1]


def test_a_ray_worker_writes_a_failed_row_s_error(tiny, monkeypatch):
    """generate_dataset's worker (called here, without a cluster): a row whose generation fails has its error in
    the error column and nulls in the others, and the other rows are as without it; sampling (the prompt with 0
    has no token left) and beam search with log-probabilities (a planted fault)."""
    pa = pytest.importorskip("pyarrow")
    from gpt2numba.integrations import distributed

    worker = distributed._Generator.__new__(distributed._Generator)  # (__init__ loads weights and sets threads)
    worker.w, worker.tokenizer = tiny, g.load_tokenizer()
    prompts = [[5, 6, 7], [8, 0, 9], [10, 11]]
    table = pa.table({"ids": prompts, "id": [0, 1, 2]})
    worker.job = distributed._generation(None, "ids", 1, 1, 1, 2, False, True, None, "float32", "float32",
                                         "float32", dict(BANNED))
    rows = worker(table).to_pylist()
    assert [r["error"] for r in rows] == [None, "SamplingError: " + str(g.SamplingError(
        "every token is banned (bad_words_ids, no_repeat_ngram_size, logit_bias, min_new_tokens)")), None]
    assert [r["completion_ids"] for r in rows] == [[[0], [0]], None, [[0], [0]]]
    assert rows[1]["completion"] is rows[1]["finish_reason"] is None and rows[0]["finish_reason"] == ["length"] * 2

    worker.job = distributed._generation(None, "ids", 3, None, 2, 2, True, True, None, "float32", "float32",
                                         "float32", {})
    clean = worker(table).to_pylist()
    Faults(monkeypatch).plan = {tuple(prompts[0]): Planted("sample", 1, RuntimeError)}
    rows = worker(table).to_pylist()
    assert [r["error"] for r in rows] == ["RuntimeError: planted sample fault", None, None]
    assert rows[0]["completion_ids"] is rows[0]["logprobs"] is rows[0]["score"] is None
    assert [r["completion_ids"] for r in rows[1:]] == [r["completion_ids"] for r in clean[1:]]
    assert all(r["error"] is None for r in clean) and all(len(r["logprobs"]) == 2 for r in rows[1:])



class _Dataset:
    """What generate --ray uses of a Ray dataset, over a pyarrow table in hand: map_batches runs the real worker
    on the table, here (its weights the test's)."""

    def __init__(self, table, w=None):
        self.table, self.w = table, w

    def map_batches(self, worker, fn_constructor_args, **_):
        generator = worker.__new__(worker)  # (its __init__ loads weights and sets the process's threads)
        generator.w, generator.tokenizer, generator.job = self.w, g.load_tokenizer(), fn_constructor_args[-1]
        return _Dataset(generator(self.table))

    def materialize(self):
        return self

    def iter_rows(self):
        return iter(self.table.to_pylist())

    def iter_batches(self, batch_size=None, batch_format="pyarrow"):
        yield self.table


def test_the_generate_command_writes_a_failed_prompt_s_error_and_exits_1(model, monkeypatch, tmp_path, capsys):
    """generate --prompts-file, in-process and --ray (its workers run here, on a table: no cluster), sampling 2
    samples a prompt and beam search: the prompt whose work fails gets records with its error in place of the
    text, the others are a clean run's, both paths write the same records, and the command exits 1 after them
    naming the prompt. Catches: --ray's records() failing on the row's null completions (was: TypeError), the
    failed prompt left without a record in-process (was) and every record lost with beam search (was), the error
    naming sequences (was: "2 of 6 failed (2, 3)"), an exit 0."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("ray")
    import contextlib
    import types

    import pyarrow as pa

    from checkpoints import write_dir
    from gpt2numba.cli import main
    from gpt2numba.integrations import distributed

    w, tok = model
    write_dir(w, tmp_path / "model")
    texts = ["Hello world", "Once upon a time", "The cat"]
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    command = ["generate", "--prompts-file", str(tmp_path / "p.txt"), "--max-new-tokens", "4"]
    ray = types.SimpleNamespace(data=types.SimpleNamespace(from_items=lambda rows: _Dataset(pa.Table.from_pylist(rows),
                                                                                          w)))

    @contextlib.contextmanager
    def cluster(address):
        yield ray

    monkeypatch.setattr(distributed, "cluster", cluster)
    monkeypatch.setattr(distributed, "_pool", lambda threads, concurrency, batch_size: (1, 1))

    def run(*flags):
        code = main([*command, *flags])
        out, err = capsys.readouterr()
        found = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: (r["index"], r.get("sample", 0)))
        return code, found, err

    for flags in (["--seed", "2", "--num-return-sequences", "2"], ["--num-beams", "2", "--num-return-sequences", "2"]):
        clean = run(*flags, "--model", str(tmp_path / "model"))
        faults = Faults(monkeypatch)
        faults.plan = {tuple(tok.encode(texts[1])): Planted("sample", 2, g.SamplingError)}
        in_process, on_ray = run(*flags, "--model", str(tmp_path / "model")), run(*flags, "--ray")
        faults.plan = {}
        assert clean[0] == 0 and in_process[0] == on_ray[0] == 1, (in_process[2], on_ray[2])
        assert in_process[1] == on_ray[1]
        failed = [r for r in in_process[1] if r["index"] == 1]
        error = {"prompt": texts[1], "error": "SamplingError: planted sample fault"}
        assert failed == ([{"index": 1, **error}] if "--num-beams" in flags else
                          [{"index": 1, "sample": j, **error} for j in range(2)])
        others = [r for r in in_process[1] if r["index"] != 1]
        assert [r for r in clean[1] if r["index"] != 1] == others and len(others) == len(clean[1]) - len(failed)
        for _, _, err in (in_process, on_ray):
            assert "gpt2numba: error: 1 of 3 prompts failed (1; their records say why), the others finished; " \
                   "1: SamplingError: planted sample fault" in err, err

# The server: requests of mixed settings to three servers (no draft; the model's int4 drafting two tokens; prompt
# lookup), all at once, first clean and then with faults planted in 40% of them.
SERVERS = [{}, {"draft": "int4", "num_speculative_tokens": 2}, {"prompt_lookup": 3}]
PER_SERVER = 100
SYSTEM = [list(range(1000, 1000 + BLOCK)), list(range(1100, 1100 + BLOCK))]  # prefixes many prompts share
ERRORS = {"sample": (g.SamplingError, RuntimeError), "matcher": (g.GrammarError, RuntimeError),
          "draft": (RuntimeError, g.SamplingError), "ends": (RuntimeError,), "stop": (RuntimeError,)}


def bodies(server: int, rng: random.Random) -> list[dict]:
    """PER_SERVER request bodies, each prompt of them unique (its last id): one or two prompts, greedy or sampled
    (seeded), n, best_of, streamed or not, log-probabilities, echo, a stop string, a constraint."""
    out = []
    for r in range(PER_SERVER):
        prompts = [(rng.choice(SYSTEM) if rng.random() < 0.6 else []) + [rng.randrange(2000, 3000) for _ in
                   range(rng.randrange(6))] + [10_000 + 1000 * server + 2 * r + k] for k in range(rng.choice((1, 1, 2)))]
        n = rng.choice((1, 1, 2, 3))
        body = {"prompt": prompts if len(prompts) > 1 else prompts[0], "max_tokens": rng.randint(2, 7), "n": n,
                "ignore_eos": rng.random() < 0.7}
        # (sampled with top_k: over GPT-2's whole vocabulary a draw is more likely to fall on a boundary that a
        # pass of other rows rounds otherwise; and not with a model draft, whose sampled tokens depend on them)
        sampled = server != 1 and rng.random() < 0.5
        body.update({"temperature": 0.9, "top_k": rng.randint(20, 60), "seed": r} if sampled else {"temperature": 0})
        if rng.random() < 0.2:
            body["best_of"] = n + 1
        elif rng.random() < 0.4:
            body.update(stream=True, stream_options={"include_usage": rng.random() < 0.5})
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 2)
        body.update({"echo": True} if rng.random() < 0.15 else {})
        body.update({"stop": ["e"]} if rng.random() < 0.15 else {})
        if rng.random() < 0.3:
            body.update(rng.choice([{"guided_regex": "[a-z]{2,5}( [a-z]{2,5}){0,3}"},
                                    {"guided_choice": ["yes", "no", "maybe so"]}]))
        out.append(body)
    return out


def prompts_of(body: dict) -> list[tuple]:
    return [tuple(p) for p in (body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]])]


def planted(bodies: list[dict], server: int, rng: random.Random) -> dict[tuple, Planted]:
    """A fault for one prompt of 40% of the requests: at a site its request reaches (its constraint's matcher, its
    draft more often than the others), from a position in its max_tokens."""
    plan = {}
    for body in bodies:
        if rng.random() < 0.6:
            continue
        constrained = "guided_regex" in body or "guided_choice" in body
        site = rng.choice(["sample", "ends", "stop"] + ["matcher"] * 3 * constrained
                          + ["draft"] * 3 * (server > 0 and not constrained))
        plan[rng.choice(prompts_of(body))] = Planted(site, rng.randrange(body["max_tokens"]), rng.choice(ERRORS[site]))
    return plan


def answer(client, body: dict) -> tuple[int, object]:
    """(The status, what the client got: each choice's pieces (text, finish reason, log-probabilities) by index
    and the usage, or the error object). A stream's status is its error's (its HTTP status is 200)."""
    r = client.post("/v1/completions", json=body)
    if not body.get("stream"):
        data = r.json()
        return r.status_code, data.get("error") or ([[(c["text"], c["finish_reason"], c["logprobs"])]
                                                     for c in data["choices"]], data["usage"])
    events = [json.loads(event[6:]) for event in r.text.split("\n\n") if event.startswith("data: {")]
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    if errors := [e["error"] for e in events if "error" in e]:
        return (400 if errors[0]["type"] == "invalid_request_error" else 500), errors[0]
    pieces = {}
    for choice in (c for e in events for c in e["choices"]):  # (a choice's pieces in order: the choices interleave)
        pieces.setdefault(choice["index"], []).append((choice["text"], choice["finish_reason"], choice["logprobs"]))
    return 200, ([pieces[i] for i in sorted(pieces)], [e["usage"] for e in events if e.get("usage")])


def test_planted_faults_fail_their_requests_alone(model, monkeypatch):
    """300 requests over three servers, with faults planted in 40% of them (sampling, a constraint's matcher, a
    draft, a sequence's end, the engine's handling of its tokens; a client's error or not), all sent at once:
    every request whose fault fired gets its error, naming it (a SamplingError or GrammarError a 400, anything else
    a 500 "internal error: RuntimeError: planted ..."), streamed or not; every other request (planted but not
    fired too) gets exactly a clean run's answer; the servers end with nothing in flight, reserved, queued or
    paused, a prefix cache within the clean run's, and counters that add up (statuses, requests served, tokens
    out). Catches: one request's fault failing the others in its step (was), a failed request's other choices
    left running or its reservations kept (the bound on positions would then hold the last requests for ever),
    a failed request counted as served, a 400 told as a 500."""
    pytest.importorskip("starlette", reason="the server needs the [serve] extra")
    pytest.importorskip("llguidance", reason="structured output needs the [structured] extra")
    from starlette.testclient import TestClient

    from gpt2numba import serve
    from gpt2numba.serve import jobs
    from test_serve_metrics import families, gauges, histogram, statuses, value
    from test_serve_speculative import _same

    w, tok = model
    faults = Faults(monkeypatch)
    delivered = collections.Counter()  # a request's first prompt -> tokens the engine handed it
    on_token = serve.Engine._on_token

    def handled(self, job, choice, token, done, row):  # (the engine's stop strings and log-probabilities)
        faults.check("stop", job.request.prompts[choice.prompt], choice.tokens)
        on_token(self, job, choice, token, done, row)
        delivered[tuple(job.request.prompts[0])] += 1

    monkeypatch.setattr(serve.Engine, "_on_token", handled)

    def run(settings: dict, requests: list[dict]):
        delivered.clear()
        position = g.ModelCache(CONFIG, 1).nbytes * (2 if "draft" in settings else 1)
        app = serve.create_app(w, tok, max_batch=6, kv_cache_mb=160 * position / 2**20, **settings)
        with TestClient(app) as client, concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda body: answer(client, body), requests))
            found = families(client.get("/metrics").text)
        engine = app.state.engine
        assert gauges(found) == (0, 0, 0, 0) and not engine.busy and engine.batch.reserved == 0
        assert engine.positions == (0, 0) and value(found, "gpt2numba_kv_cache_positions", kind="own") == 0
        assert engine.prefixes.evictions == 0
        assert value(found, "gpt2numba_generation_tokens", "gpt2numba_generation_tokens_total") == sum(
            delivered.values())
        return answers, found, set(engine.prefixes._index), dict(delivered)

    figures = collections.Counter()
    for server, settings in enumerate(SERVERS):
        rng = random.Random(70 + server)
        requests = bodies(server, rng)
        clean, clean_metrics, clean_blocks, clean_tokens = run(settings, requests)
        assert all(status == 200 for status, _ in clean) and statuses(clean_metrics) == {"200": PER_SERVER}
        plan = planted(requests, server, rng)
        faults.plan, faults.fired = plan, set()
        got, found, blocks, tokens = run(settings, requests)
        faults.plan = {}
        served = collections.Counter()
        for r, (body, (status, answered), (_, expected)) in enumerate(zip(requests, got, clean)):
            hit = [plan[p] for p in prompts_of(body) if p in faults.fired]  # (one prompt of a request is planted)
            first = prompts_of(body)[0]
            if not hit:
                assert status == 200 and _same(answered, expected), (server, r, body, answered, expected)
                assert tokens.get(first) == clean_tokens.get(first), (server, r)
            elif hit[0].error in jobs.CLIENT_ERRORS:
                assert status == 400 and answered["type"] == "invalid_request_error", (server, r, answered)
                assert answered["message"] == f"planted {hit[0].site} fault" or (
                    hit[0].error is g.GrammarError and "does not follow it" in answered["message"]), answered
            else:
                assert status == 500 and answered["type"] == "server_error", (server, r, answered)
                assert answered["message"] == f"internal error: RuntimeError: planted {hit[0].site} fault", answered
            served[str(status)] += 1
            figures.update(["fired", f"fired at {hit[0].site}"] if hit else [])
        assert statuses(found) == served  # (each request's status counted once)
        assert histogram(found, "gpt2numba_e2e_request_latency_seconds")[0] == served["200"]  # (served in full)
        assert blocks <= clean_blocks  # (a failed request's later prompts may not have run)
        figures["requests"] += PER_SERVER
        figures["planted"] += len(plan)
        figures["400"] += served["400"]
        figures["500"] += served["500"]
        figures["tokens out, clean"] += sum(clean_tokens.values())
        figures["tokens out"] += sum(tokens.values())
    print(dict(figures))
    assert figures["requests"] - figures["fired"] >= 150 and figures["fired"] >= 60  # (many of each kind)
    assert figures["400"] >= 12 and figures["500"] >= 30 and figures["planted"] > figures["fired"]
    assert all(figures[f"fired at {site}"] >= 5 for site in ERRORS)

"""Structured output (decoding/constraints.py): outputs valid by construction under JSON schemas, regexes, choices
and grammars; the mask exact; batches, beams and errors."""

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gpt2numba as g
from gpt2numba.decoding import constraints
from gpt2numba.decoding.constraints import Matcher

# GPT-2's vocabulary (a constraint's tokens are the tokenizer's) on a model small enough to sample fast
SMALL = g.GPT2Config(n_layer=1, n_head=2, n_embd=64, n_positions=200, vocab_size=50257)
EOT = 50256


@pytest.fixture(scope="module")
def w():
    return g.random_weights(SMALL, seed=4)


@pytest.fixture(scope="module")
def tok():
    return g.load_tokenizer()


def finished(tokens, c, max_new_tokens):
    """Whether a generation under ``c`` ended because its text was complete ("stop"), not at max_new_tokens;
    and asserts what holds either way: a cut text is a prefix the grammar accepts."""
    m = Matcher(c)
    for t in tokens:
        m.advance(t)  # raises GrammarError for a token the grammar does not allow
    stop = m.done
    assert stop or len(tokens) == max_new_tokens
    return stop


def text_of(tokens, tok):
    return tok.decode([t for t in tokens if t != EOT])


# --- schemas, drawn ----------------------------------------------------------------------------------------

def _leaf():
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 300)).map(
        lambda b: {"type": "integer", "minimum": b[0], "maximum": b[0] + b[1]})
    number = st.just({"type": "number", "minimum": -10, "maximum": 10})
    string = st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n})
    enum = st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values})
    return st.one_of(integer, number, string, enum, st.just({"type": "boolean"}))


def _object(children):
    names = st.lists(st.text("abcdefgh", min_size=1, max_size=6), min_size=1, max_size=4, unique=True)
    return names.flatmap(lambda keys: st.tuples(st.just(keys), st.lists(children, min_size=len(keys),
                                                                        max_size=len(keys)),
                                                st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
                         ).map(lambda t: {"type": "object", "properties": dict(zip(t[0], t[1])),
                                          "required": [k for k, r in zip(t[0], t[2]) if r],
                                          "additionalProperties": False})


SCHEMAS = st.recursive(_leaf(), lambda children: st.one_of(
    _object(children), children.map(lambda item: {"type": "array", "items": item, "maxItems": 3})), max_leaves=6)


@settings(max_examples=15)
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_every_finished_output_is_valid_json_of_its_schema(w, tok, schema, seed):
    c = g.constraint(json_schema=schema)
    tokens = list(g.generate(tok.encode("Data:"), w, max_new_tokens=120, seed=seed, json_schema=schema))
    if finished(tokens, c, 120):
        jsonschema.validate(json.loads(text_of(tokens, tok)), schema)


_REGEXES = st.lists(st.sampled_from([r"[a-z]{1,5}", r"[0-9]{2}", r"(yes|no)", r"-", r"[A-F0-9]+", r" ", r"x?",
                                     r"(ab|cd){1,3}", r"\.", r"[^a-z\n]{1,3}"]), min_size=1, max_size=5)


@settings(max_examples=15)
@given(parts=_REGEXES, seed=st.integers(0, 2**16))
def test_every_finished_output_matches_its_regex_in_full(w, tok, parts, seed):
    regex = "".join(parts)
    c = g.constraint(regex=regex)
    tokens = list(g.generate(tok.encode("Code:"), w, max_new_tokens=40, seed=seed, regex=regex))
    if finished(tokens, c, 40):
        assert re.fullmatch(regex, text_of(tokens, tok), flags=re.DOTALL), (regex, text_of(tokens, tok))


def test_choices_and_grammars(w, tok):
    options = ["red", "green", "light blue", "{\"x\": 1}"]
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] [0-9]? [0-9]?'
    for seed in range(6):
        text = "".join(g.generate_text("Pick:", w, max_new_tokens=20, seed=seed, choice=options))
        assert text in options
        for grammar in (lark, gbnf):
            tokens = list(g.generate(tok.encode("Tuple:"), w, max_new_tokens=30, seed=seed, grammar=grammar))
            if finished(tokens, g.constraint(grammar=grammar), 30):
                assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text_of(tokens, tok))


# --- the mask ------------------------------------------------------------------------------------------------

def _places(tok):
    """Matchers at several places in a schema's text: after each token of a valid text."""
    c = g.constraint(json_schema={"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
                                  "required": ["n", "s"], "additionalProperties": False})
    m = Matcher(c)
    places = [m.fork()]
    for t in tok.encode('{"n":-12,"s":"ab c"}'):
        m.advance(t)
        places.append(m.fork())
    return places


def test_the_mask_is_what_the_grammar_accepts(tok):
    """Every token the mask allows the grammar takes, and a sample of the others it refuses (llguidance's own
    acceptance of the token, on a copy)."""
    rng = np.random.default_rng(0)
    for m in _places(tok):
        allowed = m.allowed()
        assert allowed.shape == (50257,) and allowed.any()
        ids = np.flatnonzero(allowed)
        for t in rng.choice(ids, min(ids.size, 40), replace=False):
            m.fork().advance(t)
        for t in rng.choice(np.flatnonzero(~allowed), 40, replace=False):
            with pytest.raises(g.GrammarError, match="json_schema: token .* does not follow it"):
                m.fork().advance(t)


@pytest.mark.parametrize("settings_", [
    {"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.7, "top_k": 50}, {"temperature": 0.9, "top_k": 1},
    {"temperature": 1.3, "top_k": 20000}, {"temperature": 1.0, "top_p": 0.9, "repetition_penalty": 1.3},
    {"temperature": 0.8, "min_p": 0.05}, {"temperature": 1.0, "typical_p": 0.7, "presence_penalty": 1.0}])
@pytest.mark.parametrize("ties", [False, True])
def test_masked_sampling_is_sampling_from_minus_infinity_outside(tok, settings_, ties):
    """The Sampler with a mask picks exactly what it picks from logits that are -inf outside the mask: the
    same token from the same random stream, greedy ties (logits rounded to whole numbers) to the lower id."""
    sampler = g.Sampler(**settings_)
    rng = np.random.default_rng(1)
    for m in _places(tok):
        allowed = m.allowed()
        logits = rng.standard_normal(50257).astype(np.float32) * 3
        if ties:
            logits = np.round(logits)
        previous = list(rng.integers(0, 50257, 5))
        masked = np.where(allowed, logits, -np.inf)
        for seed in range(5):
            got = sampler(logits, previous, np.random.default_rng(seed), 2, allowed)
            assert allowed[got]
            assert got == sampler(masked, previous, np.random.default_rng(seed), 2)


def test_a_mask_of_one_token_chooses_it():
    """Even where the processors banned it (min_new_tokens against the grammar's end of text): the grammar wins.
    A mask that is not a bool mask of the logits' shape is refused."""
    allowed = np.zeros(50257, bool)
    allowed[EOT] = True
    sampler = g.Sampler(min_new_tokens=5)
    assert sampler(np.zeros(50257, np.float32), [1], np.random.default_rng(0), 1, allowed) == EOT
    for bad in (np.array([3, 7]), allowed[:100], list(allowed)):
        with pytest.raises(g.SamplingError, match="allowed must be a bool mask"):
            sampler(np.zeros(50257, np.float32), [1], np.random.default_rng(0), 1, bad)


def test_most_texts_finish(w, tok):
    """Seeded, at temperature 1, a small schema and a bounded regex end with their text complete far more often
    than not (the properties above would pass if nothing ever finished)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "s": {"type": "string", "maxLength": 5}},
              "required": ["n", "s"], "additionalProperties": False}
    for kind in ({"json_schema": schema}, {"regex": r"[a-c]{2,4}-[0-9]{1,2}"}):
        c = g.constraint(**kind)
        done = [finished(list(g.generate(tok.encode("x:"), w, max_new_tokens=60, seed=seed, **kind)), c, 60)
                for seed in range(10)]
        assert sum(done) >= 8, (kind, done)


def test_a_mask_that_leaves_nothing_is_named(tok):
    c = g.constraint(choice=["ab", "cd"])
    allowed = Matcher(c).allowed()
    assert allowed.sum() > 1
    banned = tuple((int(t),) for t in np.flatnonzero(allowed))  # every allowed token banned: nothing is left
    with pytest.raises(g.SamplingError, match="the constraint"):
        g.Sampler(bad_words_ids=banned)(np.zeros(50257, np.float32), [], np.random.default_rng(0), 0, allowed)


# --- batches and beams ---------------------------------------------------------------------------------------

def test_a_batch_of_mixed_constraints_is_each_alone(w, tok):
    kinds = [{"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
                              "required": ["a", "b"]}},
             {"regex": r"[a-z]{3,8}"}, {}, {"choice": ["red", "green", "blue"]},
             {"grammar": 'start: "<" /[0-9]+/ ">"'}]
    prompts = [tok.encode(t) for t in ("JSON:", "word:", "free", "color:", "num:")]
    each = [g.constraint(**kind) for kind in kinds]
    for settings_ in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        out = [[] for _ in prompts]
        for i, t in g.generate_batch(prompts, w, max_new_tokens=25, batch_size=3, constraints=each, **settings_):
            out[i].append(t)
        for tokens, c in zip(out, each):
            if c is not None:
                finished(tokens, c, 25)
    # greedy: each sequence's tokens are its own alone (sampled ones draw from streams of their own)
    greedy = [list(g.generate(p, w, max_new_tokens=25, temperature=0, **kind)) for p, kind in zip(prompts, kinds)]
    batch = [[] for _ in prompts]
    for i, t in g.generate_batch(prompts, w, max_new_tokens=25, batch_size=3, constraints=each, temperature=0):
        batch[i].append(t)
    assert batch == greedy


def test_n_samples_of_a_prompt_each_follow_the_constraint(w, tok):
    texts = g.generate_text_batch(["Colour:", "Size:"], w, max_new_tokens=10, n=3, seed=2,
                                  choice=["red", "green", "small", "large"])
    assert len(texts) == 6 and set(texts) <= {"red", "green", "small", "large"}


def test_beams_under_a_constraint(w, tok):
    found = g.beam_search_batch([tok.encode("A:"), tok.encode("B:")], w, num_beams=3, max_new_tokens=12,
                                num_return_sequences=2, constraints=[g.constraint(regex=r"[0-9]{2,3}"),
                                                                     g.constraint(choice=["yes", "no", "n/a"])])
    assert all(re.fullmatch(r"[0-9]{2,3}", text_of(h.ids, tok)) for h in found[0])
    assert all(text_of(h.ids, tok) in {"yes", "no", "n/a"} for h in found[1]) and found[1]
    # fewer valid texts than beams: only those are returned
    assert len(g.beam_search(tok.encode("x"), w, num_beams=4, max_new_tokens=4, num_return_sequences=4,
                             choice=["A", "B"])) == 2
    # texts of several tokens, more beams than texts: no beam ruled out comes back as a hypothesis
    options = ["yes indeed", "no way at all", "perhaps"]
    found = g.beam_search(tok.encode("x"), w, num_beams=4, max_new_tokens=8, num_return_sequences=4, choice=options)
    assert found and all(text_of(h.ids, tok) in options and h.score > -1e8 for h in found)


@pytest.mark.parametrize("kind", [{"choice": ["A", "B"]}, {"regex": "[ab]"}])
def test_a_beam_ruled_out_after_its_text_ended_never_comes_back(w, tok, kind):
    """Two one-token texts, four beams: each text ends its beam at the first step, and the beams run on at -_FAR
    (nothing else is left). With early_stopping "never" the search goes on (its bound is at max_new_tokens), and
    those beams' next tokens end them again: a beam ruled out must not come back as a hypothesis (a third and
    fourth of score near -_FAR / length, when _Beams.step keeps whatever is above -inf)."""
    found = g.beam_search(tok.encode("x"), w, num_beams=4, max_new_tokens=6, num_return_sequences=4,
                          early_stopping="never", **kind)
    assert len(found) == 2 and all(len(h.ids) == 1 and h.score > -1e8 for h in found), found


# --- what a caller can get wrong ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind, value, message", [
    ("json_schema", "{not json", "json_schema: not valid JSON"),
    ("json_schema", {"type": "nonsense"}, "json_schema: Invalid type: nonsense"),
    ("json_schema", [1, 2], "json_schema: must be a JSON object"),
    ("regex", "((", "(?s)regex: .*unclosed group"),
    ("regex", "", "regex: must be a non-empty string"),
    ("regex", "a{0}", "regex: matches no text but the empty one"),
    ("regex", "[a&&b]", "regex: matches no text"),
    ("choice", [], "choice: must be a non-empty list of strings"),
    ("choice", "yes", "choice: must be a non-empty list of strings"),
    ("choice", ["a", 3], "choice: entry 1 must be a non-empty string"),
    ("grammar", "start: undefined_rule", "(?s)grammar: .*unknown name"),
    ("grammar", "root ::= missing", "grammar: not a GBNF grammar llguidance can read"),
])
def test_bad_constraints_are_named(w, tok, kind, value, message):
    with pytest.raises(g.GrammarError, match=message):
        g.constraint(**{kind: value})
    with pytest.raises(g.GrammarError, match=message):  # before any work
        g.generate([1, 2], w, max_new_tokens=3, **{kind: value})


def test_one_constraint_at_a_time(w):
    with pytest.raises(g.GrammarError, match="at most one of json_schema, regex, choice, grammar; got regex and choice"):
        g.generate([1], w, max_new_tokens=2, regex="a", choice=["b"])
    with pytest.raises(g.GrammarError, match="not both"):
        list(g.generate_batch([[1]], w, max_new_tokens=2, regex="a", constraints=[None]))
    with pytest.raises(g.GrammarError, match="a list of 2 entries"):
        list(g.generate_batch([[1], [2]], w, max_new_tokens=2, constraints=[None]))
    with pytest.raises(g.GrammarError, match="constraints: entry 0 must be a Constraint"):
        list(g.generate_batch([[1]], w, max_new_tokens=2, constraints=[{"regex": "a"}]))


def test_a_vocabulary_smaller_than_the_tokenizer(tok):
    tiny = g.random_weights(g.GPT2Config(n_layer=1, n_head=1, n_embd=8, n_positions=8, vocab_size=300), seed=0)
    with pytest.raises(g.ConfigError, match="model's vocabulary \\(300\\) to hold the tokenizer's 50257"):
        g.generate([1], tiny, max_new_tokens=2, regex="a")


def test_a_grammar_compiled_for_one_tokenizer_is_not_another_s():
    first = g.constraint(regex="tok[0-9]", tokenizer=g.load_tokenizer())
    other = g.Tokenizer(g.load_tokenizer().encoding, "another")  # (the same vocabulary, another tokenizer)
    assert g.constraint(regex="tok[0-9]", tokenizer=other) is not first
    assert g.constraint(regex="tok[0-9]", tokenizer=g.load_tokenizer()) is first


def test_compiled_grammars_are_cached_and_bounded():
    first = g.constraint(regex=r"cache[0-9]+")
    assert g.constraint(regex=r"cache[0-9]+") is first
    for i in range(constraints.CACHE_SIZE + 3):
        g.constraint(regex=f"bound{i}")
    assert constraints.cached() == constraints.CACHE_SIZE
    assert g.constraint(regex=r"cache[0-9]+") is not first  # dropped, the least recently used


def test_without_llguidance_the_extra_is_named(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(g.GrammarError, match=r"needs llguidance: pip install -e \"\.\[structured\]\""):
        g.constraint(regex="never compiled before")
    assert g.constraint() is None  # no constraint asked: nothing to import

"""Structured output through POST /v1/completions (issue 56): OpenAI's response_format, vLLM's guided_* fields and
llama.cpp's json_schema and grammar, streamed or not, with n and best_of; each answer against the library's on the
same weights, and each bad field a 400 naming it. In-process (Starlette's TestClient)."""

import dataclasses
import json
import re

import jsonschema
import pytest

import gpt2numba as g
from conftest import TINY_GPT2

pytest.importorskip("starlette", reason="the server needs the [serve] extra")

from starlette.testclient import TestClient  # noqa: E402

from gpt2numba import serve  # noqa: E402

CONFIG = dataclasses.replace(TINY_GPT2, n_positions=160)
PROMPT = "Answer:"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    return g.random_weights(CONFIG, seed=5), g.load_tokenizer()


@pytest.fixture(scope="module")
def client(model):
    w, tok = model
    with TestClient(serve.create_app(w, tok, max_batch=4, max_grammar_bytes=400)) as c:
        yield c


def complete(client, **body):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 100, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"]


@pytest.mark.parametrize("field", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
    {"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)}, {"json_schema": SCHEMA}])
def test_every_schema_field_gives_the_library_s_json(client, model, field):
    w, tok = model
    choices = complete(client, temperature=0, **field)
    tokens = list(g.generate(tok.encode(PROMPT), w, max_new_tokens=100, temperature=0, json_schema=SCHEMA))
    assert choices[0]["text"] == tok.decode(tokens) and choices[0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choices[0]["text"]), SCHEMA)


def test_json_object_mode_and_text(client):
    for choice in complete(client, n=3, seed=1, max_tokens=150, response_format={"type": "json_object"}):
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["text"]), dict)
    assert complete(client, temperature=0, max_tokens=5, response_format={"type": "text"})[0]["finish_reason"] == \
        "length"


def test_regex_choice_and_grammars_with_n_best_of_and_streams(client):
    for choice in complete(client, n=3, best_of=5, seed=2, guided_regex=r"[0-9]{3}-[a-z]{2}"):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", choice["text"]) and choice["finish_reason"] == "stop"
    options = ["alpha", "beta", "gamma delta"]
    for choice in complete(client, n=4, seed=3, guided_choice=options):
        assert choice["text"] in options and choice["finish_reason"] == "stop"
    gbnf = 'root ::= "[" [0-9] [0-9]? "]"'
    for field in ({"grammar": gbnf}, {"guided_grammar": gbnf}, {"guided_grammar": 'start: "[" /[0-9]{1,2}/ "]"'}):
        for choice in complete(client, n=2, seed=4, **field):
            assert re.fullmatch(r"\[[0-9]{1,2}\]", choice["text"]) and choice["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100, "stream": True, "n": 2,
                                                         "seed": 5, "guided_json": SCHEMA}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for index in range(2):
        pieces = [c for e in events for c in e["choices"] if c["index"] == index]
        text = "".join(c["text"] for c in pieces)
        if pieces[-1]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)


def test_ignore_eos_and_min_tokens_under_a_constraint(client, model):
    """A constraint ends its text where the grammar does, ignore_eos or not, and min_tokens cannot keep open a
    text the grammar has ended (the grammar wins: "stop")."""
    w, tok = model
    for body in ({"ignore_eos": True}, {"min_tokens": 8}, {"ignore_eos": True, "min_tokens": 8}):
        for choice in complete(client, n=3, seed=6, guided_regex=r"[a-c]{1,3}", **body):
            assert re.fullmatch(r"[a-c]{1,3}", choice["text"]) and choice["finish_reason"] == "stop", (body, choice)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "guided_regex": "a{0}", "min_tokens": 1})
    assert r.status_code == 400 and "matches no text but the empty one" in r.json()["error"]["message"]


def test_a_cut_text_is_a_prefix_and_says_length(client, model):
    w, tok = model
    choice = complete(client, temperature=0, max_tokens=4, guided_json=SCHEMA)[0]
    assert choice["finish_reason"] == "length"
    matcher = g.decoding.constraints.Matcher(g.constraint(json_schema=SCHEMA))
    for t in tok.encode(choice["text"]):
        matcher.advance(t)


@pytest.mark.parametrize("body, param, message", [
    ({"guided_json": {"type": "bogus"}}, "guided_json", "guided_json: Invalid type: bogus"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json: not valid JSON"),
    ({"guided_regex": "(("}, "guided_regex", "guided_regex: at 1"),
    ({"guided_choice": []}, "guided_choice", "guided_choice: must be a non-empty list"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "guided_choice: entry 1 must be a non-empty string"),
    ({"grammar": "root ::= nothing"}, "grammar", "grammar: not a GBNF grammar"),
    ({"guided_grammar": "start: x"}, "guided_grammar", "guided_grammar: at 1"),
    ({"response_format": {"type": "yaml"}}, "response_format", 'response_format.type must be "text"'),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"guided_regex": "a", "json_schema": {}}, "json_schema", "at most one of response_format, guided_json"),
    ({"response_format": {"type": "text"}, "guided_regex": "(("}, "guided_regex", "guided_regex: "),
    ({"guided_regex": "x" * 500}, "guided_regex", "guided_regex is 500 bytes; this server takes at most 400 "
                                                  r"\(--max-grammar-bytes\)"),
    ({"guided_json": 3}, "guided_json", "guided_json must be an object or a JSON string"),
])
def test_bad_fields_are_a_400_naming_them(client, body, param, message):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error


def test_a_slow_grammar_is_refused(model):
    w, tok = model
    with TestClient(serve.create_app(w, tok, max_grammar_seconds=1e-9)) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "guided_regex": "[0-9]{2}x"})
    assert r.status_code == 400 and "(--max-grammar-seconds)" in r.json()["error"]["message"]

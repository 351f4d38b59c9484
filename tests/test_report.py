"""gpt2numba score --html: one self-contained HTML file, one span.tok per token in the tokenizer's order with the
inspection's data, nothing that reaches outside the file. The command run as a user types it (a subprocess).

Each test names the bug it catches; each was seen to fail once with that bug planted by hand.
"""

import base64
import hashlib
import html.parser
import json
import re
import subprocess
import sys

import pytest

import gpt2numba as g
from checkpoints import write_dir
from conftest import TINY_GPT2
from gpt2numba.text.tokenview import inspect_ids

DOCUMENTS = [
    "The café on the corner serves tea; see https://example.com/menu or http://example.org.",
    "日本語 and \"quotes\" & <tags> or </b> stay text.",  # split characters, and what HTML must escape
    " and".join(["long"] * 60),  # past TINY_GPT2's 63 tokens: cut to them
    "not in the report",
]
SHOWN = 3


class Report(html.parser.HTMLParser):
    """The report's documents: per article, its span.tok (attributes and text), and its scripts and style."""

    def __init__(self):
        super().__init__()
        self.documents, self.scripts, self.styles, self.attributes = [], [], [], []
        self._in = None  # ("tok", attrs) / ("script", attrs) / ("style", {}) while inside one

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.attributes.append((tag, attrs))
        if tag == "article":
            self.documents.append([])
        elif tag == "span" and attrs.get("class") == "tok":
            self._in = ("tok", attrs, [])
        elif tag in ("script", "style"):
            self._in = (tag, attrs, [])

    def handle_data(self, data):
        if self._in:
            self._in[2].append(data)

    def handle_endtag(self, tag):
        if self._in and tag == ("span" if self._in[0] == "tok" else self._in[0]):
            kind, attrs, text = self._in
            self._in = None
            {"tok": lambda: self.documents[-1].append((attrs, "".join(text))),
             "script": lambda: self.scripts.append((attrs, "".join(text))),
             "style": lambda: self.styles.append("".join(text))}[kind]()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The report of DOCUMENTS' first SHOWN (one a line), its text and parse, and the weights."""
    tmp = tmp_path_factory.mktemp("report")
    w = g.random_weights(TINY_GPT2, seed=4)
    write_dir(w, tmp / "model")
    (tmp / "corpus.txt").write_text("\n".join(DOCUMENTS) + "\n", encoding="utf-8")
    out = tmp / "report.html"
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "score", "--model", str(tmp / "model"), "--lines",
                        "--html", str(out), "--html-documents", str(SHOWN), str(tmp / "corpus.txt")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and f"{SHOWN} documents" in r.stderr
    text = out.read_text(encoding="utf-8")
    report = Report()
    report.feed(text)
    return w, text, report


def test_one_span_per_token_with_its_data(made):
    """Each of the first --html-documents documents: one span.tok per token (the first n_positions - 1 of a long
    one), in order, with the ids, ranks and log-probabilities of the library's inspection, each focusable, its
    text the token's. Catches a document left out or one too many, a token dropped, merged or out of order,
    ranks of another position, text not escaped (the parse would lose the <tags>)."""
    w, _, report = made
    tokenizer, limit = g.load_tokenizer(), TINY_GPT2.n_positions - 1
    assert len(report.documents) == SHOWN
    for text, spans in zip(DOCUMENTS, report.documents):
        ids = tokenizer.encode(text)[:limit]
        expected = inspect_ids(ids, w, tokenizer)
        assert [int(a["data-id"]) for a, _ in spans] == ids
        assert [int(a["data-rank"]) for a, _ in spans] == expected.ranks.tolist()
        assert [float(a["data-logprob"]) for a, _ in spans] == pytest.approx(expected.logprobs.tolist(), abs=1e-9)
        assert [body for _, body in spans] == expected.texts
        assert all(a["tabindex"] == "0" for a, _ in spans)
    assert "".join(body for _, body in report.documents[0]) == DOCUMENTS[0]
    assert len(tokenizer.encode(DOCUMENTS[2])) > limit and len(report.documents[2]) == limit


def test_the_embedded_inspections(made):
    """The JSON the tips read: each document's tokens as /v1/inspect lists them (five alternatives each)."""
    w, _, report = made
    data = json.loads(next(body for attrs, body in report.scripts if attrs.get("id") == "inspections"))
    assert len(data) == SHOWN
    tokenizer = g.load_tokenizer()
    first = inspect_ids(tokenizer.encode(DOCUMENTS[0]), w, tokenizer)
    assert data[0]["tokens"] == first.tokens() and data[0]["perplexity"] == pytest.approx(first.perplexity)
    assert all(len(t["top_logprobs"]) == 5 for d in data for t in d["tokens"])


def test_nothing_reaches_outside_the_file(made):
    """No http:// or https:// anywhere (a document's URL is written with its slashes as references), no src or
    href but the inline icon, no url() or @import in the style; the policy allows only the file's own style and
    scripts, by the hashes of what is inlined. Catches a CDN script or a web font, a URL in a document left as
    is, a view.js edited without the policy following (the browser would run none of it)."""
    _, text, report = made
    assert "http://" not in text and "https://" not in text
    assert "&#47;" in text  # the document's URLs, as text (test_one_span_per_token_with_its_data reads them back)
    links = [a.get("src") or a.get("href") for tag, a in report.attributes if "src" in a or "href" in a]
    assert links == ["data:,"]
    assert len(report.styles) == 1 and "url(" not in report.styles[0] and "@import" not in report.styles[0]
    policy = next(a["content"] for tag, a in report.attributes
                  if tag == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    assert policy.startswith("default-src 'none';")

    def digest(body):
        return "sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()

    executed = [body for attrs, body in report.scripts if attrs.get("type") != "application/json"]
    assert len(executed) == 2 and "TokenView" in executed[0]
    assert set(re.search(r"script-src ([^;]*);", policy).group(1).split()) == {f"'{digest(b)}'" for b in executed}
    assert re.search(r"style-src ([^;]*);", policy).group(1) == f"'{digest(report.styles[0])}'"


def test_html_refuses_ray(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    r = subprocess.run([sys.executable, "-m", "gpt2numba", "score", "--html", str(tmp_path / "r.html"), "--ray",
                        str(tmp_path / "a.txt")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "--html goes without --ray" in r.stderr
    assert not (tmp_path / "r.html").exists()


def test_titles_and_notes_are_text():
    """A heading with markup, an entity and a URL in it reads back as the same text, and leaves no http:// in the
    file. Catches a title or note written unescaped (GPT-2's tokens alone never make a tag: "<" and "/" are
    tokens of their own, so the documents above cannot show it)."""
    from gpt2numba.text.report import Document, html_report

    w, tokenizer = g.random_weights(TINY_GPT2, seed=4), g.load_tokenizer()
    title, note = 'a <b>bold</b> &amp; "q" from http://example.com', "cut <here> & there"
    text = html_report([Document(title, inspect_ids(tokenizer.encode("Hi"), w, tokenizer), note)], "<model>")
    texts = {}

    class Headings(html.parser.HTMLParser):
        tag = None

        def handle_starttag(self, tag, attrs):
            self.tag = tag

        def handle_endtag(self, tag):
            self.tag = None

        def handle_data(self, data):
            texts[self.tag] = texts.get(self.tag, "") + data

    Headings().feed(text)
    assert texts["h2"] == title and note in texts["p"] and "<model>" in texts["p"]
    assert "http://" not in text

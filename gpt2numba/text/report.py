"""gpt2numba score --html: documents' tokens coloured by probability or by rank, as one self-contained HTML file.

The playground's view (the package's view/ folder: view.css, view.js, inlined here with report.js) over the
span.tok elements this module writes, one a token with its data-id, data-rank and data-logprob, in the
tokenizer's order (a program can read them: issue 42's point 4); the inspections are embedded as JSON for
the tips. The file needs no server and asks for nothing: its policy allows only its own inline style and
scripts (by their hashes), and no "http://" appears in it even where a document has one (its slashes are
written as character references, and as \\/ in the JSON).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import html
import json
from pathlib import Path

from .tokenview import Inspection

REPORT_DOCUMENTS = 10  # documents a report shows by default (score --html-documents)
VIEW = Path(__file__).resolve().parent.parent / "view"  # the playground's files (package data)


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of a report: its heading, its inspection (None for an empty one), and a note (a cut)."""

    title: str
    inspection: Inspection | None
    note: str = ""


def html_report(documents: list[Document], model: str) -> str:
    """The report of ``documents`` under ``model`` (a description), as the text of one HTML file."""
    style, scripts = (VIEW / "view.css").read_text(), [(VIEW / name).read_text() for name in ("view.js", "report.js")]
    if any("</" in s for s in (style, *scripts)):  # (it would end its element early)
        raise ValueError("the view's CSS or JS holds '</': it cannot be inlined")
    hashes = " ".join(f"'{_hash(s)}'" for s in scripts)
    policy = (f"default-src 'none'; style-src '{_hash(style)}'; script-src {hashes}; img-src data:; "
              "base-uri 'none'; form-action 'none'")
    data = [None if d.inspection is None else {"tokens": d.inspection.tokens(), "perplexity": d.inspection.perplexity}
            for d in documents]
    tokens = sum(len(d.inspection.ids) for d in documents if d.inspection is not None)
    return "\n".join([
        "<!doctype html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">',
        f"<title>gpt2numba score: {_text(documents[0].title) if documents else 'no documents'}</title>",
        '<link rel="icon" href="data:,">', f"<style>{style}</style>", "</head>",
        '<body data-color-by="probability" class="report">', "<header>", "<h1>gpt2numba score</h1>",
        f'<p class="note">{len(documents)} documents, {tokens} tokens, under {_text(model)}; each token from '
        "&lt;|endoftext|&gt; and those before it. Hover or focus a token (Tab, then the arrow keys) for its "
        "probability, rank and the likeliest alternatives.</p>",
        '<label>Colour by <select id="color-by"><option value="probability">probability</option>'
        '<option value="rank">rank</option></select></label>', '<div id="legend" class="legend"></div>', "</header>",
        "<main>", *(_document(i, d) for i, d in enumerate(documents)), "</main>",
        '<div id="tip" class="tip" role="tooltip" hidden></div>',
        f'<script type="application/json" id="inspections">{_json(data)}</script>',
        *(f"<script>{s}</script>" for s in scripts), "</body>", "</html>", ""])


def _document(index: int, d: Document) -> str:
    head = f'<article class="document" data-index="{index}">\n<h2>{_text(d.title)}</h2>'
    note = f'\n<p class="note">{_text(d.note)}</p>' if d.note else ""
    if d.inspection is None:
        return f'{head}{note}\n<p class="note">(empty: no tokens)</p>\n</article>'
    return (f'{head}{note}\n<div class="tokens">{"".join(_span(t) for t in d.inspection.tokens())}</div>\n'
            f'<h3>Ranks</h3>\n<div class="ranks"></div>\n'
            f'<p>Perplexity: <span class="perplexity">{d.inspection.perplexity:.2f}</span></p>\n</article>')


def _span(token: dict) -> str:
    return (f'<span class="tok" data-id="{token["id"]}" data-rank="{token["rank"]}" '
            f'data-logprob="{token["logprob"]!r}" tabindex="0">{_text(token["text"])}</span>')


def _text(text: str) -> str:
    """Text for HTML: escaped, and its slashes as references (a URL in a document is text, never a reference)."""
    return html.escape(text).replace("/", "&#47;")


def _json(value) -> str:
    """JSON for a script element: nothing in it can end the element, and no "//" shows."""
    return (json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("/", "\\/"))


def _hash(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode()

"""The playground's drawing of a long inspection in headless Chromium (issue 42's target: first paint under 1 s).

    python profiling/studies/page_paint.py [--model DIR] [--tokens 1000] [--repeat 5] [--json out.json]

Starts `gpt2numba serve` on seeded random GPT-2 small (or --model), opens its page in Debian's headless Chromium
(Selenium, /usr/bin/chromedriver), has the page fetch POST /v1/inspect for a text of --tokens tokens, and then
times, inside the page, from the response's JSON in hand to the first frame painted after the page's own
TokenView.show drew it (one span a token, coloured, the histogram, the perplexity): performance.now() before
the call, and after two requestAnimationFrame callbacks (the second runs once the first frame is on screen).
Prints the median and the range over --repeat drawings, and the span count as a check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # profiling/, for serve_load
from serve_load import _free_port, _random_small, _wait  # noqa: E402

DRAW = """
const [text, done] = [arguments[0], arguments[arguments.length - 1]];
fetch("/v1/inspect", {method: "POST", headers: {"Content-Type": "application/json"},
                      body: JSON.stringify({text, top_logprobs: 5})})
  .then(r => r.json()).then(inspection => {
    const start = performance.now();
    TokenView.show({tokens: document.getElementById("view"), ranks: document.getElementById("ranks"),
                    perplexity: document.getElementById("perplexity")}, inspection, document.getElementById("tip"));
    requestAnimationFrame(() => requestAnimationFrame(() =>
      done({ms: performance.now() - start, spans: document.querySelectorAll("#view span.tok").length,
            tokens: inspection.tokens.length})));
  }).catch(e => done({error: String(e)}));
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: seeded random GPT-2 small)")
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    import gpt2numba as g

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else _random_small(Path(tmp))
        tokenizer = g.load_tokenizer(model)
        words = " ".join(f"word{i % 97} and" for i in range(args.tokens))
        text = tokenizer.decode(tokenizer.encode(words)[: args.tokens])
        port, log = _free_port(), Path(tmp) / "server.log"
        server = subprocess.Popen([sys.executable, "-m", "gpt2numba", "serve", "--model", str(model), "--port",
                                   str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT)
        options = webdriver.ChromeOptions()
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--disable-dev-shm-usage", f"--user-data-dir={tmp}/chrome", "--window-size=1280,900"):
            options.add_argument(flag)
        browser = None
        try:
            url = _wait(server, f"http://127.0.0.1:{port}", "/health", log)
            browser = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)
            browser.set_script_timeout(600)
            browser.get(url + "/")
            runs = [browser.execute_async_script(DRAW, text) for _ in range(args.repeat + 1)][1:]  # (a warm-up)
        finally:
            if browser is not None:
                browser.quit()
            server.terminate()
            server.wait(60)
    if any("error" in r for r in runs):
        raise SystemExit(f"the page failed: {runs}")
    ms = [r["ms"] for r in runs]
    print(f"{runs[0]['tokens']} tokens drawn ({runs[0]['spans']} span.tok), from the response's JSON to the first "
          f"frame painted: median {statistics.median(ms):.1f} ms (min {min(ms):.1f}, max {max(ms):.1f}) over "
          f"{len(ms)} drawings")
    if args.json:
        args.json.write_text(json.dumps({"tokens": runs[0]["tokens"], "spans": runs[0]["spans"], "ms": ms}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

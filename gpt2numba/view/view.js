/* The coloured view of a text's tokens, shared by the playground (GET /) and `gpt2numba score --html`.

   Every token is a span.tok carrying data-id, data-rank and data-logprob (the playground makes them from
   /v1/inspect's answer, the report has them written in the file). This file colours them by probability or
   by rank (GLTR's buckets: top 10, 100, 1000, beyond), shows a token's probability, rank and five likeliest
   alternatives in #tip on hover or focus, counts the ranks into a histogram and writes the legend. Nothing
   here asks the network for anything. */
"use strict";

const TokenView = (() => {
  const RANK_LIMITS = [10, 100, 1000];  // GLTR's: a rank up to 10, up to 100, up to 1000, beyond
  const RANK_NAMES = ["top 10", "top 100", "top 1000", "beyond"];
  const PROB_LIMITS = [0.5, 0.1, 0.01, 0.001];  // a probability of at least 50%, 10%, 1%, 0.1%, less
  const PROB_NAMES = ["≥ 50%", "10–50%", "1–10%", "0.1–1%", "< 0.1%"];
  const TIP_ALTERNATIVES = 5;
  const inspections = new WeakMap();  // a container of spans -> its tokens as /v1/inspect lists them

  const rankBucket = (rank) => {
    let b = 0;
    while (b < RANK_LIMITS.length && rank > RANK_LIMITS[b]) b++;
    return b;
  };
  const probBin = (logprob) => {
    const p = Math.exp(logprob);
    let b = 0;
    while (b < PROB_LIMITS.length && p < PROB_LIMITS[b]) b++;
    return b;
  };
  const percent = (logprob) => {
    const p = 100 * Math.exp(logprob);
    return p >= 1 ? `${p.toFixed(1)}%` : `${p.toPrecision(2)}%`;
  };
  // a token's text with its spaces, newlines and tabs made visible
  const visible = (text) => text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅";

  /** One span.tok per token, in order, into ``container`` (the playground's; the report's are in the file). */
  function spans(container, tokens) {
    container.replaceChildren(...tokens.map((token) => {
      const span = document.createElement("span");
      span.className = "tok";
      span.tabIndex = 0;
      span.dataset.id = token.id;
      span.dataset.rank = token.rank;
      span.dataset.logprob = token.logprob;
      span.textContent = token.text;
      return span;
    }));
  }

  /** Each span.tok of ``container`` gets its index, rank bucket and probability bin (which the CSS colours). */
  function colour(container) {
    container.querySelectorAll(".tok").forEach((span, i) => {
      span.dataset.index = i;
      span.dataset.bucket = rankBucket(Number(span.dataset.rank));
      span.dataset.pbin = probBin(Number(span.dataset.logprob));
    });
  }

  /** The histogram of ranks: four .bucket elements in ``box``, each with data-count and a bar. */
  function histogram(box, container) {
    const counts = RANK_NAMES.map(() => 0);
    container.querySelectorAll(".tok").forEach((span) => { counts[rankBucket(Number(span.dataset.rank))]++; });
    const total = Math.max(1, counts.reduce((a, b) => a + b, 0));
    box.replaceChildren(...counts.map((count, b) => {
      const row = document.createElement("div");
      row.className = "bucket";
      row.dataset.bucket = b;
      row.dataset.count = count;
      const name = document.createElement("span");
      name.className = "name";
      name.textContent = RANK_NAMES[b];
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.setProperty("--share", count / total);
      const number = document.createElement("span");
      number.className = "count";
      number.textContent = `${count} (${Math.round(100 * count / total)}%)`;
      row.append(name, bar, number);
      return row;
    }));
  }

  /** The legend of both colourings into ``box`` (the CSS shows the one in use). */
  function legend(box) {
    const list = (by, names, key) => {
      const ul = document.createElement("ul");
      ul.className = "legend-list";
      ul.dataset.by = by;
      names.forEach((name, i) => {
        const li = document.createElement("li");
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.dataset[key] = i;
        li.append(swatch, by === "rank" ? `rank ${name}` : `p ${name}`);
        ul.append(li);
      });
      return ul;
    };
    box.replaceChildren(list("probability", PROB_NAMES, "pbin"), list("rank", RANK_NAMES, "bucket"));
  }

  function fillTip(tip, span, token) {
    const head = document.createElement("div");
    head.className = "tip-head";
    const text = document.createElement("code");
    text.textContent = visible(token.text);
    const facts = document.createElement("span");
    facts.className = "facts";
    facts.textContent = `p ${percent(token.logprob)} · rank ${token.rank} · log p ${token.logprob.toFixed(3)}`;
    head.append(text, facts);
    const list = document.createElement("ol");
    list.className = "alts";
    for (const alt of token.top_logprobs.slice(0, TIP_ALTERNATIVES)) {
      const li = document.createElement("li");
      li.className = alt.id === token.id ? "alt own" : "alt";
      const name = document.createElement("code");
      name.textContent = visible(alt.text);
      const p = document.createElement("span");
      p.className = "p";
      p.textContent = percent(alt.logprob);
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.setProperty("--share", Math.exp(alt.logprob));
      li.append(name, bar, p);
      list.append(li);
    }
    tip.replaceChildren(head, list);
    tip.hidden = false;
    const box = span.getBoundingClientRect();
    const room = document.documentElement.clientWidth;
    const left = Math.max(4, Math.min(box.left, room - tip.offsetWidth - 4));
    tip.style.left = `${left + window.scrollX}px`;
    tip.style.top = `${box.bottom + window.scrollY + 6}px`;
  }

  /** Hover and focus on ``container``'s tokens show #tip; arrow keys, Home and End move between tokens. */
  function tips(container, tokens, tip) {
    const fresh = !inspections.has(container);
    inspections.set(container, tokens);
    if (!fresh) return;  // (listeners once a container: a new inspection only changes its tokens)
    const tokenOf = (target) => {
      const span = target instanceof Element ? target.closest(".tok") : null;
      return span && container.contains(span) ? span : null;
    };
    const open = (event) => {
      const span = tokenOf(event.target);
      const token = span && inspections.get(container)[Number(span.dataset.index)];
      if (token) fillTip(tip, span, token);
    };
    const close = (event) => { if (tokenOf(event.target)) tip.hidden = true; };
    container.addEventListener("mouseover", open);
    container.addEventListener("focusin", open);
    container.addEventListener("mouseout", close);
    container.addEventListener("focusout", close);
    window.addEventListener("resize", () => { tip.hidden = true; });  // (placed for the width it had)
    container.addEventListener("keydown", (event) => {
      const span = tokenOf(event.target);
      if (!span) return;
      const all = container.querySelectorAll(".tok");
      const i = Number(span.dataset.index);
      const next = {ArrowRight: i + 1, ArrowDown: i + 1, ArrowLeft: i - 1, ArrowUp: i - 1, Home: 0,
                    End: all.length - 1}[event.key];
      if (event.key === "Escape") tip.hidden = true;
      if (next === undefined || !all[next]) return;
      event.preventDefault();
      all[next].focus();
    });
  }

  /** The whole view of an inspection: parts = {tokens, ranks, perplexity} elements, and the #tip element. */
  function show(parts, inspection, tip) {
    spans(parts.tokens, inspection.tokens);
    colour(parts.tokens);
    histogram(parts.ranks, parts.tokens);
    parts.perplexity.textContent = inspection.perplexity.toFixed(2);
    parts.perplexity.dataset.value = inspection.perplexity;
    tips(parts.tokens, inspection.tokens, tip);
  }

  /** The select that chooses the colouring: it sets <body data-color-by>, which the CSS reads. */
  function colourBy(select) {
    const apply = () => { document.body.dataset.colorBy = select.value; };
    select.addEventListener("change", apply);
    apply();
  }

  return {rankBucket, probBin, spans, colour, histogram, legend, tips, show, colourBy};
})();

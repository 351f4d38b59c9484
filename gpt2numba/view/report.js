/* `gpt2numba score --html`'s report: view.js over the spans written in the file, each document's tips from the
   inspections embedded as JSON (script#inspections). */
"use strict";

(() => {
  const inspections = JSON.parse(document.getElementById("inspections").textContent);
  const tip = document.getElementById("tip");
  document.querySelectorAll(".document").forEach((doc) => {
    const tokens = doc.querySelector(".tokens");
    if (!tokens) return;  // an empty document
    TokenView.colour(tokens);
    TokenView.histogram(doc.querySelector(".ranks"), tokens);
    TokenView.tips(tokens, inspections[Number(doc.dataset.index)].tokens, tip);
  });
  TokenView.colourBy(document.getElementById("color-by"));
  TokenView.legend(document.getElementById("legend"));
})();

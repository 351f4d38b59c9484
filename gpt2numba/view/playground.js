/* The playground (GET /): generate through the server's own /v1/completions, streamed (server-sent events),
   and with "show probabilities", colour every token of prompt + completion from /v1/inspect (view.js draws).
   <body data-state> says where it is: "idle", "busy" while it works, "done", or "error" (the message in
   #error). It asks nothing but this server. */
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  let controller = null;  // aborts the request under way (the Stop button)

  function setState(state, message = "") {
    document.body.dataset.state = state;
    $("error").hidden = state !== "error";
    $("error").textContent = message;
    $("generate").disabled = state === "busy";
    $("cancel").disabled = state !== "busy";
  }

  function headers() {
    const key = $("api-key").value.trim();
    return key ? {"Content-Type": "application/json", Authorization: `Bearer ${key}`}
      : {"Content-Type": "application/json"};
  }

  /** The completions request of the form: the inputs' values as numbers, the empty optional ones left out, and
      a JSON schema, if one is given, as OpenAI's response_format. */
  function request() {
    const value = (id) => $(id).value.trim();
    const number = (id) => Number(value(id) === "" ? $(id).defaultValue : value(id));
    const body = {prompt: $("prompt").value, max_tokens: number("max_tokens"), temperature: number("temperature"),
                  top_p: number("top_p")};
    if (value("top_k") !== "") body.top_k = Number(value("top_k"));
    body.n = number("n");
    if ($("stop").value !== "") body.stop = $("stop").value;
    if (value("seed") !== "") body.seed = Number(value("seed"));
    const schema = value("json_schema");
    if (schema !== "") {
      let parsed;
      try {
        parsed = JSON.parse(schema);
      } catch (e) {
        throw new Error(`JSON schema: not valid JSON (${e.message})`);
      }
      body.response_format = {type: "json_schema", json_schema: {name: "schema", schema: parsed}};
    }
    body.stream = true;
    return body;
  }

  async function failure(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || `${response.status} ${response.statusText}`;
    } catch (e) {
      return `${response.status} ${response.statusText}`;
    }
  }

  async function post(path, body, signal) {
    const response = await fetch(path, {method: "POST", headers: headers(), body: JSON.stringify(body), signal});
    if (!response.ok) throw new Error(await failure(response));
    return response;
  }

  /** Stream a completion: onText(text) for each piece of the first choice, until [DONE]. */
  async function stream(body, signal, onText) {
    const response = await post("/v1/completions", body, signal);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) throw new Error("the stream ended before [DONE]");
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          for (const choice of chunk.choices) {
            if (choice.index === 0 && choice.text) onText(choice.text);
          }
        }
      }
    }
  }

  /** Inspect prompt + completion and draw it; with nothing to inspect, clear the view. */
  async function probabilities(signal) {
    const text = $("prompt-text").textContent + $("completion").textContent;
    if (!text) {
      $("probabilities").hidden = true;
      return;
    }
    const response = await post("/v1/inspect", {text, top_logprobs: 5}, signal);
    const inspection = await response.json();
    TokenView.show({tokens: $("view"), ranks: $("ranks"), perplexity: $("perplexity")}, inspection, $("tip"));
    $("probabilities").hidden = false;
  }

  async function run(work) {
    if (document.body.dataset.state === "busy") return;
    controller = new AbortController();
    setState("busy");
    try {
      await work(controller.signal);
      setState("done");
    } catch (e) {
      setState(e.name === "AbortError" ? "done" : "error", e.name === "AbortError" ? "" : e.message);
    } finally {
      controller = null;
    }
  }

  function generate(event) {
    event.preventDefault();
    run(async (signal) => {
      const body = request();  // (a schema that is not JSON fails here, shown as the page's error)
      $("prompt-text").textContent = body.prompt;
      $("completion").textContent = "";
      $("probabilities").hidden = true;
      $("tip").hidden = true;
      await stream(body, signal, (text) => $("completion").append(text));
      if ($("show-probs").checked) await probabilities(signal);
    });
  }

  function toggle() {
    if (!$("show-probs").checked) {
      $("probabilities").hidden = true;
      $("tip").hidden = true;
    } else if (document.body.dataset.state !== "busy" && $("output").textContent) {
      run(probabilities);  // what was generated before the box was ticked
    }
  }

  $("settings").addEventListener("submit", generate);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("settings").requestSubmit();
  });
  $("cancel").addEventListener("click", () => { if (controller) controller.abort(); });
  $("show-probs").addEventListener("change", toggle);
  TokenView.colourBy($("color-by"));
  TokenView.legend($("legend"));
  setState("idle");
})();

// TinyLoop playground. Talks to this server's /api/v0 routes (the OpenAI shapes plus the looped model's
// knobs) like any other client: streaming SSE, the API key as a bearer token when the server needs one.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "tinyloop.apiKey";
let apiKey = sessionStorage.getItem(KEY_STORE) || "";
let model = null;        // the /api/v0/models entry
let chat = [];           // chat history: [{role, content}]
let running = null;      // AbortController of what is streaming now

// -- HTTP ------------------------------------------------------------------------------------------------
function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

function apiError(status, body) {
  const msg = body && body.error ? body.error.message : JSON.stringify(body);
  const err = new Error(status ? `${status}: ${msg}` : msg);
  err.status = status;
  return err;
}

async function errorOf(resp) {
  let body;
  try { body = await resp.json(); } catch (_) { body = { error: { message: resp.statusText } }; }
  return apiError(resp.status, body);
}

// POST a streaming request and feed its SSE events to `view`; resolves to {stats, usage, finish_reason}.
async function stream(path, body, view, signal) {
  view.start();
  const resp = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (resp.status === 401) askKey("The server refused the key: enter it again.");
  if (!resp.ok) throw await errorOf(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  const final = {};
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data: ")) continue;  // ": keepalive" comments
        const data = line.slice(6);
        if (data === "[DONE]") { view.finish(final); return final; }
        const ev = JSON.parse(data);
        if (ev.error) throw apiError(0, ev);
        if (ev.usage) final.usage = ev.usage;
        if (ev.stats) final.stats = ev.stats;
        for (const choice of ev.choices || []) {
          const text = choice.delta ? choice.delta.content : choice.text;
          if (text) view.delta(text, choice.loops);
          if (choice.finish_reason) final.finish_reason = choice.finish_reason;
        }
      }
    }
  }
  throw new Error("the stream ended without [DONE]");
}

// -- one streaming output and its figures ------------------------------------------------------------------
class RunView {
  constructor(out, figs) { this.out = out; this.figs = figs; this.timer = null; }

  start() {
    this.t0 = performance.now();
    this.tFirst = null;
    this.events = 0;
    this.text = "";
    this.out.textContent = "";
    if (this.echo) {  // the prompt, greyed, before the completion
      const span = document.createElement("span");
      span.className = "prompt-echo";
      span.textContent = this.echo;
      this.out.append(span);
    }
    this.gen = document.createElement("span");
    this.gen.className = "gen";
    this.out.append(this.gen);
    this.setState("streaming");
    clearInterval(this.timer);
    this.timer = setInterval(() => this.live(), 100);
    this.live();
  }

  setState(state) { this.out.dataset.state = state; this.out.dataset.events = String(this.events || 0); }

  // `depths`: under loops "auto", the core loops each token of this chunk ran; the text is shaded by their
  // mean (light: an early exit, dark: the ceiling), its tooltip says them.
  delta(text, depths) {
    if (this.tFirst === null) this.tFirst = performance.now();
    this.events += 1;
    this.text += text;
    if (depths && depths.length) {
      const span = document.createElement("span");
      const mean = depths.reduce((a, b) => a + b, 0) / depths.length;
      const ceiling = this.ceiling || Math.max(...depths);
      span.className = "depth";
      span.dataset.loops = depths.join(",");
      span.title = `loops ${depths.join(", ")}`;
      span.style.backgroundColor = `rgba(40, 110, 220, ${(0.08 + 0.6 * Math.min(1, mean / ceiling)).toFixed(3)})`;
      span.textContent = text;
      this.gen.append(span);
    } else {
      this.gen.append(text);
    }
    this.out.dataset.events = String(this.events);
    this.live();
  }

  // While streaming the client counts stream events: one per token in generate mode (a character split
  // over tokens arrives once whole), possibly several tokens per event in the speculative modes.
  live() {
    const now = performance.now();
    const secs = (now - this.t0) / 1000;
    this.render({
      tps: [secs > 0 ? (this.events / secs).toFixed(1) : "-", "live"],
      ttft: [this.tFirst === null ? "waiting" : `${Math.round(this.tFirst - this.t0)} ms`, "client"],
      tokens: [String(this.events), "events"],
      acceptance: [this.mode === "generate" ? "n/a (generate)" : "at the end", ""],
      loops: [String(this.loops), "asked"],
      finish: ["streaming", ""],
    });
  }

  finish(final) {
    clearInterval(this.timer);
    const st = final.stats || {};
    const clientTtft = this.tFirst === null ? "-" : `${Math.round(this.tFirst - this.t0)} ms client, `;
    const acc = st.acceptance_rate === undefined ? "n/a (generate)"
      : `${(100 * st.acceptance_rate).toFixed(1)}% (${st.mean_tokens_per_round} tokens/round)`;
    this.render({
      tps: [st.tokens_per_second === undefined ? "-" : st.tokens_per_second.toFixed(1), "server"],
      ttft: [`${clientTtft}${st.time_to_first_token_ms === undefined ? "-" : Math.round(st.time_to_first_token_ms)} ms server`, ""],
      tokens: [String(st.completion_tokens !== undefined ? st.completion_tokens
        : (final.usage ? final.usage.completion_tokens : this.events)), "server"],
      acceptance: [acc, st.acceptance_rate === undefined ? "" : "server"],
      loops: [String(st.loops_used !== undefined ? st.loops_used : this.loops), "used"],
      finish: [final.finish_reason || "-", ""],
    });
    this.setState("done");
  }

  // The answer moved elsewhere (chat mode: into the transcript), so that it is not shown twice.
  clearText() {
    this.text = "";
    this.out.textContent = "";
  }

  fail(err) {
    clearInterval(this.timer);
    this.setState(err.name === "AbortError" ? "stopped" : "error");
    if (err.name !== "AbortError") {
      const span = document.createElement("span");
      span.className = "error";
      span.textContent = (this.text ? "\n" : "") + err.message;
      this.out.append(span);
    }
  }

  render(figs) {
    const names = { tps: "tok/s", ttft: "TTFT", tokens: "tokens", acceptance: "acceptance", loops: "loops",
      finish: "finish" };
    this.figs.textContent = "";
    for (const [key, [value, src]] of Object.entries(figs)) {
      const span = document.createElement("span");
      span.dataset.fig = key;
      span.innerHTML = `${names[key]} <b></b> <span class="src"></span>`;
      span.querySelector("b").textContent = value;
      span.querySelector(".src").textContent = src;
      this.figs.append(span);
    }
  }
}

// -- the request a run sends --------------------------------------------------------------------------------
const num = (id) => parseFloat($(id).value);
const int = (id) => parseInt($(id).value, 10);
const kind = () => document.querySelector("input[name=kind]:checked").value;

function request(loops, mode, text) {
  const body = {
    model: model ? model.id : "tinyloop", stream: true, stream_options: { include_usage: true },
    loops, mode, max_tokens: int("max_tokens"), temperature: num("temperature"), top_p: num("top_p"),
  };
  if (mode === "generate" && loops !== null && $("auto").checked) {  // adaptive depth: the slider is the ceiling
    body.loops = "auto";
    body.max_loops = loops;
  }
  if (int("top_k") > 0) body.top_k = int("top_k");
  if (num("repetition_penalty") !== 1) body.repetition_penalty = num("repetition_penalty");
  if ($("seed").value.trim() !== "") body.seed = int("seed");
  const stops = $("stop").value ? [$("stop").value.replace(/\\n/g, "\n")] : [];
  if (mode !== "generate") {
    body.verify_loops = loops;
    body.draft_loops = int("draft_loops");
    body.draft_ahead = int("draft_ahead");
    if (mode === "tree_speculative") body.K_branches = int("K_branches");
  }
  if (kind() === "chat") {
    body.messages = [...chat, { role: "user", content: text }];
    body.stop = [...stops, "\nUser:"];  // the chat template is "Role: content" lines (docs/server.md)
    return { path: "/api/v0/chat/completions", body };
  }
  body.prompt = text;
  if (stops.length) body.stop = stops;
  return { path: "/api/v0/completions", body };
}

function busy(on) {
  $("send").disabled = on;
  $("compare-run").disabled = on;
  $("stop-btn").disabled = !on;
}

const single = new RunView($("output"), $("figures"));

async function send() {
  if (!model || running) return;
  const text = $("prompt").value;
  const loops = int("loops");
  const mode = $("mode").value;
  const { path, body } = request(loops, mode, text);
  $("error").textContent = "";
  running = new AbortController();
  busy(true);
  single.loops = mode === "generate" && $("auto").checked ? `auto (<= ${loops})` : loops;
  single.ceiling = loops;
  single.mode = mode;
  const chatting = kind() === "chat";
  single.echo = chatting ? "" : text;
  if (chatting) renderTranscript({ role: "user", content: text });  // the turn's message above its streaming answer
  try {
    await stream(path, body, single, running.signal);
    if (chatting) {  // the answer joins the transcript and leaves the output box: each answer is shown once
      chat.push({ role: "user", content: text }, { role: "assistant", content: single.text.trim() });
      single.clearText();
      renderTranscript();
      $("prompt").value = "";
    }
  } catch (err) {
    if (chatting) renderTranscript();  // the failed turn is not kept
    single.fail(err);
    if (err.name !== "AbortError") $("error").textContent = err.message;
  } finally {
    running = null;
    busy(false);
  }
}

async function compare() {
  if (!model || running) return;
  const depths = [...document.querySelectorAll(".depth")].map((i) => parseInt(i.value, 10)).filter((d) => d >= 1);
  const text = $("prompt").value;
  const cols = $("columns");
  cols.textContent = "";
  running = new AbortController();
  busy(true);
  const runs = depths.map((loops) => {
    const col = document.createElement("div");
    col.className = "column";
    col.dataset.loops = String(loops);
    col.innerHTML = `<h3></h3><pre class="output" data-state="idle"></pre><div class="figures"></div>`;
    col.querySelector("h3").textContent = `loops = ${loops}`;
    cols.append(col);
    const view = new RunView(col.querySelector("pre"), col.querySelector(".figures"));
    view.loops = $("auto").checked ? `auto (<= ${loops})` : loops;
    view.ceiling = loops;
    view.mode = "generate";
    const { path, body } = request(loops, "generate", text);
    return stream(path, body, view, running.signal).catch((err) => view.fail(err));
  });
  try {
    await Promise.all(runs);  // the columns stream together: the server batches the requests
  } finally {
    running = null;
    busy(false);
  }
}

// The chat so far, and `pending` (the message whose answer is streaming) after it.
function renderTranscript(pending) {
  const box = $("transcript");
  box.textContent = "";
  for (const m of pending ? [...chat, pending] : chat) {
    const div = document.createElement("div");
    div.className = `msg ${m.role}`;
    div.textContent = `${m.role === "user" ? "User" : "Assistant"}: ${m.content}`;
    box.append(div);
  }
  box.hidden = kind() !== "chat" || box.childElementCount === 0;
}

// -- the model card -----------------------------------------------------------------------------------------
function showCard(m) {
  const i = m.model_info || {};
  const facts = [
    ["model", m.id.split("/").pop()],
    ["parameters", i.params ? `${(i.params / 1e6).toFixed(1)}M` : "?"],
    ["weights", i.quant_method && i.quant_method !== "none"
      ? `${m.quantization} (${i.quant_method}, group ${i.quant_group_size})` : m.quantization],
    ["blocks", `${i.n_prelude} prelude + ${i.n_core} core x loops + ${i.n_coda} coda`],
    ["dim / heads", `${i.dim} / ${i.n_heads} (${i.n_kv_heads} KV)`],
    ["default loops", i.default_loops],
    ["max loops", i.max_loops],
    ["context", `${m.max_context_length} tokens`],
    ["vocabulary", i.vocab_size],
    ["KV cache", i.kv_cache_mode],
    ["draft exits", i.draft_exit ? `d = ${i.draft_exit.draft_loops.join(", ")}` : "none"],
    ["runtime", m.runtime ? `${m.runtime.name} ${m.runtime.version}` : "?"],
  ];
  const dl = $("card-facts");
  dl.textContent = "";
  for (const [k, v] of facts) {
    const div = document.createElement("div");
    div.innerHTML = "<dt></dt><dd></dd>";
    div.querySelector("dt").textContent = k;
    div.querySelector("dd").textContent = String(v);
    div.dataset.fact = k;
    dl.append(div);
  }
  $("card-status").textContent = `${m.arch}: the same core blocks run "loops" times, and every request picks its own depth.`;
}

function setLimits(m) {
  const i = m.model_info || {};
  const max = i.max_loops || 64;
  const def = i.default_loops || 8;
  const slider = $("loops");
  slider.max = String(max);
  slider.value = String(def);
  $("loops-value").textContent = slider.value;
  for (const el of document.querySelectorAll(".depth")) el.max = String(max);
  $("depth-0").value = "1";
  $("depth-1").value = String(Math.max(2, Math.floor(def / 2)));
  $("depth-2").value = String(def);
  $("max_tokens").max = String(m.max_context_length || 8192);
}

async function loadModel() {
  let resp;
  try {
    resp = await fetch("/api/v0/models", { headers: headers(false) });
  } catch (err) {
    $("card-status").textContent = `Cannot reach the server (${err.message}); retrying.`;
    setTimeout(loadModel, 2000);
    return;
  }
  if (resp.status === 401) { askKey(apiKey ? "That key was refused." : ""); return; }
  if (!resp.ok) {
    const err = await errorOf(resp);
    $("card-status").textContent = `The model is not ready: ${err.message} (retrying)`;
    setTimeout(loadModel, 1000);
    return;
  }
  $("auth").hidden = true;
  model = (await resp.json()).data[0];
  showCard(model);
  setLimits(model);
  busy(false);
}

function askKey(why) {
  $("auth").hidden = false;
  $("auth-error").textContent = why || "";
  $("api-key").focus();
}

// -- wiring -------------------------------------------------------------------------------------------------
$("auth-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORE, apiKey);
  loadModel();
});
$("loops").addEventListener("input", () => { $("loops-value").textContent = $("loops").value; });
$("mode").addEventListener("change", () => {
  const mode = $("mode").value;
  $("spec-knobs").hidden = mode === "generate";
  $("k-label").hidden = mode !== "tree_speculative";
});
for (const radio of document.querySelectorAll("input[name=kind]")) {
  radio.addEventListener("change", () => {
    $("clear").hidden = kind() !== "chat";
    renderTranscript();
  });
}
$("send").addEventListener("click", send);
$("compare-run").addEventListener("click", compare);
$("stop-btn").addEventListener("click", () => running && running.abort());
$("clear").addEventListener("click", () => { chat = []; renderTranscript(); });
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) send();
});
$("clear").hidden = true;
$("send").disabled = true;
$("compare-run").disabled = true;
$("stop-btn").disabled = true;
loadModel();

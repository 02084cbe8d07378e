// tokenmill's chat page: vanilla JS, no build step. Model and user text only ever reach the page as
// text nodes (textContent), never as HTML.
"use strict";

const store = {
  get key() { return localStorage.getItem("tokenmill.apiKey") || ""; },
  set key(value) { value ? localStorage.setItem("tokenmill.apiKey", value) : localStorage.removeItem("tokenmill.apiKey"); },
  get conversations() { return JSON.parse(localStorage.getItem("tokenmill.conversations") || "[]"); },
  set conversations(list) { localStorage.setItem("tokenmill.conversations", JSON.stringify(list)); },
};
const $ = (id) => document.getElementById(id);
let model = null;
let current = null; // the conversation shown: {id, title, messages: [{role, content, meta?, error?}]}
let running = null; // the AbortController of the answer being streamed

function headers() {
  const h = { "Content-Type": "application/json" };
  if (store.key) h.Authorization = `Bearer ${store.key}`;
  return h;
}

function askForKey(message) {
  return new Promise((resolve) => {
    $("key-message").textContent = message;
    $("key-input").value = "";
    $("key-dialog").addEventListener("close", () => { store.key = $("key-input").value.trim(); resolve(); }, { once: true });
    $("key-dialog").showModal();
  });
}

// fetch with the stored key; a 401 asks for the key (again) and retries once it is given
async function api(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: headers() });
    if (response.status !== 401) return response;
    await askForKey(store.key ? "That API key was refused. Enter the server's API key." : "This server needs an API key.");
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && (body.error.message || body.error)) || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// ------------------------------------------------------------------ safe markdown (DOM nodes only)
function renderInline(parent, text) {
  const pattern = /(`[^`\n]+`|\*\*[^*\n]+\*\*)/g;
  let last = 0;
  for (const match of text.matchAll(pattern)) {
    parent.append(document.createTextNode(text.slice(last, match.index)));
    const token = match[0];
    const node = document.createElement(token.startsWith("`") ? "code" : "strong");
    node.textContent = token.startsWith("`") ? token.slice(1, -1) : token.slice(2, -2);
    parent.append(node);
    last = match.index + token.length;
  }
  parent.append(document.createTextNode(text.slice(last)));
}

function renderMarkdown(element, text) {
  element.replaceChildren();
  const parts = text.split(/^```/m);
  parts.forEach((part, i) => {
    if (i % 2 === 1) { // a fenced code block: its first line names the language
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      code.textContent = part.slice(part.indexOf("\n") + 1 || part.length);
      pre.append(code);
      element.append(pre);
      return;
    }
    for (const paragraph of part.split(/\n{2,}/)) {
      if (!paragraph.trim()) continue;
      const p = document.createElement("p");
      renderInline(p, paragraph.replace(/^\n+|\n+$/g, ""));
      element.append(p);
    }
  });
}

// ------------------------------------------------------------------ conversations
function save() {
  const list = store.conversations.filter((c) => c.id !== current.id);
  if (current.messages.length) list.unshift(current);
  store.conversations = list;
  showConversationList();
}

function showConversationList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of store.conversations) {
    const li = document.createElement("li");
    li.textContent = c.title || "(untitled)";
    li.className = current && c.id === current.id ? "current" : "";
    li.addEventListener("click", () => { if (!running) { current = c; showMessages(); showConversationList(); } });
    ul.append(li);
  }
}

function newConversation() {
  current = { id: `${Date.now()}-${Math.random().toString(16).slice(2)}`, title: "", messages: [] };
  showMessages();
  showConversationList();
}

function messageElement(message) {
  const div = document.createElement("div");
  div.className = `message ${message.role}${message.error ? " error" : ""}`;
  const body = document.createElement("div");
  body.className = "body";
  if (message.role === "assistant" && !message.error) renderMarkdown(body, message.content);
  else body.textContent = message.content;
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.textContent = message.meta || "";
  div.append(body, meta);
  return div;
}

function showMessages() {
  $("messages").replaceChildren(...current.messages.map(messageElement));
  $("messages").scrollTop = $("messages").scrollHeight;
}

// ------------------------------------------------------------------ sending and streaming
async function send(text) {
  if (!model) await loadModel();
  current.messages.push({ role: "user", content: text });
  if (!current.title) current.title = text.slice(0, 60);
  const answer = { role: "assistant", content: "" };
  current.messages.push(answer);
  showMessages();
  const element = $("messages").lastElementChild;
  const system = $("system-prompt").value.trim();
  const earlier = current.messages.filter((m) => m !== answer && !m.error).map(({ role, content }) => ({ role, content }));
  const body = {
    model,
    messages: system ? [{ role: "system", content: system }, ...earlier] : earlier,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  running = new AbortController();
  setRunning(true);
  const started = performance.now();
  let firstToken = null;
  let tokens = 0;
  let chunks = 0;
  try {
    const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: running.signal });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const data = JSON.parse(line.slice(6));
          if (data.error) throw new Error(data.error.message || JSON.stringify(data.error));
          if (data.usage) tokens = data.usage.completion_tokens;
          const delta = data.choices && data.choices[0] && data.choices[0].delta;
          if (delta && delta.content) {
            if (firstToken === null) firstToken = performance.now();
            chunks += 1;
            answer.content += delta.content;
            renderSoon(element.querySelector(".body"), answer);
          }
        }
      }
    }
    answer.meta = timing(started, firstToken, tokens || chunks);
  } catch (error) {
    if (running.signal.aborted) {
      answer.meta = `stopped · ${timing(started, firstToken, chunks)}`;
    } else {
      answer.error = true;
      answer.content = answer.content ? `${answer.content}\n\n[error: ${error.message}]` : `Error: ${error.message}`;
    }
  } finally {
    running = null;
    setRunning(false);
    showMessages();
    save();
  }
}

// re-render a streamed answer at most once per frame (each render is the whole answer's text)
let renderPending = false;
function renderSoon(body, answer) {
  if (renderPending) return;
  renderPending = true;
  requestAnimationFrame(() => {
    renderPending = false;
    renderMarkdown(body, answer.content);
    $("messages").scrollTop = $("messages").scrollHeight;
  });
}

function timing(started, firstToken, tokens) {
  if (firstToken === null) return "no tokens";
  const seconds = (performance.now() - firstToken) / 1000;
  const rate = tokens > 1 && seconds > 0 ? ` · ${((tokens - 1) / seconds).toFixed(1)} tok/s` : "";
  return `TTFT ${Math.round(firstToken - started)} ms · ${tokens} tokens${rate}`;
}

function setRunning(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function loadModel() {
  const response = await api("/v1/models");
  if (!response.ok) throw new Error(await errorText(response));
  model = (await response.json()).data[0].id;
  $("model-name").textContent = model;
}

// ------------------------------------------------------------------ status
const samples = []; // [seconds, generation tokens so far]

async function refreshStatus() {
  if ($("status-view").hidden) return;
  const response = await api("/status");
  if (!response.ok) return;
  const status = await response.json();
  const rows = [
    ["Model", status.model], ["Dtype", status.dtype], ["Quantization", status.quantization],
    ["Attention backend", status.attention_backend], ["Running requests", status.running],
    ["Waiting requests", status.waiting], ["KV pages used", status.kv_pages_used],
    ["KV pages cached (reclaimable)", status.kv_pages_cached], ["KV pages free", status.kv_pages_free],
    ["Prefix cache hit rate", `${(100 * status.prefix_cache_hit_rate).toFixed(1)}%`],
    ["KV cache dtype", status.kv_cache_dtype],
  ];
  if (status.disk_tier) {
    const tier = status.disk_tier;
    rows.push(["Disk tier hit rate", `${(100 * tier.hit_rate).toFixed(1)}%`],
      ["Disk tier blocks", `${tier.blocks} (${(tier.bytes / 2 ** 20).toFixed(1)} of ${(tier.max_bytes / 2 ** 20).toFixed(0)} MiB)`]);
  }
  rows.push(["Output tokens so far", status.generation_tokens]);
  const tbody = $("status-table").tBodies[0];
  tbody.replaceChildren(...rows.map(([name, value]) => {
    const tr = document.createElement("tr");
    for (const text of [name, String(value)]) { const td = document.createElement("td"); td.textContent = text; tr.append(td); }
    return tr;
  }));
  const now = performance.now() / 1000;
  samples.push([now, status.generation_tokens]);
  while (samples.length && samples[0][0] < now - 60) samples.shift();
  drawChart();
}

function drawChart() {
  const canvas = $("throughput-chart");
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const rates = samples.slice(1).map(([t, n], i) => [t, (n - samples[i][1]) / Math.max(t - samples[i][0], 1e-3)]);
  if (!rates.length) return;
  const top = Math.max(1, ...rates.map(([, r]) => r));
  const now = performance.now() / 1000;
  g.strokeStyle = "#3b6ef5";
  g.beginPath();
  rates.forEach(([t, r], i) => {
    const x = canvas.width * (1 - (now - t) / 60);
    const y = canvas.height - 10 - (canvas.height - 20) * (r / top);
    i ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.stroke();
  g.fillStyle = "#555";
  g.fillText(`max ${top.toFixed(1)} tok/s`, 6, 12);
}

function showTab(name) {
  $("chat-view").hidden = name !== "chat";
  $("status-view").hidden = name !== "status";
  $("tab-chat").classList.toggle("active", name === "chat");
  $("tab-status").classList.toggle("active", name === "status");
  refreshStatus();
}

// ------------------------------------------------------------------ wiring
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => running && running.abort());
$("new-chat").addEventListener("click", () => { if (!running) newConversation(); });
$("forget-key").addEventListener("click", () => { store.key = ""; });
$("tab-chat").addEventListener("click", () => showTab("chat"));
$("tab-status").addEventListener("click", () => showTab("status"));
setInterval(refreshStatus, 2000);
newConversation();
loadModel().catch((error) => {
  current.messages.push({ role: "assistant", content: `Error: ${error.message}`, error: true });
  showMessages();
});

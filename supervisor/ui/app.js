// The dashboard at /ui: plain DOM, no framework. Every data call goes to an admin route with the admin
// key from this tab's sessionStorage; text from the daemon is only ever set as textContent.
"use strict";

const KEY_STORAGE = "llm-supervisor.admin-key";
const MAX_EVENTS = 200;
const REFRESH_MS = 5000; // a safety net: events trigger refreshes as things change
const PULL_REFRESH_MS = 1000; // while a pull runs, its progress comes from /api/status
const EVENT_REFRESH_MS = 1000; // a burst of events costs one refresh (each costs the daemon a listing)
const CALL_TIMEOUT_MS = 20000; // a read the daemon has not answered by then: it is hung, or unreachable
// The events stream has a `: ping` every 15 s: two missed, and the connection is taken for dead (a hung
// daemon, a network that dropped it) and opened again.
const SILENCE_MS = 35000;
const LOG_REFRESH_MS = 3000;
const LOG_LINES = 500;

const $ = (selector) => document.querySelector(selector);

const view = {
  models: [],
  gpuReport: null, // /v1/admin/gpu-memory, or {error}
  pulls: { running: [], recent: [] },
  busy: new Map(), // model -> action in progress
  actionErrors: new Map(), // model -> message of its last failed action
  rows: new Map(), // model -> its <tr> and cells
  logModel: null,
  pullsPending: 0,
  clockOffset: 0, // the daemon's clock less the browser's, in seconds (noteDaemonClock)
};

class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// --- the key ---

function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

function authHeaders() {
  const key = storedKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function askForKey(reason) {
  const dialog = $("#key-dialog");
  const hadKey = storedKey() !== null;
  sessionStorage.removeItem(KEY_STORAGE);
  $("#forget-key").hidden = true;
  setConnection("key", "admin key needed");
  const error = $("#key-error");
  if (hadKey) {
    // The key just used was refused: say why (the other calls it was on get the same answer).
    error.textContent = reason;
    error.hidden = !reason;
  } else if (!dialog.open) {
    error.textContent = "";
    error.hidden = true;
  }
  if (!dialog.open) {
    $("#key-input").value = "";
    dialog.showModal();
  }
}

function useKey(event) {
  event.preventDefault();
  const key = $("#key-input").value.trim();
  if (!key) return;
  if (!/^[\x21-\x7e]+$/.test(key)) {
    // A header cannot hold it: every call would fail as if the daemon could not be reached.
    const error = $("#key-error");
    error.textContent = "the key holds a character that cannot be sent (a space, or an invisible one pasted with it)";
    error.hidden = false;
    return;
  }
  sessionStorage.setItem(KEY_STORAGE, key);
  $("#key-dialog").close();
  $("#forget-key").hidden = false;
  restart();
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  stopEvents();
  askForKey("");
}

// --- calls ---

function errorMessage(doc, text, response) {
  if (doc && typeof doc === "object" && "error" in doc) {
    const error = doc.error;
    if (typeof error === "string") return error; // Ollama's shape, on /api routes
    if (error && typeof error.message === "string") return error.message; // OpenAI's shape
    return JSON.stringify(error);
  }
  return text.trim().slice(0, 300) || `${response.status} ${response.statusText}`;
}

async function api(method, path, body) {
  const headers = authHeaders();
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
      // A hung daemon (or a connection a network dropped) would hold this, and every refresh after it.
      signal: method === "GET" ? AbortSignal.timeout(CALL_TIMEOUT_MS) : undefined,
    });
  } catch (err) {
    throw new ApiError(0, `cannot reach the daemon: ${err.message}`);
  }
  noteDaemonClock(response);
  const text = await response.text();
  let doc = null;
  try {
    doc = text ? JSON.parse(text) : null;
  } catch {
    doc = null;
  }
  if (!response.ok) {
    const message = errorMessage(doc, text, response);
    const code = doc && doc.error && typeof doc.error === "object" ? doc.error.code : undefined;
    refusedKey(response.status, code, message);
    throw new ApiError(response.status, message, code);
  }
  return doc;
}

// How far the daemon's clock is ahead of the browser's, in seconds, from its answers' Date (to the second):
// keep-alive deadlines are the daemon's times.
function noteDaemonClock(response) {
  const date = Date.parse(response.headers.get("Date") || "");
  if (!Number.isNaN(date)) view.clockOffset = (date - Date.now()) / 1000;
}

function daemonNow() {
  return Date.now() / 1000 + (view.clockOffset || 0);
}

// A 401, or a key that is not an admin's: ask for another key.
function refusedKey(status, code, message) {
  if (status === 401 || (status === 403 && code === "forbidden")) askForKey(message);
}

// --- notices ---

function showNotice(message) {
  const notice = $("#notice");
  notice.textContent = message;
  notice.hidden = !message;
}

function setConnection(state, text) {
  const pill = $("#connection");
  pill.dataset.state = state;
  pill.textContent = text;
  // While the daemon cannot be reached, what the table shows is as old as the last answer: say so.
  $("#models").classList.toggle("stale", state === "down");
}

// --- refreshing ---

let refreshTimer = null;
let refreshing = null;
let refreshAgain = false; // something changed while a refresh was under way: its answers may be older

function scheduleRefresh(delayMs = 150) {
  if (refreshTimer !== null) return;
  refreshTimer = setTimeout(() => {
    refreshTimer = null;
    refresh();
  }, delayMs);
}

async function refresh() {
  if (refreshing) {
    refreshAgain = true;
    return refreshing;
  }
  refreshing = (async () => {
    const [models, gpus, status] = await Promise.allSettled([
      api("GET", "/v1/admin/models"),
      api("GET", "/v1/admin/gpu-memory"),
      api("GET", "/api/status"),
    ]);
    const problems = [];
    if (models.status === "fulfilled") {
      view.models = (models.value && models.value.models) || [];
      renderModels();
    } else if (models.reason.status !== 401) {
      problems.push(`models: ${models.reason.message}`);
    }
    if (gpus.status === "fulfilled") {
      view.gpuReport = gpus.value;
    } else if (gpus.reason.status !== 401) {
      view.gpuReport = { error: gpus.reason.message };
    }
    renderGpus();
    if (status.status === "fulfilled") {
      view.pulls = (status.value && status.value.pulls) || { running: [], recent: [] };
      renderPulls();
    } else if (status.reason.status !== 401) {
      problems.push(`pulls: ${status.reason.message}`);
    }
    showNotice(problems.join(" · "));
  })();
  try {
    await refreshing;
  } finally {
    refreshing = null;
    if (refreshAgain) {
      refreshAgain = false;
      scheduleRefresh(0);
    }
  }
}

// --- models ---

function formatMib(mib) {
  if (mib === null || mib === undefined) return "?";
  return mib >= 10240 ? `${(mib / 1024).toFixed(1)} GiB` : `${Math.round(mib)} MiB`;
}

function formatSeconds(s) {
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const sec = String(s % 60).padStart(2, "0");
  return h ? `${h}:${String(m).padStart(2, "0")}:${sec}` : `${m}:${sec}`;
}

// keep_alive is seconds, or null for "never unloads when idle" (-1).
function formatKeepAlive(seconds) {
  if (seconds === null || seconds === undefined) return "forever";
  if (seconds === 0) return "0 (unload when idle)";
  if (seconds % 3600 === 0) return `${seconds / 3600}h`;
  if (seconds % 60 === 0) return `${seconds / 60}m`;
  return `${seconds}s`;
}

function keepAliveText(model) {
  const live = model.state === "ready" || model.state === "loading" || model.state === "draining";
  if (model.pinned) return "pinned";
  if (!live) return `keep ${formatKeepAlive(model.keep_alive)}`;
  if (model.inflight > 0 || model.queue_depth > 0) return "busy";
  if (model.expires_at === null || model.expires_at === undefined) return "never";
  return `unloads in ${formatSeconds(model.expires_at - daemonNow())}`;
}

function replicaText(replica) {
  const parts = [replica.state];
  if (replica.pid) parts.push(`pid ${replica.pid}`);
  if (replica.gpus && replica.gpus.length) parts.push(`GPU ${replica.gpus.join(",")}`);
  if (replica.vram_mib) parts.push(formatMib(replica.vram_mib));
  return parts.join(" · ");
}

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  if (text) node.textContent = text;
  return node;
}

function buildRow(name) {
  const tr = el("tr", { "data-model": name });
  const cells = {};
  for (const column of ["name", "state", "replicas", "inflight", "queued", "keepalive", "vram", "error", "actions"]) {
    cells[column] = el("td", { class: `col-${column}` });
    tr.append(cells[column]);
  }
  cells.open = el("button", { type: "button", class: "link model-name", title: "show the log tail" }, name);
  cells.open.addEventListener("click", () => openLog(name));
  cells.meta = el("div", { class: "muted small" });
  cells.name.append(cells.open, cells.meta);
  cells.statePill = el("span", { class: "pill state" });
  cells.state.append(cells.statePill);
  const buttons = el("div", { class: "buttons" });
  cells.buttons = {};
  for (const action of ["load", "unload", "pin"]) {
    const button = el("button", { type: "button", "data-action": action }, action);
    button.addEventListener("click", () => {
      const model = view.models.find((m) => m.name === name);
      const verb = action === "pin" && model && model.pinned ? "unpin" : action;
      act(name, verb);
    });
    cells.buttons[action] = button;
    buttons.append(button);
  }
  cells.actionError = el("div", { class: "error small action-error", role: "alert" });
  cells.actions.append(buttons, cells.actionError);
  return { tr, cells };
}

function renderModels() {
  const tbody = $("#models tbody");
  const names = new Set(view.models.map((m) => m.name));
  for (const [name, row] of view.rows) {
    if (!names.has(name)) {
      row.tr.remove();
      view.rows.delete(name);
    }
  }
  view.models.forEach((model, index) => {
    let row = view.rows.get(model.name);
    if (!row) {
      row = buildRow(model.name);
      view.rows.set(model.name, row);
    }
    // The daemon's order; a row already in its place is not moved (a move takes the focus off its buttons).
    const there = tbody.children[index];
    if (there !== row.tr) tbody.insertBefore(row.tr, there || null);
    updateRow(row, model);
  });
  $("#models-empty").hidden = view.models.length > 0;
}

function updateRow(row, model) {
  const { cells } = row;
  const meta = [model.engine, model.source].filter(Boolean);
  if (model.aliases && model.aliases.length) meta.push(`aka ${model.aliases.join(", ")}`);
  if (model.priority) meta.push(`priority ${model.priority}`);
  cells.meta.textContent = meta.join(" · ");
  cells.statePill.textContent = model.state;
  cells.statePill.dataset.state = model.state;
  row.tr.dataset.state = model.state;

  const replicas = (model.replicas || []).filter((replica) => replica.state !== "unloaded");
  cells.replicas.replaceChildren(el("div", {}, String(replicas.length)));
  for (const replica of replicas) cells.replicas.append(el("div", { class: "muted small" }, replicaText(replica)));

  cells.inflight.textContent = String(model.inflight ?? 0);
  cells.queued.textContent = String(model.queue_depth ?? 0);
  cells.keepalive.textContent = keepAliveText(model);

  const estimate = model.vram_estimate || {};
  cells.vram.replaceChildren(el("div", {}, estimate.mib ? formatMib(estimate.mib) : "unknown"));
  if (estimate.source) cells.vram.append(el("div", { class: "muted small" }, estimate.source));
  cells.vram.title = estimate.detail ? String(estimate.detail) : "";

  const error = model.last_error;
  const errorKey = error ? JSON.stringify(error) : "";
  // Built again only when the error changed: a stderr tail the operator opened stays open.
  if (cells.error.dataset.shown !== errorKey) showError(cells.error, error, errorKey);

  const busy = view.busy.get(model.name);
  for (const [action, button] of Object.entries(cells.buttons)) {
    const verb = action === "pin" && model.pinned ? "unpin" : action;
    button.textContent = busy === verb ? `${verb}…` : verb;
    button.dataset.action = verb;
    button.disabled = busy !== undefined;
  }
  const failed = view.actionErrors.get(model.name) || "";
  cells.actionError.textContent = failed;
  cells.actionError.hidden = !failed;
}

function showError(cell, error, errorKey) {
  cell.replaceChildren();
  cell.dataset.shown = errorKey;
  if (!error) return;
  const when = error.at ? ` at ${new Date(error.at * 1000).toLocaleTimeString()}` : "";
  const exit = error.exit_code === null || error.exit_code === undefined ? "" : ` (exit ${error.exit_code})`;
  cell.append(el("div", { class: "error" }, `${error.reason}${exit}${when}`));
  const tail = Array.isArray(error.stderr_tail) ? error.stderr_tail.join("\n") : error.stderr_tail;
  if (tail) {
    const details = el("details");
    details.append(el("summary", {}, "stderr"), el("pre", { class: "small" }, tail));
    cell.append(details);
  }
}

async function act(name, action) {
  if (view.busy.has(name)) return;
  view.busy.set(name, action);
  view.actionErrors.delete(name);
  renderModels();
  const body = action === "load" ? { wait: true } : action === "unload" ? { queued: "serve" } : {};
  try {
    await api("POST", `/v1/admin/models/${encodeURIComponent(name)}/${action}`, body);
  } catch (err) {
    view.actionErrors.set(name, `${action} failed: ${err.message}`);
  } finally {
    view.busy.delete(name);
    renderModels();
    scheduleRefresh(0);
  }
}

// --- GPUs ---

function hue(text) {
  let h = 0;
  for (const ch of text) h = (h * 31 + ch.codePointAt(0)) % 360;
  return h;
}

function segment(kind, mib, total, label, model) {
  const node = el("div", { class: `seg ${kind}`, title: label });
  if (model) {
    node.dataset.model = model;
    node.style.backgroundColor = `hsl(${hue(model)} 55% 42%)`;
  }
  node.dataset.mib = String(mib);
  node.style.width = `${(100 * mib) / total}%`;
  if ((100 * mib) / total > 9) node.textContent = label;
  return node;
}

function renderGpus() {
  const box = $("#gpus");
  const report = view.gpuReport;
  if (!report) return;
  if (report.error) {
    box.replaceChildren(el("p", { class: "muted" }, report.error));
    return;
  }
  const gpus = report.gpus || [];
  if (!gpus.length) {
    box.replaceChildren(el("p", { class: "muted" }, "No GPUs."));
    return;
  }
  const notes = report.warning ? [el("p", { class: "muted small" }, report.warning)] : [];
  box.replaceChildren(...notes, ...gpus.map(renderGpu));
}

function renderGpu(gpu) {
  const node = el("div", { class: "gpu", "data-gpu": String(gpu.index) });
  const total = gpu.total_mib || 1;
  const simulated = gpu.simulated && !/simulated/i.test(gpu.name || "") ? "(simulated)" : "";
  const title = [`GPU ${gpu.index}`, gpu.name, simulated].filter(Boolean).join(" · ");
  const figures = [
    `used ${formatMib(gpu.used_mib)} of ${formatMib(gpu.total_mib)}`,
    `leased ${formatMib(gpu.leased_mib ?? 0)}`,
    `leasable ${formatMib(gpu.leasable_mib)}`,
    `margin ${formatMib(gpu.margin_mib ?? 0)}`,
  ];
  node.append(el("div", { class: "gpu-head" }, title), el("div", { class: "muted small" }, figures.join(" · ")));
  if (gpu.nvml_error) node.append(el("p", { class: "error small" }, `NVML: ${gpu.nvml_error}`));

  const bar = el("div", { class: "bar" });
  const legend = el("ul", { class: "legend plain" });
  let taken = 0;
  for (const lease of gpu.leases || []) {
    const leaked = lease.state === "leaked" || String(lease.model).startsWith("leaked:");
    const label = `${lease.model} ${formatMib(lease.mib)}`;
    bar.append(segment(leaked ? "leaked" : "lease", lease.mib, total, label, leaked ? null : lease.model));
    const extra = [lease.state, lease.pid ? `pid ${lease.pid}` : ""].filter(Boolean).join(", ");
    legend.append(legendItem(leaked ? "leaked" : "lease", `${label} (${extra})`, leaked ? null : lease.model));
    taken += lease.mib;
  }
  const foreign = gpu.foreign_mib || 0;
  if (foreign > 0) {
    bar.append(segment("foreign", foreign, total, `foreign ${formatMib(foreign)}`));
    legend.append(legendItem("foreign", `not ours ${formatMib(foreign)}`));
    taken += foreign;
  }
  const margin = gpu.margin_mib || 0;
  const free = Math.max(0, total - taken - margin);
  bar.append(segment("free", free, total, `free ${formatMib(free)}`));
  if (margin > 0) {
    bar.append(segment("margin", margin, total, `margin ${formatMib(margin)}`));
    legend.append(legendItem("margin", `margin ${formatMib(margin)} (never leased)`));
  }
  node.append(bar, legend);
  return node;
}

function legendItem(kind, text, model) {
  const item = el("li");
  const swatch = el("span", { class: `swatch ${kind}` });
  if (model) swatch.style.backgroundColor = `hsl(${hue(model)} 55% 42%)`;
  item.append(swatch, document.createTextNode(text));
  return item;
}

// --- pulls ---

// As the user wrote it; `model` is the daemon's case-folded key.
function pullName(pull) {
  return pull.name || pull.requested || pull.model;
}

function renderPulls() {
  const list = $("#pulls");
  const items = [];
  for (const pull of view.pulls.running || []) {
    const item = el("li", { class: "pull running", "data-model": pull.model });
    item.append(el("div", {}, `${pullName(pull)}: ${pull.status || pull.state}`));
    if (pull.total) {
      const bar = el("progress", { max: String(pull.total) });
      bar.value = pull.completed || 0;
      const percent = Math.floor((100 * (pull.completed || 0)) / pull.total);
      item.append(bar, el("span", { class: "muted small" }, ` ${percent}%`));
    }
    items.push(item);
  }
  for (const pull of [...(view.pulls.recent || [])].reverse().slice(0, 5)) {
    const item = el("li", { class: "pull recent muted", "data-model": pull.model });
    item.textContent = `${pullName(pull)}: ${pull.error ? `failed: ${pull.error}` : pull.state}`;
    items.push(item);
  }
  list.replaceChildren(...items);
  if ((view.pulls.running || []).length || view.pullsPending) scheduleRefresh(PULL_REFRESH_MS);
}

async function pull(event) {
  event.preventDefault();
  const input = $("#pull-name");
  const name = input.value.trim();
  if (!name) return;
  const error = $("#pull-error");
  error.hidden = true;
  view.pullsPending += 1;
  scheduleRefresh(PULL_REFRESH_MS);
  try {
    await api("POST", "/api/pull", { model: name, stream: false });
    input.value = "";
  } catch (err) {
    // The daemon's message names the pull already ("pull of hf.co/... failed: ...").
    error.textContent = err.message.startsWith("pull of ") ? err.message : `pull ${name} failed: ${err.message}`;
    error.hidden = false;
  } finally {
    view.pullsPending -= 1;
    scheduleRefresh(0);
  }
}

// --- events ---

let stream = null; // the AbortController of the events request now open
let retryMs = 1000;

function stopEvents() {
  if (stream) stream.abort();
  stream = null;
}

async function followEvents() {
  stopEvents();
  const controller = new AbortController();
  stream = controller;
  try {
    const response = await fetch("/v1/admin/events", {
      headers: { ...authHeaders(), Accept: "text/event-stream" },
      cache: "no-store",
      signal: controller.signal,
    });
    if (!response.ok) {
      const text = await response.text();
      let doc = null;
      try {
        doc = JSON.parse(text);
      } catch {
        doc = null;
      }
      const message = errorMessage(doc, text, response);
      const code = doc && doc.error && typeof doc.error === "object" ? doc.error.code : undefined;
      refusedKey(response.status, code, message);
      if (response.status === 401 || (response.status === 403 && code === "forbidden")) return;
      throw new Error(message);
    }
    setConnection("live", "live");
    retryMs = 1000;
    await readEvents(response.body, controller);
  } catch (err) {
    if (controller.signal.aborted && controller.signal.reason !== SILENT) return;
    setConnection("down", controller.signal.aborted ? "no word from the daemon" : `events: ${err.message}`);
  }
  if (stream !== controller) return; // replaced meanwhile
  setConnection("down", "reconnecting…");
  setTimeout(() => {
    if (stream === controller) followEvents();
  }, retryMs);
  retryMs = Math.min(retryMs * 2, 15000);
}

const SILENT = "silent"; // why a stream was aborted: nothing, not even a ping, came for SILENCE_MS

// Server-sent events over fetch (EventSource cannot send the Authorization header).
async function readEvents(body, controller) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const watchdog = setTimeout(() => controller.abort(SILENT), SILENCE_MS);
    let value, done;
    try {
      ({ value, done } = await reader.read());
    } finally {
      clearTimeout(watchdog);
    }
    if (done) return;
    buffer += value;
    const normalised = buffer.replace(/\r\n|\r(?!$)/g, "\n");
    const blocks = normalised.split("\n\n");
    buffer = blocks.pop();
    for (const block of blocks) dispatch(block);
  }
}

function dispatch(block) {
  let type = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue; // comments keep the connection alive
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") type = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return;
  let payload;
  try {
    payload = JSON.parse(data.join("\n"));
  } catch {
    payload = data.join("\n");
  }
  if (type === "snapshot") {
    view.actionErrors.clear(); // (re)connected: an action that failed while it was down is stale news
    if (payload && Array.isArray(payload.models)) {
      view.models = payload.models;
      renderModels();
    }
    if (payload && Array.isArray(payload.gpus)) {
      const { models: _models, ...report } = payload; // the GPU report, an assumed GPU's warning too
      view.gpuReport = report;
      renderGpus();
    }
    return;
  }
  addEvent(type, payload);
  scheduleRefresh(EVENT_REFRESH_MS);
  if (view.logModel && payload && payload.model === view.logModel) scheduleLogRefresh();
}

function summary(payload) {
  if (payload === null || typeof payload !== "object") return String(payload);
  const parts = [];
  for (const [key, value] of Object.entries(payload)) {
    if (key === "model" || key === "event" || key === "timestamp" || key === "at") continue;
    if (value === null || value === undefined || value === "") continue;
    const shown = typeof value === "object" ? JSON.stringify(value) : String(value);
    parts.push(`${key}=${shown.length > 80 ? `${shown.slice(0, 77)}…` : shown}`);
  }
  return parts.join(" ");
}

function addEvent(type, payload) {
  const list = $("#events");
  const item = el("li", { class: "event", "data-type": type });
  const model = payload && typeof payload === "object" && payload.model ? String(payload.model) : "";
  if (model) item.dataset.model = model;
  const stamped = payload && typeof payload === "object" && typeof payload.at === "number";
  const at = stamped ? new Date(payload.at * 1000) : new Date();
  item.append(
    el("time", { class: "muted small" }, at.toLocaleTimeString()),
    el("span", { class: "pill kind" }, type),
    el("strong", {}, model),
    el("span", { class: "small" }, summary(payload)),
  );
  list.prepend(item);
  while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
}

// --- logs ---

let logTimer = null;

function openLog(name) {
  view.logModel = name;
  $("#log-model").textContent = name;
  $("#log-section").hidden = false;
  $("#log-lines").textContent = "";
  loadLog();
  $("#log-section").scrollIntoView({ block: "nearest" });
}

function closeLog() {
  view.logModel = null;
  $("#log-section").hidden = true;
}

function scheduleLogRefresh() {
  if (logTimer === null) logTimer = setTimeout(loadLog, 300);
}

async function loadLog() {
  if (logTimer !== null) clearTimeout(logTimer);
  logTimer = null;
  const name = view.logModel;
  if (!name) return;
  const error = $("#log-error");
  try {
    const doc = await api("GET", `/v1/admin/models/${encodeURIComponent(name)}/logs?tail=${LOG_LINES}`);
    if (view.logModel !== name) return;
    const pre = $("#log-lines");
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    const lines = (doc && doc.lines) || [];
    const text = lines.length ? lines.join("\n") : "(no output yet)";
    if (pre.textContent !== text) pre.textContent = text; // unchanged: a selection in it stays
    if (atBottom) pre.scrollTop = pre.scrollHeight;
    error.hidden = true;
  } catch (err) {
    error.textContent = `log of ${name}: ${err.message}`;
    error.hidden = false;
  }
}

// --- start ---

function restart() {
  followEvents();
  refresh();
}

function tick() {
  for (const model of view.models) {
    const row = view.rows.get(model.name);
    if (row) row.cells.keepalive.textContent = keepAliveText(model);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("#key-form").addEventListener("submit", useKey);
  $("#key-dialog").addEventListener("cancel", (event) => event.preventDefault()); // no data without a key
  $("#forget-key").addEventListener("click", forgetKey);
  $("#pull-form").addEventListener("submit", pull);
  $("#log-refresh").addEventListener("click", loadLog);
  $("#log-close").addEventListener("click", closeLog);
  $("#forget-key").hidden = storedKey() === null;
  setInterval(tick, 1000);
  setInterval(() => scheduleRefresh(0), REFRESH_MS);
  setInterval(() => {
    if (view.logModel) loadLog();
  }, LOG_REFRESH_MS);
  start();
});

// With keys configured and none given yet, ask for one before any admin call: each would be a 401,
// which the browser's console shows as an error. /health, open, says which it is.
async function start() {
  if (storedKey() === null) {
    try {
      const response = await fetch("/health", { cache: "no-store" });
      const doc = await response.json();
      if (doc && !("models" in doc)) {
        askForKey("");
        return;
      }
    } catch {
      // not answered: restart() says so
    }
  }
  restart();
}

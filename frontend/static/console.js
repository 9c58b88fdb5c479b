// pdserve web console: plain script, no build step. Every number comes from /console/api/* and /v1/*,
// called with the API key the user signed in with (kept in sessionStorage for this tab only).
"use strict";

const KEY_STORE = "pdserve.console.key";
const CLUSTER_POLL_MS = 1000;
const REQUESTS_POLL_MS = 2000;
const STAGES_AFTER = new Set(["transfer", "first_decode_step", "decode"]);
const STAGE_NAMES = {
  admission: "admission", routing: "routing", limits: "tenant limits", dispatch: "dispatch",
  reservation_wait: "KV reservation", prefill_queue: "prefill queue", prefill: "prefill",
  network: "network + other", transfer: "KV transfer", first_decode_step: "first decode step", decode: "decode",
};

const state = { key: sessionStorage.getItem(KEY_STORE) || "", session: null, page: null, timer: null,
  charts: {}, seriesSince: 0, series: {}, chat: [], chatBusy: false };

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function fmt(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toFixed(digits);
}

// A request's cost in USD: six decimals (a request is often a fraction of a cent); "–" when not priced.
function money(v) {
  return v === null || v === undefined ? "–" : Number(v).toFixed(6);
}

class AuthError extends Error {}

function headers(extra = {}) {
  const h = { ...extra };
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

async function api(path) {
  const res = await fetch(path, { headers: headers(), cache: "no-store" });
  if (res.status === 401) throw new AuthError(await errorMessage(res));
  if (!res.ok) throw new Error(await errorMessage(res));
  return res.json();
}

async function errorMessage(res) {
  try {
    const body = await res.json();
    return (body.error && body.error.message) || `HTTP ${res.status}`;
  } catch {
    return `HTTP ${res.status}`;
  }
}

// --- sign in -------------------------------------------------------------------------------------

function showLogin(message) {
  stopPolling();
  state.session = null;
  $("#nav").hidden = true;
  $("#signout").hidden = true;
  $("#who").textContent = "";
  for (const p of document.querySelectorAll(".page")) p.hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = message || "";
  $("#login-key").focus();
}

async function signIn() {
  try {
    state.session = await api("/console/api/session");
  } catch (err) {
    if (err instanceof AuthError) {
      showLogin(state.key ? err.message : "");
      return;
    }
    showLogin(`The console cannot reach the frontend: ${err.message}`);
    return;
  }
  const s = state.session;
  $("#login").hidden = true;
  $("#nav").hidden = false;
  $("#signout").hidden = s.open_access;
  $("#who").textContent = `${s.operator ? "operator" : "tenant"} ${s.tenant} · ${s.frontend_id} · pdserve ${s.version}`;
  for (const a of document.querySelectorAll("#nav a")) a.hidden = a.dataset.operator === "1" && !s.operator;
  route();
}

$("#login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = $("#login-key").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  $("#login-key").value = "";
  signIn();
});

$("#signout").addEventListener("click", () => {
  state.key = "";
  sessionStorage.removeItem(KEY_STORE);
  showLogin("");
});

// --- pages ---------------------------------------------------------------------------------------

function stopPolling() {
  if (state.timer !== null) clearTimeout(state.timer);
  state.timer = null;
}

function poll(fn, everyMs) {
  stopPolling();
  const page = state.page;
  const tick = async () => {
    try {
      await fn();
    } catch (err) {
      if (err instanceof AuthError) {
        showLogin(err.message);
        return;
      }
      const status = document.querySelector(`#page-${page} .status`);
      if (status) status.textContent = `Update failed: ${err.message}`;
    }
    if (state.page === page && state.session) state.timer = setTimeout(tick, everyMs);
  };
  tick();
}

function route() {
  if (!state.session) return;
  const [name, arg] = (location.hash.slice(1) || "").split("/");
  const allowed = state.session.operator ? ["cluster", "charts", "requests", "chat"] : ["requests", "chat"];
  const page = allowed.includes(name) ? name : allowed[0];
  state.page = page;
  for (const p of document.querySelectorAll(".page")) p.hidden = p.id !== `page-${page}`;
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.dataset.page === page) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  if (page === "cluster") poll(renderCluster, CLUSTER_POLL_MS);
  else if (page === "charts") poll(renderCharts, state.session.interval_s * 1000);
  else if (page === "requests") {
    poll(renderRequests, REQUESTS_POLL_MS);
    if (arg) showRequest(decodeURIComponent(arg));
    else $("#request-detail").hidden = true;
  } else if (page === "chat") {
    stopPolling();
    loadModels();
  }
}

window.addEventListener("hashchange", route);

// --- cluster -------------------------------------------------------------------------------------

function meter(fraction) {
  const pct = fraction === null || fraction === undefined ? 0 : Math.min(1, Math.max(0, fraction)) * 100;
  const bar = el("span");
  bar.style.width = `${pct}%`;
  return el("span", {}, el("span", { class: "meter", role: "img", "aria-label": `${pct.toFixed(0)}%` }, bar),
    fraction === null || fraction === undefined ? "–" : `${pct.toFixed(0)}%`);
}

async function renderCluster() {
  const data = await api("/console/api/cluster");
  const root = $("#cluster-pools");
  root.replaceChildren();
  const f = data.frontend;
  $("#cluster-status").textContent = `Frontend ${f.id}: ${f.in_flight} in flight, registry ${f.registry_connected ?
    "connected" : "DISCONNECTED"}. Updated ${new Date(data.now * 1000).toLocaleTimeString()}; a node is unhealthy ` +
    `once its load report is over ${f.stale_load_s} s old, and is gone once its registry lease expires.`;
  const pools = [...data.pools];
  if (data.other_nodes.length) pools.push({ pool: "(not served by this frontend)", models: [], ready: null, nodes: data.other_nodes });
  for (const pool of pools) {
    const models = pool.models.map((m) => m.version ? `${m.name}@${m.version}` : m.name).join(", ");
    const ready = pool.ready === null ? "" : pool.ready ? " · ready" : " · NOT READY";
    root.append(el("h2", { text: `Pool ${pool.pool}${models ? ` (${models})` : ""}${ready}` }));
    const tbody = el("tbody");
    for (const n of pool.nodes) {
      tbody.append(el("tr", { "data-node-id": n.node_id, "data-health": n.health, "data-role": n.role },
        el("td", { text: n.node_id }), el("td", { text: n.colocated ? "decode (colocated)" : n.role }),
        el("td", { text: n.address }),
        el("td", {}, el("span", { class: `badge ${n.state}`, text: n.state })),
        el("td", {}, el("span", { class: `badge ${n.health}`, text: n.health,
          title: n.load_age_s === null ? "no load report yet" : `last load report ${fmt(n.load_age_s)} s ago` })),
        el("td", { class: "num", text: n.queue_len ?? "–" }), el("td", { class: "num", text: n.running ?? "–" }),
        el("td", { class: "num", text: n.in_flight ?? "–" }),
        el("td", {}, meter(n.kv_use)), el("td", { class: "num", text: `${n.kv_blocks_used ?? "–"} / ${n.kv_blocks_total}` }),
        el("td", { class: "num", text: fmt(n.tokens_per_s) }), el("td", { text: n.version })));
    }
    if (!pool.nodes.length) tbody.append(el("tr", {}, el("td", { colspan: 12, text: "no nodes registered" })));
    const head = el("tr", {}, ...["Node", "Role", "Address", "State", "Health", "Queue", "Running", "In flight",
      "KV use", "KV blocks", "Tokens/s", "Version"].map((h) => el("th", { scope: "col", text: h })));
    root.append(el("div", { class: "table-wrap" }, el("table", { "data-pool": pool.pool }, el("thead", {}, head), tbody)));
  }
}

// --- charts --------------------------------------------------------------------------------------

const CHARTS = [
  { id: "ttft", title: "TTFT (ms)", series: [["ttft_p50", "p50", 1000], ["ttft_p95", "p95", 1000]] },
  { id: "tpot", title: "TPOT (ms)", series: [["tpot_p50", "p50", 1000], ["tpot_p95", "p95", 1000]] },
  { id: "tokens", title: "Output tokens/s", series: [["tokens_per_s", "tokens/s", 1], ["requests_per_s", "requests/s", 1]] },
  { id: "kv", title: "KV use (%)", percent: true, series: [["kv_use_decode", "decode", 100], ["kv_use_prefill", "prefill", 100]] },
  { id: "queue", title: "Queued requests", series: [["queue_decode", "decode", 1], ["queue_prefill", "prefill", 1], ["running", "running (decode)", 1]] },
  { id: "goodput", title: "Goodput against the SLO (%)", percent: true, series: [["goodput", "tokens in SLO", 100], ["slo_attainment", "requests in SLO", 100]] },
];
const COLORS = ["#2457c5", "#c9a227", "#3f9e8f"];

function mergeSeries(data) {
  const cutoff = Date.now() / 1000 - data.history_s;
  for (const [pool, cols] of Object.entries(data.pools)) {
    const have = state.series[pool] || {};
    for (const [name, values] of Object.entries(cols)) have[name] = (have[name] || []).concat(values);
    const keep = (have.t || []).findIndex((t) => t >= cutoff);
    if (keep > 0) for (const name of Object.keys(have)) have[name] = have[name].slice(keep);
    state.series[pool] = have;
    const ts = have.t || [];
    if (ts.length) state.seriesSince = Math.max(state.seriesSince, ts[ts.length - 1]);
  }
}

function chartWidth(box) {
  return Math.max(260, box.clientWidth - 16);
}

async function renderCharts() {
  const data = await api(`/console/api/series?since=${state.seriesSince}`);
  mergeSeries(data);
  const root = $("#charts-pools");
  for (const [pool, cols] of Object.entries(state.series)) {
    let group = root.querySelector(`[data-pool="${CSS.escape(pool)}"]`);
    if (!group) {
      group = el("div", { "data-pool": pool }, el("h2", { text: `Pool ${pool}` }), el("div", { class: "charts-grid" }));
      root.append(group);
    }
    const grid = group.querySelector(".charts-grid");
    for (const spec of CHARTS) {
      const key = `${pool}/${spec.id}`;
      const values = [cols.t || [], ...spec.series.map(([name, , scale]) =>
        (cols[name] || []).map((v) => v === null ? null : v * scale))];
      let chart = state.charts[key];
      if (!chart) {
        const box = el("div", { class: "chart", "data-chart": spec.id }, el("h3", { text: spec.title }));
        grid.append(box);
        chart = new uPlot({
          width: chartWidth(box), height: 180, legend: { live: false },
          series: [{}, ...spec.series.map(([, label], i) => ({ label, stroke: COLORS[i], width: 1.5, spanGaps: false }))],
          axes: [{}, { size: 50 }],
          scales: { x: { time: true }, y: spec.percent ? { range: [0, 100] } : {} },
        }, values, box);
        state.charts[key] = chart;
        new ResizeObserver(() => chart.setSize({ width: chartWidth(box), height: 180 })).observe(box);
      } else {
        chart.setData(values);
      }
    }
  }
  const n = Object.values(state.series).map((c) => (c.t || []).length);
  $("#charts-status").textContent = `Per pool, the last 15 minutes kept by this frontend: ${Math.max(0, ...n)} samples, ` +
    `one every ${data.interval_s} s (the same series /metrics exports).`;
}

// --- requests ------------------------------------------------------------------------------------

function pathOf(rec) {
  const paths = (rec.routes || []).map((r) => r.path).filter(Boolean);
  return paths.length ? [...new Set(paths)].join(", ") : "–";
}

async function renderRequests() {
  const data = await api("/console/api/requests?limit=100");
  const tbody = $("#requests-table tbody");
  tbody.replaceChildren();
  for (const rec of data.data) {
    const id = rec.request_id;
    const row = el("tr", { "data-request-id": id || "", "data-tenant": rec.tenant || "" },
      el("td", { text: new Date(rec.ts * 1000).toLocaleTimeString() }),
      el("td", {}, id ? el("a", { href: `#requests/${encodeURIComponent(id)}`, text: id.slice(0, 18) + "…", title: id })
        : el("span", { class: "status", text: "refused" })),
      el("td", { text: rec.tenant || "–" }), el("td", { text: rec.model || "–" }),
      el("td", {}, el("span", { class: `badge ${rec.status < 400 ? "ok" : "failed"}`, text: rec.status,
        title: rec.error || "" })),
      el("td", { text: pathOf(rec) }),
      el("td", { class: "num", text: `${rec.prompt_tokens ?? "–"} / ${rec.completion_tokens ?? "–"}` }),
      el("td", { class: "num", text: fmt(rec.ttft_ms) }), el("td", { class: "num", text: fmt(rec.tpot_ms) }),
      el("td", { class: "num", text: fmt(rec.e2e_ms) }),
      el("td", { class: "num cost", text: money(rec.cost_usd), title: rec.batch ? "batch line (batch discount)" : "" }));
    tbody.append(row);
  }
  $("#requests-status").textContent = `The most recent requests, newest first (${data.data.length} shown; this ` +
    `frontend keeps the last ${data.capacity}).`;
}

function waterfall(rec) {
  const stages = rec.waterfall_ms || [];
  const box = el("div", { class: "waterfall", "data-ttft-ms": rec.ttft_ms });
  if (!stages.length) {
    box.append(el("p", { class: "status", text: "No token came: no waterfall." }));
    return box;
  }
  const end = Math.max(...stages.map((s) => s.start + s.ms), rec.ttft_ms || 0) || 1;
  let before = 0;
  for (const s of stages) {
    if (s.ttft) before += s.ms;
    const bar = el("span", { class: `wf-bar ${s.stage}` });
    bar.style.left = `${(s.start / end) * 100}%`;
    bar.style.width = `${(s.ms / end) * 100}%`;
    const track = el("div", { class: "wf-track" }, bar);
    if (rec.ttft_ms !== null) {
      const mark = el("span", { class: "wf-ttft", title: `first token at ${fmt(rec.ttft_ms)} ms` });
      mark.style.left = `${(rec.ttft_ms / end) * 100}%`;
      track.append(mark);
    }
    box.append(el("div", { class: "wf-row", "data-stage": s.stage, "data-ms": s.ms, "data-in-ttft": s.ttft ? "1" : "0" },
      el("span", { class: `wf-label${s.ttft ? "" : " after"}`, text: STAGE_NAMES[s.stage] || s.stage }), track,
      el("span", { class: "num", text: `${fmt(s.ms, 2)} ms` })));
  }
  box.append(el("p", { class: "wf-sum", "data-sum-ms": before.toFixed(3) },
    `Stages before the first token: ${fmt(before, 2)} ms; TTFT ${fmt(rec.ttft_ms, 2)} ms (red line). `,
    "KV transfer, the first decode step and decode follow, drawn from when they started."));
  return box;
}

async function showRequest(id) {
  const detail = $("#request-detail");
  detail.hidden = false;
  detail.replaceChildren(el("p", { class: "status", text: `Loading ${id}…` }));
  let rec = null;
  for (let i = 0; i < 20 && rec === null; i++) {  // a request just answered is recorded when its stream closes
    try {
      rec = await api(`/console/api/requests/${encodeURIComponent(id)}`);
    } catch (err) {
      if (err instanceof AuthError) {
        showLogin(err.message);
        return;
      }
      await new Promise((r) => setTimeout(r, 250));
    }
  }
  if (rec === null) {
    detail.replaceChildren(el("p", { class: "error", text: `No recent request ${id} of yours.` }));
    return;
  }
  const routes = (rec.routes || []).map((r) => `choice ${r.choice}: ${r.path || "no token"} · prefill ` +
    `${(r.served_by && r.served_by.prefill) || "–"} · decode ${(r.served_by && r.served_by.decode) || "–"}` +
    `${r.migrations ? ` · migrated ${r.migrations}×` : ""}${r.tried && r.tried.length > 1 ? ` · tried ${r.tried.join(", ")}` : ""}`);
  detail.replaceChildren(
    el("h2", { text: `Request ${id}` }),
    el("p", { class: "status", text: `${rec.tenant} · ${rec.model} · status ${rec.status} · ${rec.prompt_tokens} prompt, ` +
      `${rec.completion_tokens} completion tokens · TTFT ${fmt(rec.ttft_ms)} ms · TPOT ${fmt(rec.tpot_ms)} ms · ` +
      `total ${fmt(rec.e2e_ms)} ms · cost $${money(rec.cost_usd)}${rec.batch ? " (batch)" : ""}` +
      `${rec.trace_id ? ` · trace ${rec.trace_id}` : ""}` }),
    ...routes.map((r) => el("p", { class: "route", text: r })),
    waterfall(rec),
    el("details", {}, el("summary", { text: "Request log record" }), el("pre", { class: "json", text: JSON.stringify(rec, null, 2) })),
  );
  detail.focus();
}

// --- chat ----------------------------------------------------------------------------------------

async function loadModels() {
  const select = $("#chat-model");
  if (select.options.length) return;
  try {
    const data = await api("/v1/models");
    for (const m of data.data) select.append(el("option", { value: m.id, text: m.id }));
  } catch (err) {
    if (err instanceof AuthError) showLogin(err.message);
  }
}

function chatMessage(role, text) {
  const body = el("div", { class: "text", text });
  const stats = el("div", { class: "stats" });
  const node = el("div", { class: `msg ${role}`, "data-role": role }, el("div", { class: "role", text: role }), body, stats);
  $("#chat-log").append(node);
  return { node, body, stats };
}

async function sendChat(text) {
  state.chat.push({ role: "user", content: text });
  chatMessage("user", text);
  const out = chatMessage("assistant", "");
  out.node.setAttribute("data-state", "streaming");
  const payload = { model: $("#chat-model").value, messages: state.chat, stream: true,
    stream_options: { include_usage: true }, temperature: Number($("#chat-temperature").value),
    max_tokens: Number($("#chat-max-tokens").value) };
  const started = performance.now();
  let first = null;
  let last = null;
  let id = null;
  let usage = null;
  let answer = "";
  try {
    const res = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(payload),
      headers: headers({ "Content-Type": "application/json" }) });
    if (res.status === 401) throw new AuthError(await errorMessage(res));
    if (!res.ok) throw new Error(await errorMessage(res));
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          id = chunk.id || id;
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const piece = (choice.delta && choice.delta.content) || "";
            if (piece) {
              const now = performance.now();
              if (first === null) first = now;
              last = now;
              answer += piece;
              out.body.textContent = answer;
            }
          }
        }
      }
    }
  } catch (err) {
    if (err instanceof AuthError) {
      showLogin(err.message);
      return;
    }
    out.node.setAttribute("data-state", "error");
    out.stats.replaceChildren(el("span", { class: "error", text: `Error: ${err.message}` }));
    state.chat.pop();
    return;
  }
  state.chat.push({ role: "assistant", content: answer });
  const ttft = first === null ? null : first - started;
  const tokens = usage ? usage.completion_tokens : null;
  const rate = tokens && tokens > 1 && last > first ? ((tokens - 1) * 1000) / (last - first) : null;
  out.node.setAttribute("data-state", "done");
  out.node.setAttribute("data-request-id", id || "");
  out.node.setAttribute("data-ttft-ms", ttft === null ? "" : ttft.toFixed(3));
  out.stats.replaceChildren(`TTFT ${fmt(ttft)} ms · ${fmt(rate)} tokens/s · ${tokens ?? "?"} tokens · `,
    id ? el("a", { href: `#requests/${encodeURIComponent(id)}`, class: "waterfall-link", text: "waterfall" }) : "");
}

$("#chat-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text || state.chatBusy) return;
  input.value = "";
  state.chatBusy = true;
  $("#chat-send").disabled = true;
  try {
    await sendChat(text);
  } finally {
    state.chatBusy = false;
    $("#chat-send").disabled = false;
    input.focus();
  }
});

$("#chat-input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("#chat-form").requestSubmit();
  }
});

$("#chat-clear").addEventListener("click", () => {
  state.chat = [];
  $("#chat-log").replaceChildren();
  $("#chat-input").focus();
});

signIn();

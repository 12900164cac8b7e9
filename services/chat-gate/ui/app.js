// The context page: a tenant's agents and what a chat's first turn gets from
// each, kept live by server-sent events. No framework, no build step; every
// text is set with textContent (never parsed as HTML).
"use strict";

const KEY = "ctxsync.key";
const state = {
  agents: new Map(),      // agent_id -> AgentSummary
  current: null,          // agent id shown, or null for the list
  eventsFor: 0,           // events rendered for the current agent (drops older reads)
  source: null,           // EventSource
  retry: 500,
};
// What the page rendered and when (read by the browser tests).
window.ctxsyncPage = { renders: [], listRenders: 0, live: false };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function key() { return sessionStorage.getItem(KEY); }

class Refused extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || ("HTTP " + status));
    this.status = status;
  }
}

async function api(path, options) {
  const k = key();
  if (!k) { showLogin(""); throw new Refused(401, null); }
  const response = await fetch(path, Object.assign({}, options, {
    headers: { "Authorization": "Bearer " + k, "Accept": "application/json" },
    cache: "no-store",
    credentials: "omit",
  }));
  const body = await response.json().catch(() => null);
  if (response.status === 401) {
    sessionStorage.removeItem(KEY);
    showLogin("The key was refused: " + ((body && body.error && body.error.message) || "unauthenticated"));
    throw new Refused(401, body);
  }
  if (!response.ok) throw new Refused(response.status, body);
  return body;
}

function show(section) {
  for (const id of ["login", "agents", "agent", "catalog"]) $(id).hidden = id !== section;
  $("forget").hidden = section === "login";
}

function showLogin(message) {
  closeEvents();
  show("login");
  $("login-error").textContent = message || "";
  $("key").focus();
}

// ---- labels ----
const PHASES = { PHASE_PENDING: "pending", PHASE_COMPLETE: "complete", PHASE_UNSPECIFIED: "no phase" };
const FRESHNESS = { FRESHNESS_CURRENT: "current run", FRESHNESS_STALE: "stale", FRESHNESS_LEGACY: "legacy", FRESHNESS_NO_REPORT: "no report" };
const STATUS = { RESOURCE_STATUS_INVALID: "invalid", RESOURCE_STATUS_UNREADABLE: "unreadable", RESOURCE_STATUS_OVERSIZE: "over the size limit", RESOURCE_STATUS_EXCLUDED: "excluded", RESOURCE_STATUS_DISABLED: "disabled", RESOURCE_STATUS_OK: "ok" };
const badge = (value, labels) => el("span", { class: "badge " + value, "data-value": value, text: labels[value] || value });
const when = (ts) => ts ? new Date(ts).toLocaleString() : "never";

// ---- the list ----
async function loadAgents() {
  const all = new Map();
  let after = "";
  for (let page = 0; page < 20; page++) {
    const reply = await api("/api/v1/agents?limit=200&after=" + encodeURIComponent(after));
    for (const agent of reply.agents) all.set(agent.agent_id, agent);
    after = reply.next_after_agent_id;
    if (!after) break;
  }
  state.agents = all;
  renderAgents();
}

function renderAgents() {
  const needle = $("search").value.trim().toLowerCase();
  const freshness = $("freshness").value;
  const rows = [];
  for (const a of state.agents.values()) {
    if (freshness && a.freshness !== freshness) continue;
    if (needle && !(a.name + " " + a.workspace + " " + a.agent_id).toLowerCase().includes(needle)) continue;
    const c = a.counts || {};
    rows.push(el("tr", { "data-agent-id": a.agent_id, "data-phase": a.phase, "data-freshness": a.freshness },
      el("td", { "data-label": "Agent" }, el("a", { href: "#agent/" + a.agent_id, text: a.name || a.agent_id })),
      el("td", { "data-label": "Workspace", text: a.workspace }),
      el("td", { "data-label": "Phase" }, badge(a.phase, PHASES)),
      el("td", { "data-label": "Freshness" }, badge(a.freshness, FRESHNESS)),
      el("td", { "data-label": "Last report", text: when(a.last_report_at) }),
      el("td", { "data-label": "Servers", title: "ok / zero tools / failed" },
        el("span", { class: "ok", text: c.servers_ok || 0 }), " / ",
        el("span", { text: c.servers_zero_tools || 0 }), " / ",
        el("span", { class: (c.servers_failed ? "failed" : ""), text: c.servers_failed || 0 })),
      el("td", { "data-label": "Bad configs", class: c.invalid_config_files ? "failed" : "", text: c.invalid_config_files || 0 })));
  }
  rows.sort((x, y) => x.textContent.localeCompare(y.textContent));
  // A live update must not take the keyboard's place: the rows are new
  // elements, so the link that had the focus gets it back in its new row.
  const focused = document.activeElement && document.activeElement.closest("#agent-rows tr[data-agent-id]");
  $("agent-rows").replaceChildren(...rows);
  $("agents-empty").hidden = rows.length > 0;
  if (focused) {
    const again = rows.find((row) => row.dataset.agentId === focused.dataset.agentId);
    if (again) again.querySelector("a").focus({ preventScroll: true });
  }
  window.ctxsyncPage.listRenders++;
}

// ---- one agent ----
function section(title, items, empty) {
  return [el("h2", { text: title + " (" + items.length + ")" }), ...(items.length ? items : [el("p", { class: "muted", text: empty })])];
}

function schemaText(json) {
  try { return JSON.stringify(JSON.parse(json), null, 2); } catch (_) { return json; }
}

function renderAgent(p, origin) {
  const summary = state.agents.get(p.agent_id);
  $("agent-title").textContent = summary ? summary.name + " · " + summary.workspace : p.agent_id;
  const c = p.counts || {};
  const phase = p.phase || "PHASE_UNSPECIFIED";
  const servers = (p.servers || []).map((s) => el("div", { class: "card server" + (s.tools_withheld ? " withheld" : ""), "data-server": s.name },
    el("strong", { text: s.name }), " ", el("span", { class: "muted", text: (s.transport || "").replace("MCP_TRANSPORT_", "").toLowerCase() + " · " + s.config_path }),
    s.warning ? el("p", { class: "warn", text: "warning: " + s.warning }) : null,
    s.tools_withheld ? el("p", { class: "warn withheld-note", text: s.tools_withheld + " tools withheld: this report is from a previous agent process (run " + (p.snapshot_agent_run_id || "?") + "); they return when the running process (run " + (p.agent_run_id || "?") + ") completes its discovery." }) : null,
    (s.tools || []).length === 0 && !s.tools_withheld ? el("p", { class: "muted", text: "no tools" }) : null,
    (s.tools || []).map((t) => el("details", { class: "tool", "data-tool": t.name },
      el("summary", {}, el("code", { text: t.name }), t.description ? " — " + t.description : ""),
      el("p", { class: "muted", text: "input schema" }),
      el("pre", { text: schemaText(t.input_schema_json) })))));
  const failed = (p.failed_servers || []).map((s) => el("div", { class: "card failed-server", "data-server": s.name },
    el("strong", { text: s.name }), " ", el("span", { class: "muted", text: s.config_path }),
    el("p", { class: "failed", text: (STATUS[s.status] || s.status) + ": " + s.error })));
  const disabled = (p.disabled_servers || []).map((s) => el("div", { class: "card disabled-server", "data-server": s.name },
    el("strong", { text: s.name }), " ", el("span", { class: "muted", text: s.config_path }),
    el("p", { class: "muted", text: "disabled in its config file: not started" })));
  const invalid = (p.invalid_config_files || []).map((f) => el("div", { class: "card invalid-config", "data-path": f.path },
    el("strong", { text: f.path }),
    el("p", { class: "failed", text: (STATUS[f.status] || f.status) + ": " + f.error })));
  const files = (p.instruction_files || []).map((f) => el("details", { class: "card instruction-file" },
    el("summary", { text: f.path + (f.truncated ? " (truncated)" : "") }),
    el("pre", { text: f.content })));
  const skills = (p.skills || []).map((s) => el("div", { class: "card skill" },
    el("strong", { text: s.name }), " ", el("span", { class: "muted", text: s.dir }), el("p", { text: s.description })));
  const body = $("agent-body");
  body.dataset.phase = phase;
  body.dataset.stale = String(!!p.stale);
  body.dataset.tools = String(c.tools || 0);
  body.dataset.withheld = String(c.tools_withheld || 0);
  body.replaceChildren(...[
    el("dl", { class: "facts" },
      el("dt", { text: "Phase" }), el("dd", {}, badge(phase, PHASES), p.stale ? el("span", { class: "badge FRESHNESS_STALE", text: "stale report" }) : null),
      el("dt", { text: "Agent id" }), el("dd", { text: p.agent_id }),
      el("dt", { text: "Running process" }), el("dd", { text: p.agent_run_id || "legacy (no run id)" }),
      el("dt", { text: "Report" }), el("dd", { text: p.has_snapshot ? "run " + p.snapshot_agent_run_id + ", version " + p.snapshot_version : "none yet" }),
      el("dt", { text: "Tools" }), el("dd", { text: (c.tools || 0) + " offered, " + (c.tools_withheld || 0) + " withheld" })),
    el("p", { class: "summary", text: p.summary }),
    p.store_error ? el("p", { class: "error", text: "store: " + p.store_error }) : null,
    section("Usable servers", servers, "none"),
    section("Failed servers", failed, "none"),
    section("Disabled servers", disabled, "none"),
    section("Invalid config files", invalid, "none"),
    section("Instruction files", files, "none"),
    section("Skills", skills, "none")].flat(2).filter(Boolean));
  window.ctxsyncPage.renders.push({ agentId: p.agent_id, origin, phase, stale: !!p.stale, tools: c.tools || 0, withheld: c.tools_withheld || 0, at: Date.now() });
}

async function openAgent(id) {
  show("agent");
  state.current = id;
  $("agent-error").textContent = "";
  const seen = state.eventsFor;
  try {
    // The agent's name and workspace come from its line in the list.
    if (!state.agents.has(id)) await loadAgents();
    const projection = await api("/api/v1/agents/" + encodeURIComponent(id) + "/context");
    if (state.current === id && state.eventsFor === seen) renderAgent(projection, "read");
  } catch (e) {
    if (e.status === 401) return;
    $("agent-body").replaceChildren();
    $("agent-error").textContent = e.status === 404 ? "No such agent for this key." : "Cannot read the agent: " + e.message;
  }
}

// ---- the catalog ----
const WARMUP = { WARMUP_PENDING: "not tried yet", WARMUP_DISCOVERED: "discovered", WARMUP_FAILING: "failing, retried", WARMUP_ABANDONED: "abandoned", WARMUP_UNSPECIFIED: "unknown" };
const TRANSPORTS = { MCP_TRANSPORT_STDIO: "stdio", MCP_TRANSPORT_STREAMABLE_HTTP: "streamable HTTP", MCP_TRANSPORT_SSE: "HTTP+SSE" };
const SVG = "http://www.w3.org/2000/svg";
const ms = (v) => v === undefined || v === null ? "-" : (v >= 1000 ? (v / 1000).toFixed(2) + " s" : v.toFixed(1) + " ms");
const hour = (ts) => new Date(ts).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, String(value));
  }
  node.append(...children);
  return node;
}

// A chart and its data as a table (for screen readers and exact values).
function chart(id, label, drawing, head, rows) {
  const table = el("table", {},
    el("thead", {}, el("tr", {}, head.map((h) => el("th", { scope: "col", text: h })))),
    el("tbody", {}, rows.map((r) => el("tr", {}, r.map((c) => el("td", { text: c }))))));
  $(id).replaceChildren(drawing,
    el("details", {}, el("summary", { text: "Data as a table" }), table));
  drawing.setAttribute("role", "img");
  drawing.setAttribute("aria-label", label);
  drawing.prepend(svg("title", { text: label }));
}

function setupChart(buckets) {
  const W = 600, H = 220, L = 56, B = 28, T = 12, R = 12;
  const points = buckets.map((b) => ({ start: b.start, s: b.setup || {} }));
  const max = Math.max(1, ...points.flatMap((p) => [p.s.p50_ms || 0, p.s.p90_ms || 0]));
  const x = (i) => L + (points.length < 2 ? 0 : i * (W - L - R) / (points.length - 1));
  const y = (v) => T + (H - T - B) * (1 - v / max);
  const line = (field) => {
    const parts = [];
    let pen = "M";
    points.forEach((p, i) => {
      const v = p.s[field];
      if (v === undefined || v === null) { pen = "M"; return; }
      parts.push(pen + x(i).toFixed(1) + " " + y(v).toFixed(1));
      pen = "L";
    });
    return parts.join(" ");
  };
  const dots = (field) => points.flatMap((p, i) => p.s[field] === undefined || p.s[field] === null ? [] :
    [svg("circle", { cx: x(i).toFixed(1), cy: y(p.s[field]).toFixed(1), r: 3, class: field.replace("_ms", "") })]);
  const drawing = svg("svg", { viewBox: `0 0 ${W} ${H}`, "data-chart": "setup" },
    svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }),
    svg("text", { x: L - 6, y: T + 8, "text-anchor": "end", text: ms(max) }),
    svg("text", { x: L - 6, y: H - B, "text-anchor": "end", text: "0" }),
    ...points.filter((_, i) => i % 3 === 0).map((p) => svg("text", { x: x(points.indexOf(p)), y: H - 8, "text-anchor": "middle", text: hour(p.start) })),
    svg("path", { class: "p50", d: line("p50_ms") }), ...dots("p50_ms"),
    svg("path", { class: "p90", d: line("p90_ms") }), ...dots("p90_ms"),
    svg("text", { x: L + 8, y: T + 8, text: "— p50   - - p90" }));
  const prepared = points.reduce((n, p) => n + Number(p.s.count || 0), 0);
  chart("setup-chart", `First-turn setup p50 and p90 per period: ${prepared} first preparations`, drawing,
    ["from", "preparations", "p50", "p90"],
    points.map((p) => [hour(p.start), String(p.s.count || 0), ms(p.s.p50_ms), ms(p.s.p90_ms)]));
}

function waitsChart(waits) {
  const W = 600, rowH = 28, L = 150, R = 90;
  const rows = waits.map((g) => ({ outcome: g.outcome, w: g.wait || {} }));
  const max = Math.max(1, ...rows.map((r) => Number(r.w.count || 0)));
  const H = Math.max(1, rows.length) * rowH + 8;
  const drawing = svg("svg", { viewBox: `0 0 ${W} ${H}`, "data-chart": "waits" },
    ...rows.flatMap((r, i) => {
      const n = Number(r.w.count || 0);
      const top = 4 + i * rowH;
      return [
        svg("text", { x: L - 8, y: top + rowH / 2 + 4, "text-anchor": "end", text: r.outcome }),
        svg("rect", { class: "bar", x: L, y: top + 4, height: rowH - 8, width: Math.max(2, (W - L - R) * n / max).toFixed(1) }),
        svg("text", { x: L + Math.max(2, (W - L - R) * n / max) + 6, y: top + rowH / 2 + 4, text: `${n} · p50 ${ms(r.w.p50_ms)}` }),
      ];
    }),
    ...(rows.length ? [] : [svg("text", { x: 8, y: 20, text: "no gate waits in this window" })]));
  chart("waits-chart", `Gate waits by outcome: ${rows.map((r) => r.outcome + " " + (r.w.count || 0)).join(", ") || "none"}`, drawing,
    ["outcome", "waits", "p50", "p90", "max"],
    rows.map((r) => [r.outcome, String(r.w.count || 0), ms(r.w.p50_ms), ms(r.w.p90_ms), ms(r.w.max_ms)]));
}

async function openCatalog() {
  state.current = null;
  show("catalog");
  $("catalog-error").textContent = "";
  let reply;
  try {
    reply = await api("/api/v1/catalog");
  } catch (e) {
    if (e.status === 401) return;
    $("catalog-error").textContent = e.status === 404 ? "This gate does not use a catalog." : "Cannot read the catalog: " + e.message;
    return;
  }
  const servers = reply.servers || [];
  $("catalog-rows").replaceChildren(...servers.map((s) => el("tr", { "data-server-id": s.server_id, "data-warmup": s.warmup || "WARMUP_UNSPECIFIED" },
    el("td", { "data-label": "Server" }, el("code", { text: s.server_id })),
    el("td", { "data-label": "Transport", text: TRANSPORTS[s.transport] || s.transport || "-" }),
    el("td", { "data-label": "Next pin from", text: s.remembered ? "memory (no start)" : "live discovery" }),
    el("td", { "data-label": "Tools", title: s.catalog_hash || "", text: s.remembered ? (s.tool_count || 0) : "-" }),
    el("td", { "data-label": "Warm-up" }, badge(s.warmup || "WARMUP_UNSPECIFIED", WARMUP)))));
  $("catalog-empty").hidden = servers.length > 0;
  setupChart(reply.setup || []);
  waitsChart(reply.gate_waits || []);
  window.ctxsyncPage.catalog = { servers: servers.length, at: Date.now() };
}

// ---- live ----
function closeEvents() {
  if (state.source) state.source.close();
  state.source = null;
  setLive(false);
}

function setLive(on) {
  window.ctxsyncPage.live = on;
  $("live").textContent = on ? "live" : "offline";
  $("live").classList.toggle("on", on);
}

async function openEvents() {
  closeEvents();
  let ticket;
  try {
    ticket = (await api("/api/v1/events/ticket", { method: "POST" })).ticket;
  } catch (e) {
    if (e.status !== 401) setTimeout(openEvents, state.retry = Math.min(state.retry * 2, 10000));
    return;
  }
  const source = new EventSource("/api/v1/events?ticket=" + encodeURIComponent(ticket));
  state.source = source;
  source.addEventListener("ready", () => {
    state.retry = 500;
    setLive(true);
    refresh();
  });
  source.addEventListener("resync", refresh);
  source.addEventListener("agent", (message) => {
    const event = JSON.parse(message.data);
    const arrived = Date.now();
    if (event.summary) state.agents.set(event.agent_id, event.summary);
    renderAgents();
    if (state.current === event.agent_id && event.projection) {
      state.eventsFor++;
      renderAgent(event.projection, "event");
      const last = window.ctxsyncPage.renders[window.ctxsyncPage.renders.length - 1];
      last.revision = event.revision;
      last.committedAt = event.committed_at;
      last.arrived = arrived;
    }
  });
  source.onerror = () => {
    // The stream ended (its ticket is single-use): get a new one.
    if (state.source !== source) return;
    closeEvents();
    setTimeout(openEvents, state.retry = Math.min(state.retry * 2, 10000));
  };
}

function refresh() {
  loadAgents().catch((e) => { if (e.status !== 401) $("agents-error").textContent = "Cannot list the agents: " + e.message; });
  if (state.current) openAgent(state.current);
}

function route() {
  if (!key()) return showLogin("");
  const match = location.hash.match(/^#agent\/([0-9a-fA-F-]{1,64})$/);
  if (location.hash === "#catalog") {
    openCatalog();
  } else if (match) {
    openAgent(match[1]);
  } else {
    state.current = null;
    show("agents");
    loadAgents().catch((e) => { if (e.status !== 401) $("agents-error").textContent = "Cannot list the agents: " + e.message; });
  }
  if (!state.source) openEvents();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("key").value.trim();
    $("key").value = "";
    if (!value) return;
    sessionStorage.setItem(KEY, value);
    route();
  });
  $("forget").addEventListener("click", () => { sessionStorage.removeItem(KEY); showLogin(""); });
  $("search").addEventListener("input", renderAgents);
  $("freshness").addEventListener("change", renderAgents);
  window.addEventListener("hashchange", route);
  route();
});

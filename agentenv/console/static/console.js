// agentenv console: read-only views over the JSON API (every call sends X-API-Key).
"use strict";
(function () {
  const $ = (sel) => document.querySelector(sel);
  const state = { key: localStorage.getItem("agentenv.apiKey") || "", charts: [], cy: null, timer: null };
  const api = window.agentenvConsole = { state };

  function esc(s) { return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c])); }
  function mib(b) { return b == null ? "" : (b / 1048576).toFixed(1) + " MiB"; }
  function status(msg) { $("#status").textContent = msg || ""; }

  async function get(path, opts = {}) {
    const r = await fetch(path, { ...opts, headers: { "X-API-Key": state.key, ...(opts.headers || {}) } });
    if (r.status === 401) { status("API key refused"); throw new Error("unauthorized"); }
    if (!r.ok) { let m = r.statusText; try { m = (await r.json()).message; } catch (e) { } throw new Error(`${path}: ${r.status} ${m}`); }
    return r.json();
  }

  // ---- overview: nodes + sandboxes with filters
  async function renderOverview() {
    const nodes = await get("/observability/nodes");
    $("#nodes").innerHTML = nodes.map((n) => {
      const pct = n.capacity ? Math.round(100 * n.active / n.capacity) : 0;
      const memPct = n.memTotal ? Math.round(100 * (n.memTotal - n.memAvailable) / n.memTotal) : 0;
      const states = Object.entries(n.sandboxes).map(([k, v]) => `${esc(k)}: ${v}`).join(", ") || "none";
      return `<div class="node" data-node-id="${esc(n.nodeID)}"><b>${esc(n.nodeID)}</b> · ${esc(n.runtime)} · ${esc(n.status)}
        <div>sandboxes ${n.active} / ${n.capacity} active (${states})</div><div class="bar"><div style="width:${pct}%"></div></div>
        <div>host memory ${memPct}% · load ${n.load.map((x) => x.toFixed(2)).join(" ")} on ${n.cpus} CPUs</div><div class="bar"><div style="width:${memPct}%"></div></div>
        <div>sandboxes use ${n.sandboxCpuCores.toFixed(2)} cores, ${mib(n.sandboxMemUsed)} memory, ${mib(n.sandboxDiskUsed)} disk · ${n.snapshots} snapshots (${mib(n.snapshotBytes)})</div></div>`;
    }).join("");
    const q = new URLSearchParams({ limit: "100" });
    q.set("state", $("#f-state").value || "running,paused");
    if ($("#f-template").value.trim()) q.set("template", $("#f-template").value.trim());
    if ($("#f-metadata").value.trim()) q.set("metadata", $("#f-metadata").value.trim());
    const [list, lineage, metrics] = await Promise.all([get("/v2/sandboxes?" + q), get("/observability/lineage"), get("/sandboxes/metrics")]);
    const from = {};
    for (const e of lineage.edges) from[e.to] = e;
    const rows = list.map((s) => {
      const m = metrics.sandboxes[s.sandboxID] || {};
      const e = from[s.sandboxID];
      const origin = e ? (e.kind === "fork" ? `fork of ${e.from}` : e.kind === "restore" ? `snapshot ${e.from}` : "template") : "";
      const md = Object.entries(s.metadata || {}).map(([k, v]) => `${esc(k)}=${esc(v)}`).join(" ");
      return `<tr data-sandbox-id="${esc(s.sandboxID)}"><td class="id"><a href="#/sandbox/${esc(s.sandboxID)}">${esc(s.sandboxID)}</a></td>
        <td><span class="badge ${esc(s.state)}">${esc(s.state)}</span></td><td>${esc(s.alias || s.templateID)}</td><td class="id">${esc(origin)}</td>
        <td>${esc(new Date(s.startedAt).toLocaleTimeString())}</td><td>${m.cpuUsedPct ?? ""}</td><td>${mib(m.memUsed)}</td><td>${mib(m.diskUsed)}</td><td>${md}</td></tr>`;
    });
    $("#sandboxes tbody").innerHTML = rows.join("") || `<tr><td colspan="9">no sandboxes</td></tr>`;
  }

  // ---- sandbox detail: info, charts, processes, logs
  function chart(el, title, xs, ys, color) {
    const opts = { width: Math.max(360, el.clientWidth || 360), height: 200, legend: { show: false },
      series: [{}, { label: title, stroke: color, fill: color + "33", width: 2 }], axes: [{}, { size: 60 }] };
    el.innerHTML = "";
    const u = new uPlot(opts, [xs, ys], el);
    state.charts.push(u);
    return u;
  }

  async function renderSandbox(id) {
    const s = await get(`/sandboxes/${encodeURIComponent(id)}`);
    $("#d-id").textContent = id;
    $("#d-state").textContent = s.state; $("#d-state").className = "badge " + s.state;
    const info = { template: s.alias || s.templateID, started: s.startedAt, "ends": s.endAt, CPUs: s.cpuCount,
      "memory MB": s.memoryMB, "disk MB": s.diskSizeMB, metadata: JSON.stringify(s.metadata || {}) };
    $("#d-info").innerHTML = Object.entries(info).map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("");
    const series = await get(`/sandboxes/${encodeURIComponent(id)}/metrics`);
    const xs = series.map((m) => m.timestampUnix);
    state.charts.forEach((c) => c.destroy()); state.charts = [];
    chart($("#chart-cpu"), "CPU %", xs, series.map((m) => m.cpuUsedPct), "#4a7bd0");
    chart($("#chart-mem"), "memory", xs, series.map((m) => m.memUsed / 1048576), "#2e9d57");
    chart($("#chart-disk"), "disk", xs, series.map((m) => m.diskUsed / 1048576), "#8a5cd0");
    const logs = await get(`/v2/sandboxes/${encodeURIComponent(id)}/logs?direction=backward&limit=100`);
    $("#d-logs tbody").innerHTML = logs.logs.map((l) => `<tr class="level-${esc(l.level)}"><td>${esc(new Date(l.timestamp).toLocaleTimeString())}</td><td>${esc(l.level)}</td><td>${esc(l.message)}</td></tr>`).join("");
    let procs = [];
    if (s.state === "running" && s.envdAccessToken !== undefined) {
      try {  // envd's process list through the data-plane proxy (Connect unary, JSON codec)
        const r = await fetch("/process.Process/List", { method: "POST", body: "{}", headers: {
          "Content-Type": "application/json", "Connect-Protocol-Version": "1", "E2b-Sandbox-Id": id,
          "E2b-Sandbox-Port": "49983", "X-Access-Token": s.envdAccessToken || "", "Authorization": "Basic " + btoa("user:") } });
        if (r.ok) procs = (await r.json()).processes || [];
      } catch (e) { /* processes are optional */ }
    }
    $("#d-procs tbody").innerHTML = procs.map((p) => `<tr><td>${esc(p.pid)}</td><td><code>${esc([p.config?.cmd, ...(p.config?.args || [])].join(" "))}</code></td><td>${esc(p.tag || "")}</td></tr>`).join("") || `<tr><td colspan="3">${s.state === "running" ? "no processes started through envd" : "not running"}</td></tr>`;
    api.detail = { id, points: series.length, charts: state.charts.length };
  }

  // ---- lineage graph
  async function renderLineage() {
    const g = await get("/observability/lineage");
    // Short labels (ids are 21 characters; siblings sit side by side): the full id is on hover.
    const short = (n) => n.kind === "template" ? "template " + n.label : (n.label.length > 12 ? n.label.slice(0, 9) + "…" : n.label);
    const els = g.nodes.map((n) => ({ data: { id: n.id, label: short(n), full: n.label, kind: n.kind, state: n.state || "" } }))
      .concat(g.edges.map((e, i) => ({ data: { id: "e" + i, source: e.from, target: e.to, kind: e.kind } })));
    if (state.cy) state.cy.destroy();
    const cy = state.cy = cytoscape({
      container: $("#lineage"), elements: els, wheelSensitivity: 0.3,
      layout: { name: "dagre", rankDir: "TB", nodeSep: 40, rankSep: 70 },
      style: [
        { selector: "node", style: { label: "data(label)", "font-size": 10, "text-valign": "bottom", "text-margin-y": 4, width: 22, height: 22, "background-color": "#4a7bd0" } },
        { selector: 'node[kind = "template"]', style: { shape: "round-rectangle", "background-color": "#6c757d", width: 40 } },
        { selector: 'node[kind = "snapshot"]', style: { shape: "diamond", "background-color": "#8a5cd0" } },
        { selector: 'node[state = "running"]', style: { "background-color": "#2e9d57" } },
        { selector: 'node[state = "paused"]', style: { "background-color": "#d08a1c" } },
        { selector: 'node[state = "gone"]', style: { "background-color": "#b5b9c0" } },
        { selector: "edge", style: { width: 1.5, "curve-style": "bezier", "target-arrow-shape": "triangle", "line-color": "#9aa3b2", "target-arrow-color": "#9aa3b2", label: "data(kind)", "font-size": 8, color: "#6b7280" } },
      ],
    });
    cy.on("mouseover", "node", (ev) => { $("#lineage").title = `${ev.target.data("kind")} ${ev.target.data("full")} ${ev.target.data("state")}`; });
    cy.on("tap", 'node[kind = "sandbox"]', (ev) => { if (ev.target.data("state") !== "gone") location.hash = "#/sandbox/" + ev.target.id(); });
    api.lineage = g;
  }

  async function renderSnapshots() {
    const [templates, snaps] = await Promise.all([get("/templates"), get("/snapshots?limit=100")]);
    $("#templates tbody").innerHTML = templates.map((t) => `<tr><td class="id">${esc(t.templateID)}</td><td>${esc((t.aliases || []).join(", "))}</td><td>${esc(t.cpuCount)}</td><td>${esc(t.memoryMB)}</td><td>${esc(t.diskSizeMB)}</td></tr>`).join("");
    $("#snapshots tbody").innerHTML = snaps.map((s) => `<tr><td class="id">${esc(s.snapshotID)}</td><td>${esc((s.names || []).join(", "))}</td></tr>`).join("") || `<tr><td colspan="2">no snapshots</td></tr>`;
  }

  async function renderEvents() {
    const r = await get("/events?tail=200");
    $("#events tbody").innerHTML = r.events.reverse().map((e) => {
      const { seq, timestamp, type, sandboxID, ...rest } = e;
      return `<tr data-type="${esc(type)}"><td>${seq}</td><td>${esc(new Date(timestamp).toLocaleTimeString())}</td><td>${esc(type)}</td><td class="id">${esc(sandboxID || "")}</td><td><code>${esc(JSON.stringify(rest))}</code></td></tr>`;
    }).join("");
  }

  // ---- routing
  async function route() {
    const h = location.hash || "#/";
    const m = h.match(/^#\/sandbox\/([a-z0-9]+)$/);
    const view = m ? "sandbox" : (h.slice(2) || "overview");
    document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== "view-" + view; });
    document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.view === view));
    if (!state.key) { status("enter an API key"); return; }
    status("loading…");
    try {
      if (view === "overview") await renderOverview();
      else if (view === "sandbox") await renderSandbox(m[1]);
      else if (view === "lineage") await renderLineage();
      else if (view === "snapshots") await renderSnapshots();
      else if (view === "events") await renderEvents();
      status("");
      api.rendered = view;
    } catch (e) { status(e.message); api.error = e.message; }
  }
  api.route = route;

  $("#api-key").value = state.key;
  $("#key-form").addEventListener("submit", (ev) => {
    ev.preventDefault(); state.key = $("#api-key").value.trim(); localStorage.setItem("agentenv.apiKey", state.key); route();
  });
  $("#filters").addEventListener("submit", (ev) => { ev.preventDefault(); renderOverview().catch((e) => status(e.message)); });
  window.addEventListener("hashchange", route);
  if (typeof cytoscapeDagre !== "undefined") cytoscape.use(cytoscapeDagre);
  route();
})();

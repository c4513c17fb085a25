/*
 * app.js - the scheduler's dashboard: polls /api/history and /api/snapshot once a
 * second and draws them with uPlot (built into the binary beside this file).
 */
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
const plots = {};   // id -> {u: uPlot, key: series signature}
let updates = 0;    // history updates drawn (read by the browser test)

function fmtBytes(v) {
  if (v == null) return "-";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return v.toFixed(i ? 1 : 0) + " " + u[i];
}
function fmtNum(v, d) { return v == null ? "-" : Number(v).toFixed(d === undefined ? 1 : d); }
function fmtSec(v) {
  if (v == null) return "-";
  return v < 1e-3 ? (v * 1e6).toFixed(0) + " us" : v < 1 ? (v * 1e3).toFixed(2) + " ms" : v.toFixed(2) + " s";
}

// Draw (or redraw) plot id with x values t and series [{label, data, color, fill}]; the
// y axis starts at 0 (a share of time tops out at 100%: share set).
function draw(id, t, series, axisFmt, share) {
  const el = document.getElementById(id);
  const live = series.filter(s => s.data.some(v => v != null));
  if (!live.length || t.length < 2) {
    if (plots[id]) { plots[id].u.destroy(); delete plots[id]; }
    el.innerHTML = '<div class="empty">no data yet</div>';
    el.dataset.points = "0";
    return;
  }
  const key = live.map(s => s.label).join("|");
  const data = [t].concat(live.map(s => s.data));
  if (plots[id] && plots[id].key === key) {
    plots[id].u.setData(data);
  } else {
    if (plots[id]) plots[id].u.destroy();
    el.innerHTML = "";
    const opts = {
      width: Math.max(el.clientWidth, 400), height: 240,
      scales: {
        x: { time: true },
        y: { range: (u, min, max) => [Math.min(0, min), share ? Math.max(1, max) : (max > 0 ? max * 1.1 : 1)] },
      },
      axes: [{}, { size: 80, values: (u, vals) => vals.map(v => axisFmt ? axisFmt(v) : v) }],
      series: [{}].concat(live.map((s, i) => ({
        label: s.label, stroke: s.color || COLORS[i % COLORS.length], width: 1.5,
        fill: s.fill || undefined, spanGaps: false,
        value: (u, v) => axisFmt ? axisFmt(v) : fmtNum(v, 3),
      }))),
    };
    plots[id] = { u: new uPlot(opts, data, el), key: key };
  }
  el.dataset.points = String(live.reduce((n, s) => n + s.data.filter(v => v != null).length, 0));
}

function nodeLabel(n) { return n.role + " " + n.rank + " (node " + n.id + ")"; }

function perNode(h, role, field) {
  return h.nodes.filter(n => !role || n.role === role).map((n, i) => ({ label: nodeLabel(n), data: n.series[field] }));
}

// The step split: the workers' compute / pull wait / push wait, as shares of their time,
// stacked (each series drawn as the running sum, the largest first).
function split(h) {
  const ws = h.nodes.filter(n => n.role === "worker");
  const len = h.t.length;
  const parts = ["compute", "pull_wait", "push_wait"].map(f => {
    const out = new Array(len).fill(null);
    for (let k = 0; k < len; k++) {
      let sum = 0, cnt = 0;
      for (const n of ws) { const v = n.series[f][k]; if (v != null) { sum += v; cnt++; } }
      if (cnt) out[k] = sum / cnt;
    }
    return out;
  });
  const stack = [parts[0], parts[0].map((v, k) => v == null ? null : v + parts[1][k]),
                 parts[0].map((v, k) => v == null ? null : v + parts[1][k] + parts[2][k])];
  return [
    { label: "waiting for pushes (top)", data: stack[2], color: "#d62728", fill: "rgba(214,39,40,0.35)" },
    { label: "waiting for pulls", data: stack[1], color: "#ff7f0e", fill: "rgba(255,127,14,0.45)" },
    { label: "compute", data: stack[0], color: "#2ca02c", fill: "rgba(44,160,44,0.55)" },
  ];
}

function total(series) {
  if (series.length < 2) return series;
  const len = series[0].data.length, out = new Array(len).fill(null);
  for (let k = 0; k < len; k++)
    for (const s of series) if (s.data[k] != null) out[k] = (out[k] || 0) + s.data[k];
  return series.concat([{ label: "total", data: out, color: "#000" }]);
}

function drawHistory(h) {
  const t = h.t;
  draw("plot-throughput", t, total(perNode(h, "worker", "examples_per_s")), v => fmtNum(v, 0));
  draw("plot-loss", t, perNode(h, "worker", "loss"), v => fmtNum(v, 4));
  draw("plot-split", t, split(h), v => v == null ? "-" : (v * 100).toFixed(0) + "%", true);
  const net = h.nodes.map(n => ({
    label: nodeLabel(n),
    data: n.series.bytes_in_per_s.map((v, k) => v == null && n.series.bytes_out_per_s[k] == null ? null
      : (v || 0) + (n.series.bytes_out_per_s[k] || 0)),
  }));
  draw("plot-network", t, net, fmtBytes);
  draw("plot-memory", t, perNode(h, "server", "resident_bytes"), fmtBytes);
  draw("plot-staleness", t, perNode(h, "server", "staleness"), v => fmtNum(v, 2));
  updates++;
  document.body.dataset.updates = String(updates);
  document.body.dataset.samples = String(t.length);
  document.body.dataset.last = String(t.length ? t[t.length - 1] : 0);
}

function drawSnapshot(s) {
  const j = s.job;
  document.getElementById("job").textContent =
    `epoch ${j.epoch} - ${j.started === 2 ? "finished" : j.started ? "running" : "waiting for nodes"} - ` +
    `servers ${j.servers_alive}/${j.servers_expected}, workers ${j.workers_alive}/${j.workers_expected} - ` +
    `up ${j.uptime_s.toFixed(0)} s`;
  const tb = document.querySelector("#nodes tbody");
  tb.innerHTML = "";
  for (const n of s.nodes) {
    const f = n.figures, tr = document.createElement("tr");
    const cells = [n.id, n.role, n.rank, n.state, n.addr || "-", fmtNum(f.examples_per_s, 0), fmtNum(f.pushes_per_s),
                   fmtNum(f.pulls_per_s), fmtBytes(f.bytes_in_per_s), fmtBytes(f.bytes_out_per_s),
                   fmtBytes(f.resident_bytes), fmtSec(f.push_latency_s),
                   n.metrics_age_s == null ? "-" : n.metrics_age_s.toFixed(1) + " s"];
    cells.forEach((c, i) => {
      const td = document.createElement("td");
      td.textContent = String(c);
      if (i === 3) td.className = n.state;
      tr.appendChild(td);
    });
    tb.appendChild(tr);
  }
  document.body.dataset.nodes = String(s.nodes.length);
}

async function poll() {
  try {
    const [h, s] = await Promise.all([fetch("/api/history").then(r => r.json()), fetch("/api/snapshot").then(r => r.json())]);
    drawSnapshot(s);
    drawHistory(h);
  } catch (e) {
    document.getElementById("job").textContent = "the scheduler does not answer (" + e.message + ")";
  }
  setTimeout(poll, 1000);
}
poll();

// The kvstore status page: polls status.json every 2 s and renders it (scheduler/status_page.py
// says what the feed holds). Data goes into the page as text only (textContent), never as HTML.
"use strict";

const POLL_MS = 2000;
const KEY_STORE = "kvstore-status-key";

function apiKey() {
  const m = /(?:^#|&)key=([^&]+)/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(KEY_STORE, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);  // the key leaves the address bar
  }
  return sessionStorage.getItem(KEY_STORE);
}

function $(id) { return document.getElementById(id); }

function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }

function size(n) {   // bytes, in the largest binary unit that keeps the number >= 1
  for (const [unit, b] of [["GiB", 2 ** 30], ["MiB", 2 ** 20]]) if (n >= b) return (n / b).toFixed(1) + " " + unit;
  return (n / 1024).toFixed(1) + " KiB";
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function fill(tbody, rows, make) {
  tbody.replaceChildren();
  for (const r of rows) make(tbody.insertRow(), r);
}

function renderNodes(nodes) {
  const rows = [];
  for (const n of nodes) {
    if (!n.tiers.length) rows.push({ node: n, tier: null });
    for (const t of n.tiers) rows.push({ node: n, tier: t });
  }
  fill($("nodes").tBodies[0], rows, (tr, { node, tier }) => {
    tr.dataset.node = node.node_id;
    cell(tr, node.node_id, "text");
    cell(tr, node.address, "text");
    cell(tr, node.state, node.state === "up" ? "text" : "text down");
    if (!tier) { for (let i = 0; i < 7; i++) cell(tr, "–"); return; }
    tr.dataset.tier = tier.name;
    cell(tr, tier.name, "text");
    cell(tr, size(tier.used_bytes) + " of " + size(tier.capacity_bytes)).dataset.field = "used";
    const use = cell(tr, "");
    const bar = document.createElement("span"), inner = document.createElement("span");
    bar.className = "bar";
    const frac = tier.capacity_bytes ? tier.used_bytes / tier.capacity_bytes : 0;
    inner.style.width = (100 * Math.min(1, frac)).toFixed(1) + "%";
    bar.appendChild(inner);
    use.appendChild(bar);
    use.appendChild(document.createTextNode(" " + pct(frac)));
    use.dataset.field = "use";
    cell(tr, String(tier.blocks)).dataset.field = "blocks";
    cell(tr, String(tier.lookup_hits)).dataset.field = "lookup-hits";
    cell(tr, String(tier.lookup_misses)).dataset.field = "lookup-misses";
    cell(tr, String(tier.hits)).dataset.field = "hits";
    cell(tr, String(tier.misses)).dataset.field = "misses";
    const reads = tier.hits + tier.misses;
    cell(tr, reads ? pct(tier.hits / reads) : "–").dataset.field = "read-success";
  });
}

function renderChart(series) {
  const svg = $("chart"), W = 640, H = 120, ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const t1 = series.length ? series[series.length - 1].t : 0, t0 = series.length ? series[0].t : 0;
  const span = Math.max(1, t1 - t0), L = 40;
  const y = (v) => H - 8 - v * (H - 16);
  for (const v of [0, 0.5, 1]) {   // grid lines at 0, 50 and 100 %
    const g = document.createElementNS(ns, "line");
    g.setAttribute("x1", L); g.setAttribute("x2", W - 5); g.setAttribute("y1", y(v)); g.setAttribute("y2", y(v));
    g.setAttribute("stroke", "#ddd");
    svg.appendChild(g);
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", 4); label.setAttribute("y", y(v) + 4); label.setAttribute("font-size", "11");
    label.setAttribute("fill", "#777");
    label.textContent = 100 * v + "%";
    svg.appendChild(label);
  }
  for (const [field, colour] of [["tokens", "#4a78c2"], ["lookups", "#e08a1e"], ["handoff", "#999999"]]) {
    const pts = series.filter((p) => p[field] !== null)
      .map((p) => [(p.t - t0) / span * (W - L - 10) + L + 5, y(p[field])]);
    if (!pts.length) continue;
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.map(([a, b]) => `${a.toFixed(1)},${b.toFixed(1)}`).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colour);
    line.setAttribute("stroke-width", "2");
    line.dataset.series = field;
    svg.appendChild(line);
    for (const [a, b] of pts) {
      const dot = document.createElementNS(ns, "circle");
      dot.setAttribute("cx", a.toFixed(1)); dot.setAttribute("cy", b.toFixed(1)); dot.setAttribute("r", "2.5");
      dot.setAttribute("fill", colour);
      svg.appendChild(dot);
    }
  }
}

function render(s) {
  const badge = $("status");
  badge.textContent = s.status;
  badge.className = "badge " + s.status;
  $("model").textContent = s.model;
  $("policy").textContent = s.policy;
  $("updated").textContent = new Date((s.sampled_at || s.time) * 1000).toLocaleTimeString();
  $("reasons").replaceChildren(...s.reasons.map((r) => { const li = document.createElement("li"); li.textContent = r; return li; }));
  const minutes = String(Math.round(s.hit_ratio.window_s / 60));
  $("window").textContent = minutes;
  for (const el of document.querySelectorAll(".window-min")) el.textContent = minutes;
  $("hit-tokens").textContent = pct(s.hit_ratio.tokens);
  $("hit-lookups").textContent = pct(s.hit_ratio.lookups);
  $("hit-reads").textContent = pct(s.hit_ratio.reads);
  $("hit-handoff").textContent = pct(s.hit_ratio.handoff);
  const sources = Object.entries(s.hit_ratio.by_source || {}).filter(([, v]) => v);
  $("hit-sources").textContent = sources.length ? "(" + sources.map(([k, v]) => k + " " + pct(v)).join(", ") + ")" : "";
  renderChart(s.hit_ratio.series);
  renderNodes(s.nodes);
  fill($("instances").tBodies[0], s.instances, (tr, i) => {
    tr.dataset.instance = i.id;
    cell(tr, i.id, "text");
    cell(tr, i.role, "text");
    cell(tr, i.state, i.state === "up" ? "text" : "text down");
    cell(tr, i.role === "prefill" ? String(i.queued) : "–").dataset.field = "queued";
    cell(tr, i.role === "decode" ? String(i.running) : "–").dataset.field = "running";
  });
  const a = s.admission;
  $("admitted").textContent = String(a.admitted);
  $("inflight").textContent = String(a.inflight);
  $("admitted-window").textContent = String(a.admitted_in_window);
  $("rejected-window").textContent = String(a.rejected_in_window);
  const reasons = Object.entries(a.rejected);
  fill($("rejected").tBodies[0], reasons.length ? reasons : [["none", 0]], (tr, [reason, n]) => {
    tr.dataset.reason = reason;
    cell(tr, reason, "text");
    cell(tr, String(n));
  });
}

async function poll() {
  const key = apiKey();
  try {
    const resp = await fetch("status.json", { headers: key ? { Authorization: "Bearer " + key } : {}, cache: "no-store" });
    if (resp.status === 401) {   // stop polling until a key is entered
      sessionStorage.removeItem(KEY_STORE);
      clearInterval(timer);
      timer = null;
      $("key-form").style.display = "block";
      $("error").textContent = key ? "that API key was refused" : "an API key is needed";
      document.body.dataset.state = "need-key";
      return;
    }
    if (!resp.ok) throw new Error("status.json answered HTTP " + resp.status);
    render(await resp.json());
    $("key-form").style.display = "none";
    $("error").textContent = "";
    document.body.dataset.state = "ready";
  } catch (err) {
    $("error").textContent = String(err);
    document.body.dataset.state = "error";
  }
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
  $("key-input").value = "";
  poll();
  if (timer === null) timer = setInterval(poll, POLL_MS);
});

let timer = setInterval(poll, POLL_MS);
poll();

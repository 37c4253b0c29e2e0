// kvserve cache inspector: renders /ui/api/* (JSON) into the page; no framework, no build step.
"use strict";

const KEY_STORE = "kvserve-inspector-key";
const POLL_MS = 2000;
const CAUSE_COLORS = {
  first_request: "#adb5bd", new_tokens: "#ced4da", block_granularity: "#dee2e6", evicted: "#f59f00",
  different_salt: "#74c0fc", tool_list: "#f783ac", system_prompt: "#e03131", compaction: "#9775fa",
  template_reasoning: "#ff922b", template: "#ffa94d", billing_nonce: "#63e6be", system_hoisted: "#38d9a9",
  reply_changed: "#e599f7", prompt_changed: "#ff8787",
};
const EVICTION_LABELS = { pressure: "device, to make room", pressure_retained: "device, pinned or held (nothing else left)",
  reset: "device, prefix-cache reset", host_full: "host tier full", disk_full: "disk tier full" };
const TIER_TITLES = { device: "served from device blocks", host: "restored from the host tier",
  disk: "restored from the disk tier", computed: "computed (prefilled) for this request" };
const NOW_TITLES = { retained: "on the device, pinned or held", device: "on the device", host: "in the host tier",
  disk: "in the disk tier", null: "not cached any more" };

let apiKey = sessionStorage.getItem(KEY_STORE);
const state = { seq: -1, causes: {}, view: null };

class NeedKey extends Error {}

// ---- helpers -----------------------------------------------------------------------------------------------------
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const num = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
const pct = (x) => (x == null ? "–" : `${(100 * x).toFixed(x > 0 && x < 0.01 ? 1 : 0)}%`);
const secs = (s) => (s == null ? "–" : s < 1 ? `${(1000 * s).toFixed(0)} ms` : `${s.toFixed(2)} s`);
const clock = (t) => new Date(t * 1000).toLocaleTimeString("en-GB");
const ago = (t) => { const s = Date.now() / 1000 - t; return s < 60 ? `${s.toFixed(0)} s ago` : s < 3600 ? `${(s / 60).toFixed(0)} min ago` : `${(s / 3600).toFixed(1)} h ago`; };
const shortId = (id) => (id.length > 22 ? `${id.slice(0, 10)}…${id.slice(-8)}` : id);
const main = () => document.getElementById("main");

async function api(path) {
  const response = await fetch(`/ui/api/${path}`, { headers: apiKey ? { Authorization: `Bearer ${apiKey}` } : {} });
  if (response.status === 401) {
    askForKey();
    throw new NeedKey();
  }
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  return body;
}

function askForKey() {
  const dialog = document.getElementById("key-dialog");
  if (!dialog.open) dialog.showModal();
}

function takeKeyFromFragment() {  // "#key=KEY" or "#key=KEY&/requests/ID"
  const found = location.hash.match(/^#key=([^&]*)(?:&(.*))?$/);
  if (!found) return;
  apiKey = decodeURIComponent(found[1]);
  sessionStorage.setItem(KEY_STORE, apiKey);
  history.replaceState(null, "", `${location.pathname}#${found[2] || "/sessions"}`);  // the key leaves the address bar
}

// ---- routing -----------------------------------------------------------------------------------------------------
function route() {
  const [, kind, id] = (location.hash.replace(/^#\/?/, "") || "sessions").match(/^([^/]*)\/?(.*)$/);
  return { kind: kind || "sessions", id: decodeURIComponent(id || "") };
}

async function show(quiet = false) {
  const r = route();
  document.querySelectorAll("header nav a").forEach((a) => a.classList.toggle("on", a.dataset.tab === (r.kind === "cache" ? "cache" : "sessions")));
  try {
    if (r.kind === "cache") await showCache();
    else if (r.kind === "requests") await showRequest(r.id);
    else await showSessions(r.id);
    if (!document.documentElement.dataset.ready) {  // loaded once the first view is painted
      await new Promise((done) => requestAnimationFrame(() => setTimeout(done)));
      window.inspectorReadyMs = performance.now();
      document.documentElement.dataset.ready = "1";
    }
  } catch (error) {
    if (error instanceof NeedKey) return;
    if (!quiet) main().innerHTML = `<div class="empty">${esc(error.message)}</div>`;
  }
}

// ---- sessions ----------------------------------------------------------------------------------------------------
function describe(list) {  // the header: model, who is looking, how much is kept
  state.causes = list.causes;
  const viewer = list.viewer;
  document.getElementById("who").textContent = `${list.model} · ${viewer.operator ? "operator: every tenant" : viewer.tenant ? `tenant ${viewer.tenant}` : "no API keys: one tenant"} · ${num(list.requests_kept)} of ${num(list.max_requests)} requests kept`;
}

async function showSessions(selected) {
  const list = await api("sessions");
  describe(list);
  if (!list.sessions.length && !selected) {
    main().innerHTML = `<div class="empty" id="no-sessions">No sessions yet. Requests show up here when they finish.</div>`;
    return;
  }
  const current = selected ? { id: selected } : list.sessions[0];
  const detail = await api(`sessions/${encodeURIComponent(current.id)}`);  // a session not yours: its 404
  main().innerHTML = `<div class="layout"><aside class="side"><h3>Sessions (${list.sessions.length})</h3>${list.sessions.map((s) => sessionCard(s, s.id === current.id)).join("")}</aside>
    <section class="content">${sessionDetail(detail)}</section></div>`;
}

function sessionCard(s, on) {
  return `<a class="sess${on ? " on" : ""}" href="#/sessions/${encodeURIComponent(s.id)}" data-session-id="${esc(s.id)}">
    <div class="row"><span class="name">${esc(s.client_id || `${s.id} (by shared prefix)`)}</span>${sparkline(s.hit_rates)}</div>
    <div class="row meta"><span>${s.requests} req · ${pct(s.hit_rate)} hit${s.divergences ? ` · <b class="warn">${s.divergences} changed</b>` : ""}</span><span>${ago(s.last_time)}</span></div>
    ${s.tenant ? `<div class="meta"><span class="chip">${esc(s.tenant)}</span></div>` : ""}</a>`;
}

function sparkline(values) {
  const w = 70, h = 20, n = values.length;
  if (n < 2) return `<svg width="${w}" height="${h}"></svg>`;
  const pts = values.map((v, i) => `${((i / (n - 1)) * (w - 2) + 1).toFixed(1)},${(h - 2 - v * (h - 4)).toFixed(1)}`).join(" ");
  return `<svg width="${w}" height="${h}" aria-label="hit rate per request"><polyline points="${pts}" fill="none" stroke="#3b5bdb" stroke-width="1.5"/></svg>`;
}

function sessionDetail(d) {
  const s = d.session;
  const divergences = d.requests.filter((r) => r.divergence);
  return `<h1 id="session-title" data-session-id="${esc(s.id)}">${esc(s.client_id || s.id)}</h1>
    <div class="sub">session ${esc(s.id)}${s.tenant ? ` · tenant <span class="chip">${esc(s.tenant)}</span>` : ""} · ${esc(d.model)} · ${clock(s.first_time)} – ${clock(s.last_time)}</div>
    <div class="stats">${stat(num(s.requests), "requests")}${stat(num(s.prompt_tokens), "prompt tokens")}${stat(num(s.cached_tokens), "cached tokens")}${stat(pct(s.hit_rate), "hit rate")}${stat(num(divergences.length), "divergences")}</div>
    <h2>Cached share of each request</h2><div class="card">${hitChart(d.requests)}</div>
    <h2>Requests</h2>${requestTable(d.requests)}`;
}

function stat(value, label) { return `<div class="stat"><b>${value}</b><span>${label}</span></div>`; }

function hitChart(requests) {
  const n = requests.length, w = 900, h = 120, left = 40, bottom = 18;
  const bw = Math.min(48, (w - left) / n), gap = bw > 4 ? Math.min(6, bw / 5) : 0;
  let bars = "";
  requests.forEach((r, i) => {
    const x = left + i * bw;
    let y = h - bottom;
    for (const [tier, color] of [["device", "#2f9e44"], ["host", "#1c7ed6"], ["disk", "#9c36b5"]]) {
      const part = r.prompt_tokens ? r.cached[tier] / r.prompt_tokens : 0;
      const bh = part * (h - bottom - 6);
      if (bh > 0) { y -= bh; bars += `<rect x="${x.toFixed(1)}" y="${y.toFixed(1)}" width="${Math.max(0.5, bw - gap).toFixed(1)}" height="${bh.toFixed(1)}" fill="${color}"><title>#${i + 1}: ${pct(part)} from ${tier}</title></rect>`; }
    }
    if (r.divergence) bars += `<path d="M${(x + bw / 2).toFixed(1)},${h - bottom + 2} l-4,7 h8 z" fill="#e03131"><title>#${i + 1}: ${esc(r.divergence.cause)}</title></path>`;
  });
  const axis = [0, 0.5, 1].map((v) => { const y = h - bottom - v * (h - bottom - 6); return `<line x1="${left}" x2="${w}" y1="${y}" y2="${y}" stroke="#e9ecef"/><text x="${left - 6}" y="${y + 4}" text-anchor="end">${v * 100}%</text>`; }).join("");
  return `<svg viewBox="0 0 ${w} ${h}" width="100%" id="hit-chart">${axis}${bars}</svg>
    <div class="legend"><span style="--sw:var(--device)">device</span><span style="--sw:var(--host)">host</span><span style="--sw:var(--disk)">disk</span><span style="--sw:var(--diverge)">divergence (▲)</span></div>`;
}

function requestTable(requests) {
  const rows = requests.map((r, i) => {
    const share = r.prompt_tokens ? r.cached_tokens / r.prompt_tokens : 0;
    const bar = [["device", "d"], ["host", "h"], ["disk", "k"]].map(([t, c]) => `<i class="${c}" style="width:${r.prompt_tokens ? (100 * r.cached[t]) / r.prompt_tokens : 0}%"></i>`).join("");
    const d = r.divergence;
    const epoch = d && d.cause === "compaction" && r.epoch ? ` <span class="muted" data-epoch="${r.epoch}">epoch ${r.epoch}</span>` : "";
    const div = d ? `<span class="badge" title="${esc(d.description)}">${esc(d.cause)}</span>${epoch} <span class="muted">#${num(d.index)}</span>` : "";
    const marks = d ? ` data-divergence-cause="${esc(d.cause)}" data-divergence-index="${d.index}"` : "";
    return `<tr data-request-id="${esc(r.id)}" data-prompt-tokens="${r.prompt_tokens}" data-cached-tokens="${r.cached_tokens}"${marks}>
      <td>${i + 1}</td><td class="l">${clock(r.time)}</td><td class="l mono"><a href="#/requests/${encodeURIComponent(r.id)}">${esc(shortId(r.id))}</a></td><td class="l">${esc(r.endpoint)}</td>
      <td>${num(r.prompt_tokens)}</td><td>${num(r.cached.device)}</td><td>${num(r.cached.host)}</td><td>${num(r.cached.disk)}</td>
      <td class="l"><span class="share">${bar}</span><span class="hit">${pct(share)}</span></td><td>${secs(r.ttft_s)}</td><td>${num(r.output_tokens)}</td><td class="l">${esc(r.finish_reason)}</td><td class="l">${div}</td></tr>`;
  }).join("");
  return `<div class="scroll"><table class="reqs" id="requests"><thead><tr><th>#</th><th class="l">time</th><th class="l">request</th><th class="l">API</th><th>prompt</th><th>device</th><th>host</th><th>disk</th><th class="l">cached</th><th>TTFT</th><th>output</th><th class="l">finish</th><th class="l">first change</th></tr></thead><tbody>${rows}</tbody></table></div>`;
}

// ---- one request -------------------------------------------------------------------------------------------------
async function showRequest(id) {
  const v = await api(`requests/${encodeURIComponent(id)}`);
  if (!Object.keys(state.causes).length) describe(await api("sessions"));
  const r = v.request, bs = v.block_size, n = v.pieces.length;
  const computed = r.prompt_tokens - r.cached_tokens;
  const tierOf = (i) => (i < v.cached_ranges.device[1] ? "device" : i < v.cached_ranges.host[1] ? "host" : i < v.cached_ranges.disk[1] ? "disk" : "computed");
  const marks = { div: r.divergence ? r.divergence.index : -1, cause: r.divergence && r.divergence.cause, id: "divergence",
    bps: new Map(r.breakpoints.map((b) => [b.tokens - 1, b.ttl_s])), snaps: new Set(v.snapshot_points.map((t) => t - 1)) };
  const then = [], now = [];
  for (let b = 0; b < Math.floor(n / bs); b++) then.push(tierOf(b * bs + bs - 1));
  v.blocks_now.forEach((s) => now.push(s || "gone"));
  const title = `<div class="sub"><a href="#/sessions/${encodeURIComponent(v.session.id)}">← session ${esc(v.session.client_id || v.session.id)}</a> · ${esc(r.endpoint)} · ${clock(r.time)} · finish ${esc(r.finish_reason)}</div>`;
  main().innerHTML = `<section class="content" id="request-view" data-request-id="${esc(r.id)}">
    <h1 class="mono">${esc(r.id)}</h1>${title}
    <div class="stats">${stat(num(r.prompt_tokens), "prompt tokens")}${stat(num(r.cached.device), "from device")}${stat(num(r.cached.host), "from host")}${stat(num(r.cached.disk), "from disk")}${stat(num(computed), "computed")}${stat(secs(r.ttft_s), "time to first token")}${stat(num(r.output_tokens), "output tokens")}</div>
    ${missCauses(r)}${divergencePanel(v)}
    <h2>Blocks of ${bs} tokens</h2><div class="card">
      <div class="maplabel">at request time</div><div class="blockmap" id="blocks-then">${then.map((t) => `<i class="${t}" title="${TIER_TITLES[t]}"></i>`).join("")}</div>
      <div class="maplabel">in the cache now</div><div class="blockmap" id="blocks-now">${now.map((t) => `<i class="${t}" title="${NOW_TITLES[t === "gone" ? null : t]}"></i>`).join("")}</div>
      <div class="legend"><span style="--sw:var(--device)">device</span><span style="--sw:var(--host)">host</span><span style="--sw:var(--disk)">disk</span><span style="--sw:var(--computed)">computed</span><span style="--sw:var(--retained)">pinned or held now</span><span style="--sw:#e9ecef">not cached now</span></div></div>
    <h2>Prompt, as the model saw it</h2>
    <div class="legend"><span style="--sw:var(--device-bg);--swb:var(--device)">cached on device</span><span style="--sw:var(--host-bg);--swb:var(--host)">restored from host</span><span style="--sw:var(--disk-bg);--swb:var(--disk)">restored from disk</span><span style="--sw:var(--computed-bg);--swb:var(--computed)">computed</span><span style="--sw:#fff;--swb:#868e96">│ block boundary</span><span style="--sw:var(--bp)">breakpoint (cache_control)</span><span style="--sw:#ffe3e3;--swb:var(--diverge)">first change</span>${v.snapshot_points.length ? '<span style="--sw:var(--snap)">snapshot (can resume here)</span>' : ""}</div>
    <div class="prompt mono" id="prompt">${promptHtml(v.pieces, 0, bs, tierOf, marks)}</div></section>`;
  const marker = document.querySelector("#prompt .div");
  if (marker) marker.scrollIntoView({ block: "center" });
  window.scrollTo(0, 0);
}

function promptHtml(pieces, start, bs, tierOf, marks, replyFrom = Infinity) {
  let html = "";
  pieces.forEach((piece, k) => {
    const i = start + k;
    let cls = `t-${tierOf(i)}`;
    if (i % bs === 0) cls += " blk";
    if (/^<\|[^|]*\|>$|^<\/?think>$/.test(piece)) cls += " special";
    if (i >= replyFrom) cls += " reply";
    let attrs = ` data-i="${i}"`;
    if (marks.bps && marks.bps.has(i)) { cls += " bp"; attrs += ` title="breakpoint: ${num(i + 1)} tokens pinned for ${marks.bps.get(i)} s"`; }
    if (marks.snaps && marks.snaps.has(i)) { cls += " snap"; attrs += ` data-snapshot="${i + 1}" title="recurrent-state snapshot after ${num(i + 1)} tokens"`; }
    if (i === marks.div) { cls += " div"; attrs += ` id="${marks.id}"${marks.cause ? ` data-cause="${esc(marks.cause)}"` : ""}`; }
    html += `<span class="${cls}"${attrs}>${esc(piece)}</span>`;
  });
  return html;
}

function missCauses(r) {
  const total = Object.values(r.misses).reduce((a, b) => a + b, 0);
  if (!total) return `<h2>Missed tokens</h2><div class="card muted">None: every prompt token but the last block came from the cache.</div>`;
  const parts = Object.entries(r.misses);
  return `<h2>Why ${num(total)} prompt tokens were computed</h2><div class="card"><div class="causes" id="miss-causes">${parts.map(([c, n]) => `<i style="width:${(100 * n) / total}%;background:${CAUSE_COLORS[c] || "#868e96"}" title="${esc(c)}: ${num(n)}"></i>`).join("")}</div>
    <div class="causelist">${parts.map(([c, n]) => `<span style="--sw:${CAUSE_COLORS[c] || "#868e96"}" title="${esc(state.causes[c] || "")}" data-cause="${esc(c)}"><b>${esc(c)}</b> ${num(n)}</span>`).join("")}</div></div>`;
}

function divergencePanel(v) {
  const d = v.request.divergence;
  if (!d) {
    const why = v.request.parent ? "This prompt extends the previous request's prompt and reply token for token." : "The first request of its session.";
    return `<h2>First change from the previous request</h2><div class="card muted" id="no-divergence">${why}</div>`;
  }
  let sbs = "";
  if (v.side_by_side) {
    const p = v.side_by_side.previous, c = v.side_by_side.current;
    const side = (i) => (i < d.index ? "same" : "after");  // the shared prefix is greyed
    sbs = `<div class="sbs" id="side-by-side"><div><h4>previous request <a class="mono" href="#/requests/${encodeURIComponent(p.id)}">${esc(shortId(p.id))}</a> (dotted: its reply)</h4><div class="prompt mono">${promptHtml(p.pieces, p.start, Infinity, side, { div: d.index, id: "divergence-previous" }, p.reply_from)}</div></div>
      <div><h4>this request</h4><div class="prompt mono">${promptHtml(c.pieces, c.start, Infinity, side, { div: d.index, id: "divergence-current" })}</div></div></div>`;
  }
  return `<h2>First change from the previous request</h2><div class="card" id="divergence-summary" data-index="${d.index}" data-cause="${esc(d.cause)}">
    Token <b>#${num(d.index)}</b> differs ${d.in_reply ? "from the previous request's <b>reply</b>" : "from the previous request's prompt"}: <span class="badge">${esc(d.cause)}</span> <span class="muted">${esc(d.description)}</span></div>${sbs}`;
}

// ---- the cache ---------------------------------------------------------------------------------------------------
async function showCache() {
  const c = await api("cache");
  if (!Object.keys(state.causes).length) describe(await api("sessions"));
  const t = c.timeline, last = t.time.length - 1;
  const at = (k) => (last >= 0 && t[k] ? t[k][last] : 0);
  if (!c.cache_wide) {
    main().innerHTML = `<section class="content" id="cache-view"><h1>The cache</h1><div class="sub">what your requests hold; the cache-wide figures (use, evictions over time) depend on other tenants' requests and are shown to operators only</div>
    <div class="stats">${stat(num(c.pool.device_total || 0), "device blocks")}${stat(num(c.pool.host_total || 0), "host tier blocks")}${stat(num(c.pool.disk_total || 0), "disk tier blocks")}</div>
    <h2>Your largest cached prefixes</h2>${prefixTable(c.largest_prefixes)}
    <p class="muted">The inspector keeps ${num(c.inspector.requests)} of your requests in ${num(c.inspector.sessions)} sessions.</p></section>`;
    return;
  }
  const ev = c.evictions, evMax = Math.max(1, ...Object.values(ev));
  const inspector = c.inspector;
  main().innerHTML = `<section class="content" id="cache-view"><h1>The cache</h1><div class="sub">blocks per tier, sampled every second while they change</div>
    <div class="stats">${stat(num(at("device_total")), "device blocks")}${stat(num(at("device_used")), "held by running requests")}${stat(num(at("device_cached")), "cached")}${stat(num(at("device_pinned")), "pinned or held")}${stat(num(at("device_free")), "free (incl. cached, unheld)")}${stat(`${num(at("host_cached"))} / ${num(at("host_total"))}`, "host tier")}${stat(`${num(at("disk_cached"))} / ${num(at("disk_total"))}`, "disk tier")}</div>
    <div class="grid2"><div><h2>Device blocks over time</h2><div class="card">${lineChart(t, [["device_used", "#e8590c", "used"], ["device_cached", "#2f9e44", "cached"], ["device_pinned", "#7048e8", "pinned"], ["device_free", "#adb5bd", "free"]], at("device_total"))}</div></div>
    <div><h2>Host and disk tiers over time</h2><div class="card">${at("host_total") ? lineChart(t, [["host_cached", "#1c7ed6", "host"], ["disk_cached", "#9c36b5", "disk"]], Math.max(at("host_total"), at("disk_total"))) : '<div class="muted">No tier below the device pool: <span class="mono">--kv-offload-gb</span> adds host memory, <span class="mono">--kv-disk-dir</span> a disk tier.</div>'}</div></div></div>
    <h2>Blocks that left a tier, by cause</h2><div class="card" id="evictions">${Object.entries(ev).map(([k, n]) => `<div class="row" style="display:flex;gap:10px;align-items:center;margin:3px 0" data-cause="${esc(k)}"><span style="width:320px">${esc(EVICTION_LABELS[k] || k)}</span><span style="flex:1;background:#f1f3f5;border-radius:4px;height:10px"><i style="display:block;height:10px;border-radius:4px;background:#f59f00;width:${(100 * n) / evMax}%"></i></span><span class="mono" style="width:80px;text-align:right">${num(n)}</span></div>`).join("")}</div>
    <h2>Largest cached prefixes</h2>${prefixTable(c.largest_prefixes)}
    <p class="muted">The inspector keeps ${num(inspector.requests)} of ${num(inspector.max_requests)} requests in ${num(inspector.sessions)} sessions, ${num(inspector.trie_blocks)} distinct blocks${inspector.memory_bytes != null ? ` (${(inspector.memory_bytes / 1048576).toFixed(1)} MiB)` : ""}.</p></section>`;
}

function lineChart(t, series, top) {
  const w = 520, h = 170, left = 44, bottom = 20, n = t.time.length;
  if (n < 2) return `<div class="muted">Collecting samples…</div>`;
  const t0 = t.time[0], span = Math.max(1, t.time[n - 1] - t0), ymax = Math.max(1, top);
  const x = (tm) => left + ((tm - t0) / span) * (w - left - 8), y = (v) => h - bottom - (v / ymax) * (h - bottom - 8);
  const lines = series.map(([k, color]) => `<polyline fill="none" stroke="${color}" stroke-width="1.8" points="${t[k].map((v, i) => `${x(t.time[i]).toFixed(1)},${y(v).toFixed(1)}`).join(" ")}"/>`).join("");
  const grid = [0, 0.5, 1].map((f) => `<line x1="${left}" x2="${w - 8}" y1="${y(f * ymax)}" y2="${y(f * ymax)}" stroke="#e9ecef"/><text x="${left - 6}" y="${y(f * ymax) + 4}" text-anchor="end">${num(Math.round(f * ymax))}</text>`).join("");
  return `<svg viewBox="0 0 ${w} ${h}" width="100%">${grid}${lines}<text x="${left}" y="${h - 4}">${clock(t0)}</text><text x="${w - 8}" y="${h - 4}" text-anchor="end">${clock(t.time[n - 1])}</text></svg>
    <div class="legend">${series.map(([, color, label]) => `<span style="--sw:${color}">${label}</span>`).join("")}</div>`;
}

function prefixTable(prefixes) {
  if (!prefixes.length) return `<div class="card muted">Nothing cached that you may see.</div>`;
  const rows = prefixes.map((p) => {
    const h = p.holder;
    const who = h ? `<a href="#/sessions/${encodeURIComponent(h.session)}">${esc(h.client_id || h.session)}</a> ${h.tenant ? `<span class="chip">${esc(h.tenant)}</span>` : ""}` : '<span class="muted">older than the inspector\'s window, or a named cache</span>';
    const last = h ? `<a class="mono" href="#/requests/${encodeURIComponent(h.request)}">${esc(shortId(h.request))}</a>` : "";
    return `<tr><td>${num(p.tokens)}</td><td>${num(p.blocks)}</td><td class="l">${who}</td><td class="l">${last}</td><td>${num(p.referenced_blocks)}</td><td>${num(p.retained_blocks)}</td><td>${p.retained_for_s ? secs(p.retained_for_s) : "–"}</td></tr>`;
  }).join("");
  return `<table class="reqs" id="prefixes"><thead><tr><th>tokens</th><th>blocks</th><th class="l">session</th><th class="l">last request through it</th><th>held by running</th><th>pinned or held</th><th>for</th></tr></thead><tbody>${rows}</tbody></table>`;
}

// ---- live updates ------------------------------------------------------------------------------------------------
async function poll() {
  try {
    const u = await api(`updates?after=${Math.max(0, state.seq)}`);
    document.getElementById("live").classList.remove("off");
    const r = route();
    if (r.kind === "cache" || (u.seq !== state.seq && state.seq >= 0 && r.kind !== "requests")) await show(true);
    state.seq = u.seq;
  } catch (error) {
    document.getElementById("live").classList.toggle("off", !(error instanceof NeedKey));
  }
}

document.getElementById("key-form").addEventListener("submit", () => {
  apiKey = document.getElementById("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, apiKey);
  show();
});
window.addEventListener("hashchange", () => { takeKeyFromFragment(); show(); });
takeKeyFromFragment();
show().then(() => { poll(); setInterval(poll, POLL_MS); });

// phasewise dashboard: reads /dashboard/events (server-sent events) and draws with uPlot.
// No build step. State per source: "self" is the server this page came from (an engine, or
// a router); behind a router each worker's frames arrive as "worker" events.
"use strict";

const STEPS_SHOWN = 240;
const TIME_SHOWN = 120; // seconds of the KV and queue charts
const C = { prefill: "#f0883e", decode: "#58a6ff", roof: "#7ee787", bad: "#ff7b72",
            dim: "#8b96a5", grid: "#2b3440", alt: "#d2a8ff" };
const $ = (id) => document.getElementById(id);

function newSource(hello) {
  return { hello, steps: [], lastIndex: -1, snaps: [], lastSnap: null, ttft: hello.ttft || [],
           itl: hello.itl || [], stalls: [], lastStall: 0, transfers: [], lastTransfer: 0,
           state: "up", lastFrameAt: Date.now() };
}

const S = { sources: new Map(), current: null, edges: [], es: null, lastEventAt: 0,
            connected: false, dirty: false, workers: [] };

// ---- formatting ---------------------------------------------------------------------
function ms(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  const v = s * 1e3;
  if (v >= 1000) return (v / 1e3).toFixed(v >= 1e4 ? 0 : 1) + " s";
  return v >= 100 ? v.toFixed(0) + " ms" : v >= 10 ? v.toFixed(1) + " ms" : v.toFixed(2) + " ms";
}
// the share of a step's time spent outside its forward pass (null where unmeasured)
function hostShare(duration, forward) {
  return forward == null || !(duration > 0) ? null : Math.max(duration - forward, 0) / duration;
}
function num(x, d = 1) { return x === null || x === undefined || !isFinite(x) ? "–" : x.toFixed(d); }
function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;",
    '"': "&quot;", "'": "&#39;" }[c]));
}
function quantile(counts, edges, q) {
  const total = counts.reduce((a, b) => a + b, 0);
  if (!total) return null;
  let acc = 0;
  for (let i = 0; i < counts.length; i++) {
    acc += counts[i];
    if (acc >= q * total) return i < edges.length ? edges[i] : edges[edges.length - 1];
  }
  return edges[edges.length - 1];
}

// ---- charts -------------------------------------------------------------------------
function axes(yLabel, yFmt) {
  const a = { stroke: C.dim, grid: { stroke: C.grid, width: 1 }, ticks: { stroke: C.grid } };
  const y = Object.assign({}, a, { label: yLabel, size: 60 });
  if (yFmt) y.values = (u, vals) => vals.map(yFmt);
  return [a, y];
}
function chart(id, series, yLabel, opts = {}) {
  const el = $(id);
  const o = Object.assign({
    width: Math.max(300, el.clientWidth), height: opts.height || 180,
    scales: { x: { time: false }, y: opts.y || {} },
    series: [{ label: opts.x || "step" }].concat(series),
    axes: axes(yLabel, opts.yFmt), legend: { live: true },
    cursor: { drag: { x: false, y: false } },
  }, opts.extra || {});
  const data = [[]].concat(series.map(() => []));
  const u = new uPlot(o, data, el);
  u._el = el;
  return u;
}
const bars = () => uPlot.paths.bars({ size: [0.9, 40], align: 0 });
let charts = {};
function makeCharts() {
  // stacked by hand: the step's whole bar (decode's colour) first, its prefill part over it
  charts.mix = chart("c-mix", [
    { label: "decode tokens", stroke: C.decode, fill: C.decode, paths: bars(),
      points: { show: false },
      value: (u, v, si, i) => (i == null || v == null ? "–" : String(v - (u.data[2][i] || 0))) },
    { label: "prefill tokens", stroke: C.prefill, fill: C.prefill, paths: bars(),
      points: { show: false } },
  ], "tokens");
  // the forward pass's part of each step; the rest of the measured time is the host's
  charts.time = chart("c-time", [
    { label: "measured", stroke: C.decode, width: 1.5, value: (u, v) => ms(v) },
    { label: "roofline", stroke: C.roof, width: 1.5, dash: [4, 3], value: (u, v) => ms(v) },
    { label: "forward pass", stroke: C.alt, width: 1, value: (u, v, si, i) => {
      const total = i == null ? null : u.data[1][i];
      return v == null || total == null ? ms(v) : `${ms(v)} (host ${ms(Math.max(total - v, 0))}, ` +
        `${num(100 * hostShare(total, v), 0)} %)`;
    } },
  ], "seconds", { yFmt: (v) => ms(v) });
  charts.bw = chart("c-bw", [
    { label: "achieved GB/s", stroke: C.decode, width: 1.5 },
    { label: "peak read", stroke: C.roof, dash: [4, 3] },
  ], "GB/s", { y: { range: (u, lo, hi) => [0, Math.max(hi, 1e-3) * 1.05] } });
  charts.fl = chart("c-fl", [
    { label: "achieved GFLOP/s", stroke: C.prefill, width: 1.5 },
    { label: "peak of its arithmetic", stroke: C.roof, dash: [4, 3] },
  ], "GFLOP/s", { y: { range: (u, lo, hi) => [0, Math.max(hi, 1e-3) * 1.05] } });
  charts.kv = chart("c-kv", [
    { label: "KV used %", stroke: C.decode, width: 1.5 },
    { label: "prefix hit % (10 s)", stroke: C.alt, width: 1.5 },
  ], "%", { x: "s", y: { range: [0, 100] } });
  charts.q = chart("c-q", [
    { label: "running", stroke: C.decode, width: 1.5 },
    { label: "waiting", stroke: C.prefill, width: 1.5 },
    { label: "preempted (total)", stroke: C.bad, width: 1 },
  ], "requests", { x: "s", y: { range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.1] } });
  const binAxis = (u, vals) => vals.map((v) => (Number.isInteger(v) && S.edges[v] !== undefined
    ? ms(S.edges[v]) : ""));
  for (const [key, id, color] of [["ttft", "c-ttft", C.prefill], ["itl", "c-itl", C.decode]]) {
    charts[key] = chart(id, [{ label: "count", stroke: color, fill: color, paths: bars(),
      points: { show: false } }], "count", { x: "upper edge", y: {
        range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.1] } });
    charts[key].axes[0].values = binAxis;
  }
  charts.xfer = chart("c-xfer", [{ label: "GB/s", stroke: C.alt, width: 0,
    paths: () => null, points: { show: true, size: 6, fill: C.alt } }], "GB/s", { x: "s" });
  charts.pg = chart("c-pg", [{ label: "ms (first: TTFT, then ITL)", stroke: C.decode,
    fill: C.decode, paths: bars(), points: { show: false } }], "ms", { x: "token",
    height: 100 });
  window.addEventListener("resize", () => {
    for (const u of Object.values(charts)) u.setSize({ width: Math.max(300, u._el.clientWidth),
      height: u.height });
  });
}

// ---- the feed -----------------------------------------------------------------------
function setConn(ok, text) {
  const el = $("conn");
  el.className = "conn " + (ok ? "ok" : "bad");
  el.textContent = text;
  const b = $("banner");
  if (ok) { b.hidden = true; } else { b.hidden = false; b.textContent = text; }
}

function ingest(src, f) {
  src.lastFrameAt = Date.now();
  for (const s of f.steps || []) {
    if (s[0] <= src.lastIndex) continue; // a hello and a frame can overlap
    src.lastIndex = s[0];
    src.steps.push(s);
  }
  if (src.steps.length > 2 * STEPS_SHOWN) src.steps.splice(0, src.steps.length - STEPS_SHOWN);
  if (f.snapshot) {
    src.lastSnap = f.snapshot;
    src.snaps.push([f.t, f.snapshot]);
    while (src.snaps.length && src.snaps[0][0] < f.t - TIME_SHOWN) src.snaps.shift();
  }
  if (f.ttft) src.ttft = f.ttft;
  if (f.itl) src.itl = f.itl;
  for (const st of f.stalls || []) {
    if (st.n <= src.lastStall) continue;
    src.lastStall = st.n;
    src.stalls.push(st);
  }
  if (src.stalls.length > 50) src.stalls.splice(0, src.stalls.length - 50);
  for (const t of f.transfers || []) {
    if (t[0] <= src.lastTransfer) continue;
    src.lastTransfer = t[0];
    src.transfers.push(t);
  }
  if (src.transfers.length > 1000) src.transfers.splice(0, src.transfers.length - 1000);
  S.dirty = true;
}

function onHello(key, h) {
  const src = newSource(h);
  S.sources.set(key, src);
  if (h.edges) S.edges = h.edges;
  ingest(src, h);
  if (key === "self") {
    const info = h.info || {};
    $("model").textContent = `${h.model} · ${h.role === "both" ? "prefill+decode" : h.role}` +
      (info.description ? ` · ${info.description}` : "") +
      (info.budget ? ` · budget ${info.budget} tokens/step (${info.policy})` : "");
    S.workers = h.workers || [];
  }
  refreshSources();
}

function refreshSources() {
  const sel = $("source");
  const keys = [...S.sources.keys()];
  $("source-box").hidden = keys.length < 2;
  const want = keys.map((k) => `${k}=${S.sources.get(k).state}`).join("|");
  if (sel.dataset.keys !== want) {
    sel.innerHTML = keys.map((k) => {
      const s = S.sources.get(k);
      const label = k === "self" ? "this server" : `${s.role || "worker"} ${k}` +
        (s.state && s.state !== "up" ? ` (${s.state})` : "");
      return `<option value="${esc(k)}">${esc(label)}</option>`;
    }).join("");
    sel.dataset.keys = want;
  }
  if (!S.current || !S.sources.has(S.current)) {
    // behind a router the steps are the workers': show the first decode worker's
    S.current = keys.find((k) => k !== "self" && S.sources.get(k).role === "decode") ||
      keys.find((k) => k !== "self") || "self";
  }
  sel.value = S.current;
}

function connect() {
  if (S.es) S.es.close();
  S.connected = false;
  S.lastEventAt = Date.now(); // the watchdog gives this attempt its 3 s
  const es = new EventSource("/dashboard/events");
  S.es = es;
  es.onopen = () => { S.connected = true; S.lastEventAt = Date.now(); setConn(true, "live"); };
  es.addEventListener("hello", (ev) => {
    S.lastEventAt = Date.now();
    S.sources.clear();
    onHello("self", JSON.parse(ev.data));
  });
  es.onmessage = (ev) => {
    S.lastEventAt = Date.now();
    const src = S.sources.get("self");
    if (src) ingest(src, JSON.parse(ev.data));
  };
  es.addEventListener("worker", (ev) => {
    S.lastEventAt = Date.now();
    const w = JSON.parse(ev.data);
    if (!w.frame) {
      const s = S.sources.get(w.src);
      if (s) s.state = w.state; else S.sources.set(w.src, Object.assign(newSource({}),
        { state: w.state, role: w.role }));
      refreshSources();
      S.dirty = true;
      return;
    }
    if (w.frame.kind === "hello") {
      onHello(w.src, w.frame);
      S.sources.get(w.src).role = w.role;
      refreshSources();
    } else {
      const s = S.sources.get(w.src);
      if (s) { s.state = "up"; ingest(s, w.frame); }
    }
  });
  es.addEventListener("reset", () => { es.close(); setTimeout(connect, 500); });
  es.onerror = () => {
    S.connected = false;
    if (es.readyState === EventSource.CLOSED) {
      // refused outright (401 without a session, 503 while full or draining): ask why, retry
      fetch("/dashboard/api/status").then(async (r) => {
        if (r.status === 401) {
          setConn(false, "not logged in: this server has an API key");
          $("banner").innerHTML = 'This server runs with --api-key: <a href="/dashboard/login">' +
            "log in</a>.";
          return;
        }
        const st = r.ok ? await r.json() : null;
        if (st && st.closed) setConn(false, "the server is shutting down: retrying every 2 s…");
        else if (st && st.pages >= st.max_pages) {
          setConn(false, `${st.pages} pages already watch this server (at most ` +
            `${st.max_pages}): retrying every 2 s…`);
        } else setConn(false, `the server refused the stream (${r.status}): retrying every 2 s…`);
      }).catch(() => setConn(false, "cannot reach the server: retrying every 2 s…"));
      setTimeout(connect, 2000);
    } else {
      setConn(false, "disconnected from the server: reconnecting…");
    }
  };
}

setInterval(() => { // a connection that is open but silent is not live either
  if (S.connected && Date.now() - S.lastEventAt > 3000) {
    setConn(false, `no updates from the server for ${((Date.now() - S.lastEventAt) / 1e3)
      .toFixed(0)} s: reconnecting…`);
    connect();
  }
}, 1000);

// ---- drawing ------------------------------------------------------------------------
function drawSteps(src) {
  const steps = src.steps.slice(-STEPS_SHOWN);
  const x = steps.map((s) => s[0]);
  const peaks = src.hello.peaks;
  charts.mix.setData([x, steps.map((s) => s[3] + s[4]), steps.map((s) => s[3])]);
  charts.time.setData([x, steps.map((s) => s[2]), steps.map((s) => s[5]),
    steps.map((s) => (s[13] === undefined ? null : s[13]))]);
  charts.bw.setData([x, steps.map((s) => (s[6] != null && s[2] > 0 ? s[6] / s[2] / 1e9 : null)),
    steps.map(() => (peaks ? peaks.bandwidth / 1e9 : null))]);
  charts.fl.setData([x, steps.map((s) => (s[7] != null && s[2] > 0 ? s[7] / s[2] / 1e9 : null)),
    steps.map((s) => (peaks && peaks.flops[s[8]] ? peaks.flops[s[8]] / 1e9 : null))]);
  $("bw-peak").textContent = peaks ? `achieved per step; peak read ${num(peaks.bandwidth / 1e9)} GB/s`
    : "achieved per step; no peaks stored here: run phasewise measure";
  $("fl-peak").textContent = peaks ? `achieved per step; peaks ${Object.entries(peaks.flops)
    .map(([k, v]) => `${k} ${num(v / 1e9, 0)}`).join(", ")} GFLOP/s` : "achieved per step";
  const last = src.steps[src.steps.length - 1];
  $("k-step").textContent = last ? `${ms(last[2])} (${ms(last[5])})` : "–";
  // a mixture of experts: the experts a layer the last step's tokens read (its weight bytes)
  $("mix-experts").textContent = last && last[15] != null
    ? `; the last step read ${num(last[15], 1)} experts a layer` : "";
  // sliding windows: how much of its decodes' contexts the last step's K/V reads covered
  $("mix-window").textContent = last && last[17] != null && last[16]
    ? `; its decodes read the K/V of ${num(last[17], 0)} of their ${last[16]} positions`
      + " (sliding windows: the reads stop growing at the window)" : "";
  // rates over the last ~2 s of steps
  const recent = src.steps.filter((s) => last && s[1] >= last[1] - 2);
  const span = recent.length > 1 ? recent[recent.length - 1][1] + recent[recent.length - 1][2]
    - recent[0][1] : 0;
  const idle = !last || (Date.now() - src.lastFrameAt > 1000) || !src.lastSnap ||
    (src.lastSnap.running === 0 && src.lastSnap.waiting === 0);
  $("k-steps").textContent = span > 0 && !idle ? num(recent.length / span, 0) : "0";
  $("k-ptok").textContent = span > 0 && !idle ? num(recent.reduce((a, s) => a + s[3], 0) / span, 0) : "0";
  $("k-dtok").textContent = span > 0 && !idle ? num(recent.reduce((a, s) => a + s[4], 0) / span, 0) : "0";
}

function drawState(src) {
  const t = src.snaps.map((p) => p[0]);
  const hit = src.snaps.map((p, i) => {
    let j = i; // the hit rate over the 10 s before this frame
    while (j > 0 && src.snaps[j - 1][0] >= p[0] - 10) j--;
    const q = p[1].prefix_queries - src.snaps[j][1].prefix_queries;
    return q > 0 ? 100 * (p[1].prefix_hits - src.snaps[j][1].prefix_hits) / q : null;
  });
  charts.kv.setData([t, src.snaps.map((p) => 100 * p[1].kv_usage), hit]);
  charts.q.setData([t, src.snaps.map((p) => p[1].running), src.snaps.map((p) => p[1].waiting),
    src.snaps.map((p) => p[1].preemptions)]);
  const s = src.lastSnap;
  if (s) {
    // requests whose client stopped reading are held (parked): said beside the counts
    $("k-run").textContent = `${s.running} / ${s.waiting}` +
      (s.parked ? ` (${s.parked} parked)` : "");
    $("k-run").title = s.parked ? `${s.parked} request(s) held: their clients stopped ` +
      "reading their streams; they run again once their clients catch up" : "";
    $("k-kv").textContent = `${num(100 * s.kv_usage)} %`;
    $("k-pre").textContent = String(s.preemptions);
    const h = hit[hit.length - 1];
    $("k-hit").textContent = h == null ? "–" : `${num(h)} %`;
  }
}

const drawn = {}; // what each seldom-changing panel last drew: redraw only on a change
function changed(key, value) {
  if (drawn[key] === value) return false;
  drawn[key] = value;
  return true;
}

function drawLatency(src) {
  for (const key of ["ttft", "itl"]) {
    const counts = src[key] || [];
    if (!changed(key, counts.join(","))) continue;
    charts[key].setData([counts.map((_, i) => i), counts]);
  }
  const e = S.edges;
  $("k-ttft").textContent = `${ms(quantile(src.ttft, e, 0.5))} / ${ms(quantile(src.ttft, e, 0.9))}`;
  $("k-itl").textContent = `${ms(quantile(src.itl, e, 0.5))} / ${ms(quantile(src.itl, e, 0.99))}`;
}

function drawStalls() {
  const rows = [];
  for (const [key, src] of S.sources) {
    for (const st of src.stalls) rows.push([key, st]);
  }
  if (!changed("stalls", rows.length + ":" + rows.map((r) => r[1].n).join(","))) return;
  rows.sort((a, b) => b[1].t - a[1].t);
  const body = $("stall-rows");
  if (!rows.length) {
    body.innerHTML = '<tr class="empty"><td colspan="6">none yet</td></tr>';
    return;
  }
  body.innerHTML = rows.slice(0, 20).map(([key, st]) => {
    let who = st.intruders.map((i) => `<span class="intruder id">${esc(i.id)}</span> ` +
      `(${esc(i.tokens)}${i.prompt_tokens ? " / " + esc(i.prompt_tokens) : ""} tokens)`).join(", ");
    const excess = st.duration_s - st.baseline_s;
    if (st.explained === false) {
      // a slow step its batch does not explain: no intruder is named; where the time it
      // spent outside its forward pass makes up most of the excess, that is said
      const tokens = (st.chunks || []).reduce((a, c) => a + c.tokens, 0);
      const why = st.host_share != null && st.host_share >= 0.5
        ? `${ms(st.host_share * excess)} of it is host time outside the forward pass ` +
          "(scheduling, sampling, outputs)"
        : "not explained by this step's work";
      who = `<span class="dim unexplained">none: its chunks (${esc(tokens)} tokens) should ` +
        `add ${ms(st.expected_chunk_s)}, not ${ms(excess)}; ${why}</span>`;
    } else if (st.priced === false) {
      who += ' <span class="dim">(unpriced: no stored peaks)</span>';
    }
    return `<tr class="stall" data-intruder="${esc(st.intruders.length ? st.intruders[0].id : "")}">` +
      `<td>${num(st.t)} s${key === "self" ? "" : " · " + esc(key)}</td><td>${esc(st.step)}</td>` +
      `<td title="${esc(st.forward_s == null ? "" : `forward pass ${ms(st.forward_s)}, ` +
        `host ${ms(st.host_s)} (the decode steps' host: ${ms(st.baseline_host_s)})`)}">` +
      `${ms(st.duration_s)}</td><td>${ms(st.baseline_s)}</td><td>${who}</td>` +
      `<td title="${esc(st.victims.join(" "))}">${esc(st.num_victims)}</td></tr>`;
  }).join("");
}

function drawTransfers() {
  const per = new Map();
  const pts = [];
  for (const [key, src] of S.sources) {
    for (const t of src.transfers) {
      const k = `${t[2]}→${key === "self" ? "this worker" : key}`;
      const p = per.get(k) || { from: t[2], to: key === "self" ? "this worker" : key, n: 0,
        bytes: 0, rates: [], last: null };
      p.n++; p.bytes += t[3];
      if (t[7] != null) p.rates.push(t[7]);
      p.last = t;
      per.set(k, p);
      pts.push([t[1], t[7]]);
    }
  }
  const role = (S.sources.get("self") || { hello: {} }).hello.role;
  const newest = [...S.sources.values()].map((x) => x.lastTransfer).join(",");
  if (!changed("xfer", `${role}:${newest}`)) return; // (the kept list stops growing at 1000)
  $("pd-card").hidden = !per.size && !(role === "decode" || role === "router");
  pts.sort((a, b) => a[0] - b[0]);
  charts.xfer.setData([pts.map((p) => p[0]), pts.map((p) => p[1])]);
  $("xfer-rows").innerHTML = per.size ? [...per.values()].map((p) => `<tr><td>${esc(p.from)}</td>` +
    `<td>${esc(p.to)}</td><td>${esc(p.n)}</td><td>${num(p.bytes / 1e6)}</td>` +
    `<td>${num(p.rates.reduce((a, b) => a + b, 0) / Math.max(1, p.rates.length), 2)}</td>` +
    `<td>${num(p.last[7], 2)}</td><td>${ms(p.last[5])}</td></tr>`).join("")
    : '<tr class="empty"><td colspan="7">no transfers yet</td></tr>';
}

function draw() {
  requestAnimationFrame(draw);
  if (!S.dirty || document.hidden) return;
  S.dirty = false;
  const src = S.sources.get(S.current) || S.sources.get("self");
  if (!src || !src.hello) return;
  drawSteps(src);
  drawState(src);
  const self = S.sources.get("self");
  drawLatency(self && (self.ttft || []).some((x) => x) ? self : src);
  drawStalls();
  drawTransfers();
}

// ---- the playground -----------------------------------------------------------------
const PG = { controller: null, id: null, text: "", api: null, pieces: [], poll: null };

function renderTrace(tr) {
  const out = $("pg-out");
  const outs = tr.outputs;
  const itls = outs.slice(1).map((o, i) => o[0] - outs[i][0]);
  const sorted = itls.slice().sort((a, b) => a - b);
  const median = sorted.length ? sorted[Math.floor(sorted.length / 2)] : 0;
  let html = `<span class="prompt">${esc(PG.prompt)}</span>`;
  outs.forEach((o, i) => {
    const gap = i === 0 ? o[0] : o[0] - outs[i - 1][0];
    const cls = i === 0 ? "tok first" : gap > 3 * median && gap > 0.005 ? "tok slow" : "tok";
    const title = i === 0 ? `first token ${ms(o[0])} after arrival (queue ${ms(tr.queue_s)}, ` +
      `prefill ${ms(o[0] - (tr.queue_s || 0))})` : `ITL ${ms(gap)}`;
    html += `<span class="${cls}" data-t="${o[0]}" data-gap="${gap}" title="${esc(title)}">` +
      `${esc(o[2])}</span>`;
  });
  out.innerHTML = html;
  const ttft = outs.length ? outs[0][0] : null;
  const decode = outs.length > 1 ? outs[outs.length - 1][0] - outs[0][0] : 0;
  const sum = $("pg-summary");
  sum.dataset.ttft = ttft == null ? "" : String(ttft);
  sum.dataset.decode = String(decode);
  sum.dataset.tokens = String(tr.num_tokens);
  sum.dataset.steps = String(tr.steps.length);
  let line = `${tr.id} · ${tr.prompt_tokens} prompt tokens · TTFT ${ms(ttft)} (queue ` +
    `${ms(tr.queue_s)} + prefill ${ms(ttft == null ? null : ttft - (tr.queue_s || 0))}) · ` +
    `${itls.length} ITLs: median ${ms(median)}, max ${ms(sorted[sorted.length - 1])} · decode ` +
    `${ms(decode)} · ${tr.steps.length} steps`;
  if (PG.api) {
    const a = PG.api;
    line += ` · the API's timings: queue ${ms(a.queue_s)}, prefill ${ms(a.prefill_s)}, ` +
      `decode ${ms(a.decode_s)}`;
  }
  sum.textContent = line + (tr.finished ? ` · ${tr.finish_reason}` : " · running");
  charts.pg.setData([outs.map((_, i) => i), outs.map((o, i) =>
    1e3 * (i === 0 ? o[0] : o[0] - outs[i - 1][0]))]);
  $("pg-steps").innerHTML = (tr.step_detail || []).slice(-400).map((s) => `<tr><td>${esc(s.index)}</td>` +
    `<td>${esc(s.phase)} ${esc(s.tokens)}</td><td>${esc(s.prefill ?? "–")} / ${esc(s.decode ?? "–")}</td>` +
    `<td>${esc(s.requests ?? "–")}</td><td>${ms(s.duration_s)}</td><td>${ms(s.host_s)}</td>` +
    `<td>${ms(s.predicted_s)}</td></tr>`)
    .join("");
}

async function fetchTrace() {
  if (!PG.id || PG.fetching) return null; // one at a time: a slow server gets no pile-up
  PG.fetching = true;
  try {
    const r = await fetch(`/dashboard/api/requests/${encodeURIComponent(PG.id)}`);
    if (!r.ok) return null;
    const tr = await r.json();
    renderTrace(tr);
    return tr;
  } finally {
    PG.fetching = false;
  }
}

function showLive() { // before the trace arrives: the streamed text, marks pending
  $("pg-out").innerHTML = `<span class="prompt">${esc(PG.prompt)}</span>` +
    PG.pieces.map((p) => `<span class="tok pending">${esc(p)}</span>`).join("");
}

async function runPlayground(ev) {
  ev.preventDefault();
  if (PG.controller) return;
  PG.prompt = $("pg-prompt").value;
  PG.id = null; PG.api = null; PG.pieces = [];
  const body = { prompt: PG.prompt, max_tokens: Math.max(1, parseInt($("pg-max").value, 10) || 64),
    stream: true, stream_options: { include_usage: true } };
  const temp = $("pg-temp").value;
  if (temp !== "") body.temperature = parseFloat(temp);
  PG.controller = new AbortController();
  $("pg-run").disabled = true; $("pg-stop").disabled = false;
  $("pg-status").textContent = "waiting for the first token…";
  $("pg-summary").textContent = "";
  showLive();
  let ended = null; // what the status line says once the final trace is in
  let streamError = null; // an error event in the stream (it still ends with [DONE])
  try {
    const r = await fetch("/dashboard/api/completions", { method: "POST",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      signal: PG.controller.signal });
    if (!r.ok) {
      let msg = `${r.status}`;
      try { msg += ": " + (await r.json()).error.message; } catch (e) { /* not JSON */ }
      $("pg-status").textContent = `refused: ${msg}`;
      return;
    }
    PG.poll = setInterval(fetchTrace, 250);
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) { streamError = `error: ${chunk.error.message}`; continue; }
        PG.id = chunk.id;
        if (chunk.timings && chunk.timings.length) PG.api = chunk.timings[0];
        for (const c of chunk.choices || []) {
          if (c.text) { PG.pieces.push(c.text); }
        }
        if (chunk.choices && chunk.choices.length) {
          $("pg-status").textContent = `streaming ${PG.id}…`;
          showLive();
        }
      }
    }
    ended = streamError || "done";
  } catch (e) {
    ended = e.name === "AbortError" ? "stopped" : `failed: ${e.message}`;
  } finally {
    clearInterval(PG.poll);
    // the final trace (the engine's own times), next to the API's timings
    for (let i = 0; i < 20 && PG.id; i++) {
      if (!PG.fetching) {
        const tr = await fetchTrace().catch(() => null);
        if (tr && tr.finished) break;
      }
      await new Promise((res) => setTimeout(res, 150));
    }
    PG.controller = null;
    $("pg-run").disabled = false; $("pg-stop").disabled = true;
    if (ended !== null) $("pg-status").textContent = ended;
  }
}

// ---- start --------------------------------------------------------------------------
makeCharts();
$("source").addEventListener("change", (e) => { S.current = e.target.value; S.dirty = true; });
$("pg-form").addEventListener("submit", runPlayground);
$("pg-stop").addEventListener("click", () => PG.controller && PG.controller.abort());
// a page on a login (not a bearer key, not an open server) offers to end it
fetch("/dashboard/api/status").then((r) => (r.ok ? r.json() : null))
  .then((st) => { if (st && st.session) $("logout").hidden = false; }).catch(() => {});
connect();
requestAnimationFrame(draw);

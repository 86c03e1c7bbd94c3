"""`GET /debug/page`: one HTML page an operator reads instead of JSON. No build step, nothing fetched from
elsewhere (it works offline and on an air-gapped cluster): the CSS and the script are inline in the one
response, and the script reads the admin port's own JSON over `fetch()`:

- `GET /debug/pool` (epp_extproc/debug_pool.py): workers, roles, health, load, KV blocks per worker and tier,
  event age and lag;
- `GET /debug/decisions?since=N` (core/recent_decisions.py): the decisions committed since the last poll, with
  their candidates, credited blocks and the reason (reading it arms the ring; nobody reading, it keeps nothing);
- `POST /debug/score`: the form's question, in the body `/debug/score` takes.

It refreshes itself every `POLL_MS` (paused while the tab is hidden) and keeps only the last `KEEP_DECISIONS`
decision rows. Safe by construction, because the admin port has no authentication:

- every value the page shows is put in the DOM as text (`textContent`, `createElement`); the script never
  assigns HTML (no `innerHTML`, no `insertAdjacentHTML`), so a worker or model named `<script>` is shown;
- a strict Content-Security-Policy allows this script and this style only, by their SHA-256 (an injected
  script would not run even if markup got through), connections to this origin only, no frames, no forms
  posted anywhere, no base URL;
- the Host/Origin guard in front of every `/debug` path (epp_extproc/admin_guard.py) refuses other sites and
  DNS rebinding.
"""

from __future__ import annotations

import base64
import hashlib

POLL_MS = 1500
KEEP_DECISIONS = 50  # the ring's size (core/recent_decisions.RING_SIZE): the page never keeps more rows

CSS = """
:root { color-scheme: light dark; --fg: #1b1f24; --muted: #667; --bg: #fff; --line: #d8dce2; --ok: #137333;
  --bad: #b3261e; --warn: #9a6700; --chip: #eef1f5; --pick: #e6f4ea; }
@media (prefers-color-scheme: dark) { :root { --fg: #e6e8eb; --muted: #9aa3ad; --bg: #15181c; --line: #2d333b;
  --ok: #6ccf8e; --bad: #ff8a80; --warn: #e3b341; --chip: #22272e; --pick: #1c3326; } }
* { box-sizing: border-box; }
body { margin: 0; font: 13px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg);
  background: var(--bg); }
header { display: flex; gap: 1em; align-items: baseline; padding: .6em 1em; border-bottom: 1px solid var(--line); }
header h1 { font-size: 15px; margin: 0; }
main { padding: 0 1em 2em; }
h2 { font-size: 14px; margin: 1.2em 0 .4em; }
.muted { color: var(--muted); }
.ok { color: var(--ok); } .bad { color: var(--bad); } .warn { color: var(--warn); }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .2em .6em .2em 0; border-bottom: 1px solid var(--line); vertical-align: top; }
th { font-weight: 600; color: var(--muted); white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.chip { display: inline-block; background: var(--chip); border-radius: 3px; padding: 0 .35em; margin: 0 .25em .15em 0;
  white-space: nowrap; }
.chip.pick { background: var(--pick); font-weight: 600; }
.summary span { margin-right: 1.2em; }
form { display: grid; gap: .4em; max-width: 60em; }
textarea { width: 100%; min-height: 6em; font: 12px ui-monospace, monospace; }
input[type=text] { width: 20em; }
pre { background: var(--chip); padding: .6em; overflow: auto; max-height: 24em; font-size: 12px; }
button { font: inherit; }
"""

JS = """
'use strict';
const POLL_MS = __POLL_MS__, KEEP = __KEEP__;
const $ = (id) => document.getElementById(id);
let since = 0, paused = false, timer = null;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function td(text, cls) { return el('td', text === null || text === undefined ? '\\u2013' : text, cls); }
function num(x, digits) {
  if (x === null || x === undefined) return null;
  return typeof x === 'number' && digits !== undefined ? x.toFixed(digits) : x;
}
function tiers(byTier) {
  if (!byTier) return null;
  return Object.entries(byTier).map(([t, n]) => t + ' ' + n).join(' \\u00b7 ');
}
async function getJson(path) {
  const r = await fetch(path, {cache: 'no-store', credentials: 'same-origin'});
  if (!r.ok) throw new Error(path + ': HTTP ' + r.status);
  return r.json();
}

function renderPool(doc) {
  const s = $('pool-summary');
  s.replaceChildren();
  const add = (label, value, cls) => { const e = el('span', label + ': ' + value, cls); s.append(e); };
  add('workers', doc.workers.length);
  add('healthy', doc.healthy, doc.healthy === doc.workers.length ? 'ok' : 'bad');
  add('in flight', doc.inflight_total);
  add('discovery', doc.synced ? 'synced' : 'not synced', doc.synced ? 'ok' : 'warn');
  if (doc.kv) {
    add('unique blocks', doc.kv.unique_blocks);
    if (doc.kv.tier_unique_blocks) add('per tier', tiers(doc.kv.tier_unique_blocks));
    const lag = doc.kv.batch_lag_s;
    if (lag && lag.p50 !== undefined) add('event lag p50/p99', num(lag.p50, 3) + ' / ' + num(lag.p99, 3) + ' s');
  } else {
    add('KV index', 'off (routed by load)', 'muted');
  }
  const body = $('pool-rows');
  body.replaceChildren();
  for (const w of doc.workers) {
    const tr = el('tr');
    tr.dataset.address = w.address;
    const kv = w.kv || {};
    let events = kv.stale ? 'stale' : kv.silent ? 'silent' : (w.kv_events ? 'ok' : 'none');
    const age = kv.last_event_age_s;
    tr.append(td(w.name, 'worker-name'), td(w.address), td(w.role),
      td(w.healthy ? 'healthy' : 'unhealthy', w.healthy ? 'ok' : 'bad'),
      td(w.inflight, 'num'), td(num(w.prefill_blocks, 1), 'num'), td(num(w.decode_blocks, 1), 'num'),
      td(num(w.unbooked_blocks, 1), 'num'), td(kv.blocks_indexed, 'num'), td(kv.predicted, 'num'),
      td(tiers(kv.blocks_by_tier)),
      td(age === null || age === undefined ? null : num(age, 1) + ' s', 'num'),
      td(events, events === 'ok' ? 'ok' : events === 'none' ? 'muted' : 'bad'));
    body.append(tr);
  }
}

function candidates(d) {
  const cell = el('td');
  for (const c of d.candidates) {
    let t = (c.name || c.address) + ' ' + c.credited_blocks + '/' + c.prompt_blocks + ' cost ' + c.cost;
    if (c.blocks_by_tier) t += ' [' + tiers(c.blocks_by_tier) + ']';
    cell.append(el('span', t, c.chosen ? 'chip pick' : 'chip'));
  }
  if (d.candidates_total > d.candidates.length) {
    cell.append(el('span', '+' + (d.candidates_total - d.candidates.length) + ' more', 'muted'));
  }
  return cell;
}

function renderDecisions(doc) {
  since = Math.max(since, doc.last_seq);
  $('decisions-note').textContent = 'recording while this page is open (the picker keeps the last ' + doc.size +
    ' for ' + doc.watch_s + ' s after a read)';
  const body = $('decision-rows');
  const rows = doc.decisions.slice().reverse();  // oldest first, so each insertBefore puts the newest on top
  for (const d of rows) {
    if (body.querySelector('tr[data-seq="' + d.seq + '"]')) continue;
    const tr = el('tr');
    tr.dataset.seq = String(d.seq);
    const pick = d.pick_name ? d.pick_name + ' (' + d.pick + ')' : d.pick;
    const prefill = d.prefill ? (d.prefill_name || d.prefill) : null;
    tr.append(td(new Date(d.at * 1000).toLocaleTimeString()), td(d.model, 'model'), td(pick, 'pick'),
      td(prefill), td(d.route), td(d.prompt_tokens, 'num'), td(d.predicted_cached_tokens, 'num'),
      td(d.reason), candidates(d));
    body.insertBefore(tr, body.firstChild);
  }
  while (body.children.length > KEEP) body.lastChild.remove();
  $('decisions-empty').hidden = body.children.length > 0;
}

async function refresh() {
  timer = null;
  if (paused || document.hidden) return;
  try {
    const [pool, dec] = await Promise.all([getJson('/debug/pool'), getJson('/debug/decisions?since=' + since)]);
    renderPool(pool);
    renderDecisions(dec);
    $('status').textContent = 'updated ' + new Date().toLocaleTimeString();
    $('status').className = 'muted';
  } catch (e) {
    $('status').textContent = 'refresh failed: ' + e.message;
    $('status').className = 'bad';
  }
  schedule();
}
function schedule() { if (!timer && !paused) timer = setTimeout(refresh, POLL_MS); }

function scoreBody() {
  const text = $('score-input').value;
  if ($('score-mode').value === 'json') return JSON.parse(text);
  const body = {messages: [{role: 'user', content: text}]};
  const model = $('score-model').value.trim();
  if (model) body.model = model;
  return body;
}
function renderScore(doc) {
  const out = $('score-result');
  out.replaceChildren();
  if (doc.error) { out.append(el('p', doc.error, 'bad')); return; }
  const p = el('p');
  const picked = (doc.workers || []).find((w) => w.address === doc.pick);
  const pick = doc.pick === null ? 'none' : picked && picked.name ? picked.name + ' (' + doc.pick + ')' : doc.pick;
  p.append(el('strong', 'pick: ' + pick), el('span',
    ' \\u00b7 route ' + doc.route + ' \\u00b7 ' + doc.prompt_tokens + ' prompt tokens \\u00b7 would book ' +
    doc.would_book_blocks + ' blocks \\u00b7 predicted cached tokens ' + doc.predicted_cached_tokens));
  out.append(p);
  const table = el('table');
  const head = el('tr');
  for (const h of ['worker', 'address', 'overlap', 'confirmed', 'predicted', 'prompt blocks', 'in flight', 'cost']) {
    head.append(el('th', h, h === 'worker' || h === 'address' ? '' : 'num'));
  }
  table.append(head);
  for (const w of doc.workers || []) {
    const tr = el('tr');
    tr.append(td(w.name), td(w.address), td(w.overlap_blocks, 'num'), td(w.confirmed_blocks, 'num'),
      td(w.predicted_blocks, 'num'), td(w.prompt_blocks, 'num'), td(w.inflight, 'num'), td(w.cost, 'num'));
    if (w.address === doc.pick) tr.className = 'ok';
    table.append(tr);
  }
  out.append(table);
  const details = el('details');
  details.append(el('summary', 'the whole answer'), el('pre', JSON.stringify(doc, null, 2)));
  out.append(details);
}
async function score(ev) {
  ev.preventDefault();
  const out = $('score-result');
  let body;
  try { body = scoreBody(); } catch (e) { out.replaceChildren(el('p', 'not JSON: ' + e.message, 'bad')); return; }
  out.replaceChildren(el('p', 'asking\\u2026', 'muted'));
  try {
    const r = await fetch('/debug/score', {method: 'POST', cache: 'no-store', credentials: 'same-origin',
      headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body)});
    renderScore(await r.json());
  } catch (e) {
    out.replaceChildren(el('p', 'score failed: ' + e.message, 'bad'));
  }
}

document.addEventListener('DOMContentLoaded', () => {
  $('score-form').addEventListener('submit', score);
  $('pause').addEventListener('click', () => {
    paused = !paused;
    $('pause').textContent = paused ? 'resume' : 'pause';
    if (!paused) refresh();
  });
  document.addEventListener('visibilitychange', () => { if (!document.hidden) { if (!timer) refresh(); } });
  refresh();
});
"""

BODY = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<link rel="icon" href="data:,">
<title>epp-extproc debug</title>
<style>__CSS__</style>
</head>
<body>
<header><h1>epp-extproc</h1><span class="muted">endpoint picker debug page</span>
<span id="status" class="muted">loading&hellip;</span><button id="pause" type="button">pause</button></header>
<main>
<section>
<h2>Pool</h2>
<p id="pool-summary" class="summary"></p>
<table>
<thead><tr><th>worker</th><th>address</th><th>role</th><th>health</th><th class="num">in flight</th>
<th class="num">prefill blocks</th><th class="num">decode blocks</th><th class="num">unbooked</th>
<th class="num">KV blocks</th><th class="num">predicted</th><th>KV blocks per tier</th>
<th class="num">last event</th><th>events</th></tr></thead>
<tbody id="pool-rows"></tbody>
</table>
</section>
<section>
<h2>Last decisions</h2>
<p id="decisions-note" class="muted"></p>
<table>
<thead><tr><th>time</th><th>model</th><th>pick</th><th>prefill</th><th>route</th><th class="num">prompt tokens</th>
<th class="num">predicted cached</th><th>reason</th><th>candidates (credited/prompt blocks, cost)</th></tr></thead>
<tbody id="decision-rows"></tbody>
</table>
<p id="decisions-empty" class="muted">no decision since this page opened</p>
</section>
<section>
<h2>Ask <code>/debug/score</code></h2>
<form id="score-form">
<label>as <select id="score-mode"><option value="prompt">a user message</option>
<option value="json">a request body (JSON: chat, completion or {"token_ids": [...]})</option></select></label>
<label>model <input id="score-model" type="text" placeholder="(optional)"></label>
<textarea id="score-input" placeholder="the prompt, or the JSON body"></textarea>
<div><button type="submit">score (books nothing)</button></div>
</form>
<div id="score-result"></div>
</section>
</main>
<script>__JS__</script>
</body>
</html>
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _build() -> tuple[bytes, str]:
    js = JS.replace("__POLL_MS__", str(POLL_MS)).replace("__KEEP__", str(KEEP_DECISIONS))
    html = BODY.replace("__CSS__", CSS).replace("__JS__", js)
    csp = "; ".join([
        "default-src 'none'", f"script-src {_sha256(js)}", f"style-src {_sha256(CSS)}", "connect-src 'self'",
        "img-src data:", "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"])
    return html.encode(), csp


PAGE, CSP = _build()  # built once: the page is constant, so are its hashes
HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

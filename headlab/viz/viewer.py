"""`headlab show`'s page: one self-contained HTML file (inline CSS and JavaScript, no external resource) of the top-k
attention of every head on one text, with a layer x head picker, the text as tokens coloured by the chosen query's
attention, query pages of `chunk` rows and a matrix of the chosen head on the page's queries.

The maps are stored sparsely and compressed per (layer, head, query page), and the page decodes only the blocks it
shows (block format: `encode_block`; the browser inflates with its built-in DecompressionStream). Pure functions of
collected top-k arrays (headlab.measure.attention_view writes them); no model, no torch.
"""

from __future__ import annotations

import base64
import html
import json
import math
import zlib

import numpy as np
import pandas as pd

from headlab.core.errors import HeadlabError
from headlab.viz.choices import DEFAULT_PAGE

WEIGHT_LEVELS = 255  # a kept weight is stored as round(255 * w / row max), one byte
MASS_LEVELS = 65535  # the row maximum and the rest mass are stored as round(65535 * value), two bytes
MAX_KEYS = 65536  # key gaps are 16-bit


def encode_block(keys: np.ndarray, weights: np.ndarray, rest: np.ndarray) -> bytes:
    """One (layer, head, page) block, zlib-compressed, of rows keys/weights [c, k] (weights descending, key -1 for
    none) and rest [c]. Per row: m = round(65535 * max weight); each key with q = round(255 * w / (m / 65535)) >= 1
    is kept (weights under 1/510 of the row maximum join the rest), in key order. Layout, little-endian: max u16[c],
    rest u16[c] (round(65535 * (rest + dropped weights))), key gaps u16[N] (the first key of a row, then the
    differences), counts u8[c], q u8[N]."""
    keys, weights = np.asarray(keys), np.asarray(weights, dtype=np.float64)
    rest = np.asarray(rest, dtype=np.float64)
    if keys.size and int(keys.max()) >= MAX_KEYS:
        raise HeadlabError(f"key index {int(keys.max())} does not fit a page (at most {MAX_KEYS} tokens)")
    top = np.rint(np.clip(weights[:, 0] if weights.shape[1] else np.zeros(len(weights)), 0, 1) * MASS_LEVELS)
    scale = np.where(top > 0, top / MASS_LEVELS, 1.0)  # the row maximum as the page decodes it
    q = np.clip(np.rint(weights / scale[:, None] * WEIGHT_LEVELS), 0, WEIGHT_LEVELS)
    keep = (q >= 1) & (keys >= 0) & (top[:, None] > 0)
    order = np.argsort(np.where(keep, keys, MAX_KEYS), axis=1, kind="stable")  # kept keys first, ascending
    ordered = np.take_along_axis(np.where(keep, keys, 0), order, 1)
    kept = np.take_along_axis(keep, order, 1)
    gaps = np.diff(ordered, axis=1, prepend=0)[kept]  # row-major: rows stay in order
    dropped = np.where(keep, 0.0, np.where(keys >= 0, weights, 0.0)).sum(1)
    mass = np.rint(np.clip(rest + dropped, 0, 1) * MASS_LEVELS)
    parts = (
        top.astype("<u2").tobytes(),
        mass.astype("<u2").tobytes(),
        gaps.astype("<u2").tobytes(),
        keep.sum(1).astype(np.uint8).tobytes(),
        np.take_along_axis(q, order, 1)[kept].astype(np.uint8).tobytes(),
    )
    return zlib.compress(b"".join(parts), 9)


def decode_block(block: bytes, rows: int) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """What the page reads from a block of `rows` rows: per row (keys ascending, weights, rest mass); the inverse of
    encode_block up to its rounding (a weight within 1/510 of its row maximum, the rest within 1/131070)."""
    data = zlib.decompress(block)
    top = np.frombuffer(data, "<u2", rows, 0) / MASS_LEVELS
    mass = np.frombuffer(data, "<u2", rows, 2 * rows) / MASS_LEVELS
    total = (len(data) - 5 * rows) // 3
    gaps = np.frombuffer(data, "<u2", total, 4 * rows).astype(np.int64)
    counts = np.frombuffer(data, np.uint8, rows, 4 * rows + 2 * total)
    q = np.frombuffer(data, np.uint8, total, 5 * rows + 2 * total)
    out, first = [], 0
    for row, count in enumerate(counts):
        span = slice(first, first + int(count))
        out.append((np.cumsum(gaps[span]), q[span] / WEIGHT_LEVELS * top[row], float(mass[row])))
        first += int(count)
    return out


def dense_map(keys: np.ndarray, weights: np.ndarray, tokens: int) -> np.ndarray:
    """One head's [T, T] map (query rows, key columns) from its top-k keys [T, k] and weights [T, k]: A_ij where j is
    kept for i, else 0."""
    grid = np.zeros((len(keys), tokens), dtype=np.float32)
    rows, ranks = np.nonzero(keys >= 0)
    grid[rows, keys[rows, ranks]] = weights[rows, ranks]
    return grid


def _json_script(value) -> str:
    """JSON safe inside <script>: no '<' can close the element or open a comment."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).replace("<", "\\u003c")


def page_blocks(keys: np.ndarray, weights: np.ndarray, rest: np.ndarray, page: int) -> list[str]:
    """One layer's blocks [H x pages], head-major, base64: keys/weights [H, T, k], rest [H, T]."""
    H, T = keys.shape[0], keys.shape[1]
    blocks = []
    for head in range(H):
        for start in range(0, T, page):
            rows = slice(start, start + page)
            block = encode_block(keys[head, rows], weights[head, rows], rest[head, rows])
            blocks.append(base64.b64encode(block).decode("ascii"))
    return blocks


def view_page(view, model: str, page: int = DEFAULT_PAGE) -> str:
    """The viewer's HTML for a collected view (headlab.measure.attention_view.TopKAttention) of `model` (its name in
    the title), with the note that says how much of the text and of each row it shows."""
    meta = view.meta
    cut = f", the first {meta['tokens']:,} of {meta['text_tokens']:,}" if meta["truncated"] else ""
    notes = (
        f"{model}: {len(view.tokens):,} tokens{cut}; top {view.top_k} keys per query and head "
        f"(weights under 1/{2 * WEIGHT_LEVELS} of a row's largest join the rest)"
    )
    return attention_page(
        view.tokens, view.summary(), view.keys, view.weights, view.rest, page=page, title=f"Attention of {model}",
        notes=notes,
    )  # fmt: skip


def attention_page(
    tokens: list[str],
    heads: pd.DataFrame,
    keys: dict[int, np.ndarray],
    weights: dict[int, np.ndarray],
    rest: dict[int, np.ndarray],
    *,
    page: int = DEFAULT_PAGE,
    title: str = "",
    notes: str = "",
) -> str:
    """The viewer's HTML: `tokens` (T strings), `heads` one row per head (`layer, head, kv_head, name`, optional
    `confidence`), and per attention layer the top-k keys [H, T, k] (-1: none), weights [H, T, k] and rest mass
    [H, T] (headlab.measure.attention_view.TopKAttention). `page`: query rows per page."""
    T = len(tokens)
    if T == 0:
        raise HeadlabError("no tokens to show")
    if T > MAX_KEYS:
        raise HeadlabError(f"{T} tokens do not fit a page (at most {MAX_KEYS})")
    if isinstance(page, bool) or not isinstance(page, int) or page < 1:
        raise HeadlabError(f"page={page!r} must be a positive whole number of query rows")
    layers = []
    for index in sorted(keys):
        rows = heads[heads["layer"] == index].sort_values("head")
        if keys[index].shape[:2] != (len(rows), T) or weights[index].shape != keys[index].shape:
            raise HeadlabError(f"layer {index}: the arrays do not match its {len(rows)} heads and {T} tokens")
        confidence = rows["confidence"] if "confidence" in rows else weights[index][:, :, 0].mean(1)
        layers.append(
            {
                "layer": int(index),
                "names": rows["name"].astype(str).tolist(),
                "kv": [int(v) for v in rows["kv_head"]],
                "confidence": [round(float(v), 4) for v in confidence],
            }
        )
    info = {
        "title": title or "Attention",
        "notes": notes,
        "tokens": [str(t) for t in tokens],
        "page": page,
        "pages": math.ceil(T / page),
        "topK": int(next(iter(keys.values())).shape[2]) if keys else 0,
        "layers": layers,
    }
    payloads = "\n".join(
        f'<script type="application/json" id="layer-{index}">'
        f"{_json_script(page_blocks(keys[index], weights[index], rest[index], page))}</script>"
        for index in sorted(keys)
    )
    return (
        _TEMPLATE.replace("__TITLE__", html.escape(info["title"]))
        .replace("__STYLE__", _STYLE)
        .replace("__INFO__", _json_script(info))
        .replace("__PAYLOADS__", payloads)
        .replace("__SCRIPT__", _SCRIPT)
    )


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>__STYLE__</style>
</head>
<body>
<header><h1 id="title"></h1><p id="notes"></p></header>
<main>
<section id="left">
<h2>Heads <small>(colour: confidence, the mean largest weight)</small></h2>
<div id="picker" role="grid"></div>
</section>
<section id="right">
<div id="bar">
<strong id="head-name"></strong> <span id="head-info"></span>
<span class="pager"><button id="prev" type="button" title="previous query page">&#9664;</button>
<select id="page-select" title="query page"></select>
<button id="next" type="button" title="next query page">&#9654;</button></span>
</div>
<p id="query-info" class="readout"></p>
<h2>Text <small>(underlined: this page's queries; hover or click one; colour: weight / the row's largest)</small></h2>
<div id="tokens"></div>
<h2>Matrix <small>(this page's queries x keys; hover for the weight, click to choose the query)</small></h2>
<div id="matrix-wrap"><canvas id="matrix" width="1" height="1"></canvas></div>
<p id="matrix-info" class="readout">&nbsp;</p>
</section>
</main>
<script type="application/json" id="info">__INFO__</script>
__PAYLOADS__
<script>__SCRIPT__</script>
</body>
</html>
"""

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fff}
header{padding:8px 16px;border-bottom:1px solid #ddd}h1{font-size:18px;margin:0}#notes{margin:2px 0;color:#555}
h2{font-size:14px;margin:10px 0 4px}h2 small{font-weight:normal;color:#666}
main{display:flex;gap:16px;padding:0 16px 16px;align-items:flex-start}
#left{flex:0 0 auto;max-height:calc(100vh - 70px);overflow:auto}#right{flex:1 1 auto;min-width:0}
#picker{display:grid;gap:1px;font-size:11px}
#picker .lab{padding:0 4px;text-align:right;color:#555;align-self:center}
#picker .colh{text-align:center;color:#555}
#picker button{width:24px;height:18px;padding:0;border:1px solid transparent;font-size:10px;cursor:pointer}
#picker button.sel{outline:2px solid #d62728;outline-offset:-1px;font-weight:bold}
#picker .none{width:24px;height:18px;background:#f3f3f3}
#bar{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #eee;z-index:2}
.pager{margin-left:16px}.readout{font-family:ui-monospace,monospace;font-size:12px;margin:4px 0;min-height:1.4em}
#tokens{font-family:ui-monospace,monospace;font-size:13px;white-space:pre-wrap;word-break:break-all;
max-height:45vh;overflow:auto;border:1px solid #ddd;padding:6px;line-height:1.7}
#tokens span{border-radius:2px}#tokens span.q{border-bottom:2px solid #1f77b4;cursor:pointer}
#tokens span.cur{outline:2px solid #d62728}#tokens span.pin{outline:2px solid #000}
#matrix-wrap{border:1px solid #ddd;overflow:auto;max-height:60vh}
#matrix{display:block;image-rendering:pixelated;cursor:crosshair}
"""

_SCRIPT = r"""
"use strict";
(function () {
  const info = JSON.parse(document.getElementById("info").textContent);
  const T = info.tokens.length, PAGE = info.page;
  const layerOf = new Map(info.layers.map((l) => [l.layer, l]));
  const payloads = new Map();  // layer -> its blocks, parsed on first use
  const blocks = new Map();  // "layer,head,page" -> decoded block (a Promise)
  const state = {layer: null, head: null, page: 0, query: null, pinned: false, block: null};
  let pending = Promise.resolve();
  const $ = (id) => document.getElementById(id);

  function layerBlocks(layer) {
    if (!payloads.has(layer)) payloads.set(layer, JSON.parse($("layer-" + layer).textContent));
    return payloads.get(layer);
  }
  async function inflate(b64) {
    const raw = atob(b64), bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }
  // The block layout of headlab.viz.viewer.encode_block: max u16[c], rest u16[c], gaps u16[N], counts u8[c], q u8[N].
  function parse(data, start) {
    const c = Math.min(PAGE, T - start), N = (data.length - 5 * c) / 3;
    const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
    const u16 = (i) => view.getUint16(2 * i, true);
    const rows = [];
    let entry = 0;
    for (let r = 0; r < c; r++) {
      const top = u16(r) / 65535, rest = u16(c + r) / 65535, n = data[4 * c + 2 * N + r];
      const keys = new Int32Array(n), weights = new Float32Array(n);
      let key = 0;
      for (let e = 0; e < n; e++, entry++) {
        key += u16(2 * c + entry);
        keys[e] = key;
        weights[e] = data[5 * c + 2 * N + entry] / 255 * top;
      }
      rows.push({query: start + r, keys, weights, top, rest});
    }
    return rows;
  }
  function block(layer, head, page) {
    const id = layer + "," + head + "," + page;
    if (!blocks.has(id)) {
      const b64 = layerBlocks(layer)[head * info.pages + page];
      blocks.set(id, inflate(b64).then((data) => parse(data, page * PAGE)));
    }
    return blocks.get(id);
  }

  function fmt(w) { return w >= 0.01 ? w.toFixed(3) : w.toPrecision(2); }
  function shown(t) { return t === "" ? "\u2205" : t.replace(/\n/g, "\u21b5\n").replace(/\t/g, "\u2192"); }
  function quoted(t) { return JSON.stringify(t); }

  // ---- picker ------------------------------------------------------------------------------------------------
  function colour(v) {
    const x = Math.max(0, Math.min(1, v)), l = 96 - 60 * x;
    return "hsl(212,70%," + l + "%)";
  }
  function buildPicker() {
    const picker = $("picker");
    const width = Math.max(1, ...info.layers.map((l) => l.names.length));
    picker.style.gridTemplateColumns = "auto repeat(" + width + ", 24px)";
    picker.appendChild(document.createElement("span"));
    for (let h = 0; h < width; h++) {
      const c = document.createElement("span"); c.className = "colh"; c.textContent = "H" + h; picker.appendChild(c);
    }
    for (const l of info.layers) {
      const lab = document.createElement("span"); lab.className = "lab"; lab.textContent = "L" + l.layer;
      picker.appendChild(lab);
      for (let h = 0; h < width; h++) {
        if (h >= l.names.length) {
          const none = document.createElement("span"); none.className = "none";
          none.title = "L" + l.layer + ": " + l.names.length + " heads"; picker.appendChild(none); continue;
        }
        const b = document.createElement("button");
        b.type = "button"; b.dataset.head = l.names[h]; b.dataset.layer = l.layer; b.dataset.index = h;
        b.style.background = colour(l.confidence[h]);
        b.style.color = l.confidence[h] > 0.6 ? "#fff" : "#222";
        b.textContent = h;
        b.title = l.names[h] + " (KV head " + l.kv[h] + "), confidence " + l.confidence[h].toFixed(3);
        b.addEventListener("click", () => api.select(l.layer, h));
        picker.appendChild(b);
      }
    }
    if (!info.layers.some((l) => l.names.length)) picker.textContent = "this model has no attention heads";
  }

  // ---- tokens ------------------------------------------------------------------------------------------------
  const spans = [];
  let coloured = [];
  function buildTokens() {
    const box = $("tokens"), frag = document.createDocumentFragment();
    info.tokens.forEach((t, i) => {
      const s = document.createElement("span");
      s.textContent = shown(t); s.dataset.i = i; s.title = "#" + i + " " + quoted(t);
      frag.appendChild(s); spans.push(s);
    });
    box.appendChild(frag);
    box.addEventListener("mouseover", (e) => {
      const i = Number(e.target.dataset && e.target.dataset.i);
      if (e.target.classList.contains("q") && !state.pinned) showQuery(i);
    });
    box.addEventListener("click", (e) => {
      if (!e.target.classList.contains("q")) return;
      const i = Number(e.target.dataset.i);
      state.pinned = !(state.pinned && state.query === i);
      showQuery(i);
    });
  }
  function markPage() {
    for (const s of box().querySelectorAll("span.q")) s.classList.remove("q");
    for (let i = state.page * PAGE; i < Math.min(T, (state.page + 1) * PAGE); i++) spans[i].classList.add("q");
  }
  function box() { return $("tokens"); }

  function showQuery(i) {
    if (!state.block || i < state.page * PAGE || i >= state.page * PAGE + state.block.length) return;
    for (const s of coloured) { s.style.background = ""; s.title = "#" + s.dataset.i + " " + quoted(info.tokens[s.dataset.i]); s.removeAttribute("data-w"); }
    coloured = [];
    if (state.query !== null) spans[state.query].classList.remove("cur", "pin");
    state.query = i;
    const row = state.block[i - state.page * PAGE];
    spans[i].classList.add(state.pinned ? "pin" : "cur");
    const top = row.top || 1, parts = [];
    const order = Array.from(row.keys.keys()).sort((a, b) => row.weights[b] - row.weights[a]);
    for (let e = 0; e < row.keys.length; e++) {
      const s = spans[row.keys[e]], w = row.weights[e];
      s.style.background = "rgba(214,39,40," + (0.08 + 0.92 * w / top).toFixed(3) + ")";
      s.title = "#" + row.keys[e] + " " + quoted(info.tokens[row.keys[e]]) + " \u2190 " + fmt(w);
      s.dataset.w = fmt(w);
      coloured.push(s);
    }
    for (const e of order.slice(0, 5)) parts.push("#" + row.keys[e] + " " + quoted(info.tokens[row.keys[e]]) + " " + fmt(row.weights[e]));
    $("query-info").textContent = "query #" + i + " " + quoted(info.tokens[i]) + (state.pinned ? " (pinned)" : "") +
      ": " + parts.join(", ") + (parts.length ? "; " : "") + "other keys " + fmt(row.rest);
    drawMatrix();
  }

  // ---- matrix ------------------------------------------------------------------------------------------------
  let matrix = null;  // {cols, bin, rows}
  function drawMatrix() {
    const rows = state.block, canvas = $("matrix");
    if (!rows) return;
    const keys = state.page * PAGE + rows.length, cols = Math.min(keys, 1024), bin = Math.ceil(keys / cols);
    const width = Math.ceil(keys / bin);
    canvas.width = width; canvas.height = rows.length;
    // Square cells up to 12 px while the page's keys fit the frame; narrower (and rows 3 px high) beyond.
    const cell = Math.max(0.25, Math.min(12, ($("matrix-wrap").clientWidth - 2) / width));
    canvas.style.width = Math.floor(cell * width) + "px";
    canvas.style.height = Math.round(rows.length * Math.max(3, Math.min(12, cell))) + "px";
    const ctx = canvas.getContext("2d"), image = ctx.createImageData(width, rows.length), px = image.data;
    for (let r = 0; r < rows.length; r++) {
      const row = rows[r], top = row.top || 1;
      for (let x = 0; x < width; x++) { const o = 4 * (r * width + x); px[o] = px[o + 1] = px[o + 2] = 255; px[o + 3] = 255; }
      for (let e = 0; e < row.keys.length; e++) {
        const x = Math.floor(row.keys[e] / bin), o = 4 * (r * width + x), v = row.weights[e] / top;
        const g = Math.round(255 * (1 - v));
        if (g < px[o + 1]) { px[o] = 255 - Math.round(41 * v); px[o + 1] = g; px[o + 2] = g; }
      }
    }
    ctx.putImageData(image, 0, 0);
    if (state.query !== null) {
      ctx.fillStyle = "rgba(31,119,180,0.9)";
      ctx.fillRect(0, state.query - state.page * PAGE, Math.max(1, Math.ceil(width / 200)), 1);
    }
    matrix = {width, bin, rows};
  }
  function matrixCell(e) {
    const canvas = $("matrix"), rect = canvas.getBoundingClientRect();
    if (!matrix) return null;
    const x = Math.floor((e.clientX - rect.left) / rect.width * matrix.width);
    const r = Math.floor((e.clientY - rect.top) / rect.height * matrix.rows.length);
    if (r < 0 || r >= matrix.rows.length || x < 0 || x >= matrix.width) return null;
    return {r, x};
  }
  function hoverMatrix(e) {
    const cell = matrixCell(e);
    if (!cell) return;
    const row = matrix.rows[cell.r], low = cell.x * matrix.bin, high = low + matrix.bin - 1;
    let w = 0, at = low;
    for (let k = 0; k < row.keys.length; k++) {
      if (row.keys[k] >= low && row.keys[k] <= high && row.weights[k] > w) { w = row.weights[k]; at = row.keys[k]; }
    }
    const what = matrix.bin > 1 ? "keys #" + low + "-" + high + " (largest #" + at + ")" : "key #" + low + " " + quoted(info.tokens[low]);
    $("matrix-info").textContent = "query #" + row.query + " " + quoted(info.tokens[row.query]) + " \u2192 " + what + ": " + fmt(w);
  }

  // ---- selection ---------------------------------------------------------------------------------------------
  function setHash() {
    const l = layerOf.get(state.layer);
    if (!l) return;
    history.replaceState(null, "", "#" + l.names[state.head] + (state.query !== null ? ":q=" + state.query : ""));
  }
  async function render(query) {
    const l = layerOf.get(state.layer);
    $("head-name").textContent = l.names[state.head];
    $("head-info").textContent = "layer " + l.layer + ", head " + state.head + ", KV head " + l.kv[state.head] +
      " \u00b7 " + T + " tokens, top " + info.topK + " keys per query";
    for (const b of document.querySelectorAll("#picker button.sel")) b.classList.remove("sel");
    const b = document.querySelector('#picker button[data-head="' + l.names[state.head] + '"]');
    if (b) b.classList.add("sel");
    $("page-select").value = String(state.page);
    $("prev").disabled = state.page === 0; $("next").disabled = state.page >= info.pages - 1;
    markPage();
    state.block = await block(state.layer, state.head, state.page);
    const first = state.page * PAGE, last = first + state.block.length - 1;
    const q = query !== undefined && query !== null ? query : (state.query !== null && state.query >= first && state.query <= last ? state.query : last);
    showQuery(q);
    setHash();
  }
  function queue(task) {
    pending = pending.then(task).catch((error) => { $("query-info").textContent = "cannot show this head: " + error; });
    return pending;
  }
  const api = {
    select(layer, head, query) {
      return queue(() => { state.layer = layer; state.head = head; return render(query); });
    },
    page(p, query) {
      const page = Math.max(0, Math.min(info.pages - 1, p));
      return queue(() => { state.page = page; if (query === undefined) state.pinned = false; return render(query); });
    },
    query(i) {
      return api.page(Math.floor(i / PAGE), i).then(() => { state.pinned = true; showQuery(i); setHash(); });
    },
    idle() { return pending; },
    state,
  };
  window.headlab = api;

  function start() {
    $("title").textContent = info.title;
    $("notes").textContent = info.notes;
    buildPicker();
    buildTokens();
    const select = $("page-select");
    for (let p = 0; p < info.pages; p++) {
      const o = document.createElement("option");
      o.value = String(p); o.textContent = "queries " + p * PAGE + "\u2013" + (Math.min(T, (p + 1) * PAGE) - 1) + " of " + T;
      select.appendChild(o);
    }
    select.addEventListener("change", () => api.page(Number(select.value)));
    $("prev").addEventListener("click", () => api.page(state.page - 1));
    $("next").addEventListener("click", () => api.page(state.page + 1));
    const canvas = $("matrix");
    canvas.addEventListener("mousemove", hoverMatrix);
    canvas.addEventListener("click", (e) => {
      const cell = matrixCell(e);
      if (cell) { state.pinned = true; showQuery(matrix.rows[cell.r].query); setHash(); }
    });
    if (typeof DecompressionStream === "undefined") {
      $("query-info").textContent = "this browser cannot decompress the maps (no DecompressionStream)"; return;
    }
    const first = info.layers.find((l) => l.names.length);
    if (!first) return;
    // A link such as #L3H2:q=130 opens that head (and query).
    const m = /^#L(\d+)H(\d+)(?::q=(\d+))?$/.exec(decodeURIComponent(location.hash));
    let layer = first.layer, head = 0, query;
    if (m && layerOf.has(Number(m[1])) && Number(m[2]) < layerOf.get(Number(m[1])).names.length) {
      layer = Number(m[1]); head = Number(m[2]);
      if (m[3] !== undefined && Number(m[3]) < T) query = Number(m[3]);
    }
    state.layer = layer; state.head = head;
    if (query !== undefined) { state.page = Math.floor(query / PAGE); state.pinned = true; }
    queue(() => render(query)).then(() => {
      if (state.query !== null) spans[state.query].scrollIntoView({block: "nearest"});
    });
  }
  start();
})();
"""


__all__ = ["attention_page", "decode_block", "dense_map", "encode_block", "page_blocks"]

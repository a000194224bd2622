// qkv attention explorer: the whole script, no framework, no network.
//
// The page's data (the <script id="qkv-data"> element) holds the shape [N, H, L, S] (layers, heads,
// queries, keys), the layer and head names, the tokens, and the weights as 16-bit codes: weight =
// code / scaleCode, and code = maskedCode marks a pair the mask hides. The codes are deflated and
// base64-encoded by qkv.explorer; the browser's DecompressionStream inflates them.
"use strict";

const meta = JSON.parse(document.getElementById("qkv-data").textContent);
const [N, H, L, S] = meta.shape;
let codes = null; // Uint16Array of N * H * L * S codes, once inflated

const state = {
  view: "head",
  layer: meta.initial.layer,
  heads: new Set(meta.initial.head === null ? [...Array(H).keys()] : [meta.initial.head]), // drawn in the head view
  matrixHead: meta.initial.head === null ? 0 : meta.initial.head,
  threshold: meta.initial.threshold,
  scale: meta.initial.scale,
  cell: 0, // matrix view: CSS pixels per cell (0 = pick one that fits)
  modelDrawn: false, // the model view is drawn when first shown, and again after a colour change
};

const MAX_LINES = 100000; // more lines than this are a tangle, and slow to draw

async function inflate(base64) {
  const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint16Array(await new Response(stream).arrayBuffer());
}

// The weight query i gives key j in layer l, head h; null where the pair is masked.
function weight(l, h, i, j) {
  const c = codes[((l * H + h) * L + i) * S + j];
  return c === meta.maskedCode ? null : c / meta.scaleCode;
}

// A token as a label: whitespace made visible, long tokens cut.
function show(token) {
  const t = token.replace(/\n/g, "\\n").replace(/\t/g, "\\t").replace(/\r/g, "\\r");
  return t.length > 24 ? t.slice(0, 23) + "\u2026" : t;
}
const longest = Math.max(1, ...meta.queryTokens.map((t) => show(t).length), ...meta.keyTokens.map((t) => show(t).length));

// One colour per head: ten distinct ones, or evenly spaced hues for more heads.
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const headColour = (h) => (H <= PALETTE.length ? PALETTE[h] : `hsl(${Math.round((h * 360) / H)}, 65%, 42%)`);

// Heatmap colour of a weight: white to dark blue, linear on [0, 1] or logarithmic on [1e-4, 1].
const MASKED_RGB = [214, 214, 214];
function shade(w) {
  let t = state.scale === "log" ? (w <= 1e-4 ? 0 : (Math.log10(w) + 4) / 4) : w;
  t = Math.min(1, Math.max(0, t));
  return [255 - t * (255 - 8), 255 - t * (255 - 48), 255 - t * (255 - 107)];
}

// One head as an S x L image, one pixel per pair; callers scale it up or down.
function headImage(l, h) {
  const canvas = document.createElement("canvas");
  canvas.width = S;
  canvas.height = L;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(S, L);
  for (let i = 0; i < L; i++) {
    for (let j = 0; j < S; j++) {
      const w = weight(l, h, i, j);
      const rgb = w === null ? MASKED_RGB : shade(w);
      const p = 4 * (i * S + j);
      img.data.set([rgb[0], rgb[1], rgb[2], 255], p);
    }
  }
  ctx.putImageData(img, 0, 0);
  return canvas;
}

const $ = (id) => document.getElementById(id);

// A canvas of width x height CSS pixels, sharp on high-density screens; its context draws in CSS pixels.
function sizedContext(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return ctx;
}

// ------------------------------------------------------------------ head view
// Tokens are elements (to hover); the lines are drawn on a canvas between the two columns, which
// stays fast with tens of thousands of lines. `drawn` lists the (head, query, key) of every line on it.
let drawn = [];
let focus = null; // {side: "query" | "key", index} while a token is hovered
const ROW = Math.max(8, Math.min(20, Math.floor(30000 / Math.max(L, S)))); // pixels per token (canvases stop at ~32k)
const SPAN = 300; // pixels between the two columns

function tokenColumn(id, side, tokens) {
  const col = $(id);
  col.replaceChildren();
  tokens.forEach((t, index) => {
    const el = document.createElement("div");
    el.className = "tok";
    el.dataset.side = side;
    el.dataset.index = index;
    el.style.height = el.style.lineHeight = `${ROW}px`;
    el.style.fontSize = `${Math.min(13, ROW - 2)}px`;
    el.textContent = show(t);
    col.appendChild(el);
  });
}

function drawHeadView() {
  if ($("query-col").childElementCount === 0) {
    tokenColumn("query-col", "query", meta.queryTokens);
    tokenColumn("key-col", "key", meta.keyTokens);
  }
  const heads = [...state.heads].sort((a, b) => a - b);
  let count = 0;
  for (const h of heads) {
    for (let i = 0; i < L; i++) {
      for (let j = 0; j < S; j++) {
        const w = weight(state.layer, h, i, j);
        if (w !== null && w > 0 && w >= state.threshold) count++;
      }
    }
  }
  const tooMany = count > MAX_LINES;
  $("head-message").textContent = tooMany
    ? `${count} lines to draw, more than ${MAX_LINES}: raise "lines from weight", pick fewer heads, or use the matrix view.`
    : `${count} lines (weights >= ${state.threshold}) in ${meta.layers[state.layer]}.`;
  const ctx = sizedContext($("head-canvas"), SPAN, ROW * Math.max(L, S));
  ctx.lineWidth = 2;
  drawn = [];
  if (!tooMany) {
    for (const h of heads) {
      ctx.strokeStyle = headColour(h);
      for (let i = 0; i < L; i++) {
        if (focus !== null && focus.side === "query" && focus.index !== i) continue;
        for (let j = 0; j < S; j++) {
          if (focus !== null && focus.side === "key" && focus.index !== j) continue;
          const w = weight(state.layer, h, i, j);
          if (w === null || w === 0 || w < state.threshold) continue;
          ctx.globalAlpha = w; // the line's opacity is the weight
          ctx.beginPath();
          ctx.moveTo(4, ROW * (i + 0.5));
          ctx.lineTo(SPAN - 4, ROW * (j + 0.5));
          ctx.stroke();
          drawn.push([h, i, j]);
        }
      }
    }
  }
  markTokens();
}

// Hovered token bold, the others on its side dimmed, and the other side's tokens it may not pair
// with in any shown head struck through (masked pairs have no line).
function markTokens() {
  const heads = [...state.heads];
  for (const el of document.querySelectorAll(".col .tok")) {
    const k = Number(el.dataset.index), same = focus !== null && el.dataset.side === focus.side;
    el.classList.toggle("hot", same && k === focus.index);
    el.classList.toggle("dim", same && k !== focus.index);
    let hidden = false;
    if (focus !== null && !same && heads.length > 0) {
      const [i, j] = focus.side === "query" ? [focus.index, k] : [k, focus.index];
      hidden = heads.every((h) => weight(state.layer, h, i, j) === null);
    }
    el.classList.toggle("masked", hidden);
  }
}

function focusToken(side, index) {
  focus = side === null ? null : { side, index };
  drawHeadView();
}

// ----------------------------------------------------------------- model view
function drawModelView() {
  const grid = $("model-grid");
  grid.replaceChildren();
  const width = Math.max(40, Math.min(120, Math.floor(1000 / H)));
  grid.style.gridTemplateColumns = `auto repeat(${H}, ${width + 2}px)`;
  const height = Math.max(12, Math.round((width * L) / S));
  grid.appendChild(document.createElement("span"));
  for (let h = 0; h < H; h++) {
    const name = document.createElement("figure");
    name.textContent = meta.heads[h];
    grid.appendChild(name);
  }
  for (let l = 0; l < N; l++) {
    const name = document.createElement("figure");
    name.textContent = meta.layers[l];
    name.style.alignSelf = "center";
    grid.appendChild(name);
    for (let h = 0; h < H; h++) {
      const canvas = document.createElement("canvas");
      canvas.width = width;
      canvas.height = height;
      canvas.className = "thumb";
      canvas.dataset.layer = l;
      canvas.dataset.head = h;
      canvas.title = `${meta.layers[l]}, ${meta.heads[h]}: click to open`;
      const ctx = canvas.getContext("2d");
      ctx.imageSmoothingEnabled = width < S; // blend when shrinking, sharp cells when enlarging
      ctx.drawImage(headImage(l, h), 0, 0, width, height);
      canvas.addEventListener("click", () => {
        state.layer = l;
        state.matrixHead = h;
        $("layer").value = l;
        $("matrix-head").value = h;
        showView("matrix");
      });
      grid.appendChild(canvas);
    }
  }
  state.modelDrawn = true;
}

// ---------------------------------------------------------------- matrix view
const matrix = { left: 0, top: 0 }; // the label margins of the drawn matrix, CSS pixels

function drawMatrix() {
  if (state.cell === 0) state.cell = Math.min(28, Math.max(2, Math.floor(900 / Math.max(L, S))));
  const cell = state.cell, labels = cell >= 9;
  matrix.left = matrix.top = labels ? 14 + 7 * longest : 30;
  const width = matrix.left + S * cell + 4, height = matrix.top + L * cell + 4;
  const ctx = sizedContext($("matrix-canvas"), width, height);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, width, height);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(headImage(state.layer, state.matrixHead), matrix.left, matrix.top, S * cell, L * cell);
  if (cell >= 6) { // hatch the masked cells, as the PNG heatmaps do
    ctx.strokeStyle = "#aaa";
    ctx.beginPath();
    for (let i = 0; i < L; i++) {
      for (let j = 0; j < S; j++) {
        if (weight(state.layer, state.matrixHead, i, j) !== null) continue;
        const x = matrix.left + j * cell, y = matrix.top + i * cell;
        ctx.moveTo(x, y + cell);
        ctx.lineTo(x + cell, y);
      }
    }
    ctx.stroke();
  }
  ctx.fillStyle = "#333";
  if (labels) { // every token, queries down the left, keys along the top
    ctx.font = `${Math.min(13, cell - 1)}px sans-serif`;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    meta.queryTokens.forEach((t, i) => ctx.fillText(show(t), matrix.left - 4, matrix.top + (i + 0.5) * cell));
    ctx.save();
    ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "left";
    meta.keyTokens.forEach((t, j) => ctx.fillText(show(t), -(matrix.top - 4), matrix.left + (j + 0.5) * cell));
    ctx.restore();
  } else { // too small for words: an index every few cells
    const every = Math.ceil(40 / cell / 5) * 5;
    ctx.font = "10px sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i < L; i += every) ctx.fillText(i, matrix.left - 3, matrix.top + (i + 0.5) * cell);
    ctx.textAlign = "center";
    ctx.textBaseline = "bottom";
    for (let j = 0; j < S; j += every) ctx.fillText(j, matrix.left + (j + 0.5) * cell, matrix.top - 3);
  }
  $("zoom-label").textContent = `${cell} px per cell`;
}

// The (query, key) cell under a mouse event, or null outside the matrix.
function cellAt(event) {
  const rect = $("matrix-canvas").getBoundingClientRect();
  const j = Math.floor((event.clientX - rect.left - matrix.left) / state.cell);
  const i = Math.floor((event.clientY - rect.top - matrix.top) / state.cell);
  return i >= 0 && i < L && j >= 0 && j < S ? [i, j] : null;
}

function showTooltip(event) {
  const tip = $("tooltip"), at = cellAt(event);
  if (at === null) {
    tip.style.display = "none";
    return;
  }
  const [i, j] = at, w = weight(state.layer, state.matrixHead, i, j);
  tip.dataset.query = i;
  tip.dataset.key = j;
  tip.textContent = `query ${i} ${JSON.stringify(meta.queryTokens[i])} -> key ${j} ${JSON.stringify(meta.keyTokens[j])}\n` +
    `${meta.layers[state.layer]}, ${meta.heads[state.matrixHead]}: ` + (w === null ? "masked" : `weight ${w.toFixed(4)}`);
  tip.style.left = `${event.clientX + 14}px`;
  tip.style.top = `${event.clientY + 14}px`;
  tip.style.display = "block";
}

function zoom(factor) {
  const most = Math.max(1, Math.floor(12000 / Math.max(L, S))); // canvases stop drawing past ~16k pixels
  state.cell = Math.min(most, 64, Math.max(1, Math.round(state.cell * factor)));
  drawMatrix();
}

// ------------------------------------------------------------------- controls
function redraw() {
  if (state.view === "head") drawHeadView();
  else if (state.view === "model") drawModelView();
  else drawMatrix();
}

function showView(view) {
  state.view = view;
  for (const b of document.querySelectorAll(".tabs button")) b.classList.toggle("active", b.dataset.view === view);
  for (const v of ["head", "model", "matrix"]) $(`view-${v}`).classList.toggle("active", v === view);
  if (view !== "model" || !state.modelDrawn) redraw();
}

function setUpControls() {
  meta.layers.forEach((name, l) => $("layer").add(new Option(name, l)));
  meta.heads.forEach((name, h) => $("matrix-head").add(new Option(name, h)));
  $("layer").value = state.layer;
  $("matrix-head").value = state.matrixHead;
  $("threshold").value = state.threshold;
  $("scale").value = state.scale;
  meta.heads.forEach((name, h) => {
    const label = document.createElement("label");
    label.id = `head-${h}`;
    label.style.background = headColour(h);
    label.title = "click: show or hide this head; shift-click: this head only";
    label.textContent = name;
    label.classList.toggle("off", !state.heads.has(h));
    label.addEventListener("click", (e) => {
      if (e.shiftKey) state.heads = new Set([h]);
      else if (state.heads.has(h)) state.heads.delete(h);
      else state.heads.add(h);
      for (let k = 0; k < H; k++) $(`head-${k}`).classList.toggle("off", !state.heads.has(k));
      if (state.heads.has(h)) {
        state.matrixHead = h;
        $("matrix-head").value = h;
      }
      if (state.view !== "model") redraw();
    });
    $("heads").appendChild(label);
  });
  for (const b of document.querySelectorAll(".tabs button")) b.addEventListener("click", () => showView(b.dataset.view));
  $("layer").addEventListener("change", (e) => {
    state.layer = Number(e.target.value);
    redraw();
  });
  $("matrix-head").addEventListener("change", (e) => {
    state.matrixHead = Number(e.target.value);
    drawMatrix();
  });
  $("threshold").addEventListener("change", (e) => {
    const t = Number(e.target.value);
    if (t >= 0 && t < 1) state.threshold = t;
    e.target.value = state.threshold;
    if (state.view === "head") drawHeadView();
  });
  $("scale").addEventListener("change", (e) => {
    state.scale = e.target.value;
    state.modelDrawn = false;
    redraw();
  });
  for (const col of [$("query-col"), $("key-col")]) {
    col.addEventListener("mouseover", (e) => {
      if (e.target.classList.contains("tok")) focusToken(e.target.dataset.side, Number(e.target.dataset.index));
    });
    col.addEventListener("mouseleave", () => focusToken(null, -1));
  }
  const canvas = $("matrix-canvas");
  canvas.addEventListener("mousemove", showTooltip);
  canvas.addEventListener("mouseleave", () => ($("tooltip").style.display = "none"));
  $("zoom-in").addEventListener("click", () => zoom(2));
  $("zoom-out").addEventListener("click", () => zoom(0.5));
  $("matrix-box").addEventListener("wheel", (e) => {
    if (!e.ctrlKey) return; // plain wheel scrolls
    e.preventDefault();
    zoom(e.deltaY < 0 ? 2 : 0.5);
  }, { passive: false });
}

async function main() {
  if (typeof DecompressionStream === "undefined") {
    $("head-message").textContent = "This browser is too old for the explorer (it has no DecompressionStream).";
    return;
  }
  const t0 = performance.now();
  codes = await inflate(meta.codes);
  const t1 = performance.now();
  if (codes.length !== N * H * L * S) throw new Error(`expected ${N * H * L * S} weights, got ${codes.length}`);
  setUpControls();
  redraw();
  const t2 = performance.now();
  // For scripts and tests: the data as the page reads it, and a flag once the first view is drawn.
  window.qkvExplorer = { meta, state, matrix, weight, redraw, showView, drawnLines: () => drawn, timings: { start: t0, inflate: t1 - t0, draw: t2 - t1, ready: t2 } }; // ms since navigation
  document.body.dataset.ready = "true";
}

main();

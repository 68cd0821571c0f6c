// The book's planner page (book/planner.md): reads the form, asks the package's own Python
// (handbook_lib.models.plan_output.plan_page, run by Pyodide from this site) and draws the answer.
// No logic of the planner is written here: only reading inputs, and drawing tables and a bar.

const root = document.documentElement.dataset.content_root || "../";
// The widget's markup, the same on every page that embeds it (a <div id="hb-planner">).
const FORM = `
<form id="hb-form" autocomplete="off" onsubmit="return false">
  <fieldset><legend>Model</legend>
    <label>Preset <select name="model">
      <option>llama2-7b</option><option>llama2-13b</option><option selected>llama2-70b</option>
      <option>llama3-405b</option><option>gpt3-175b</option></select></label>
    <label class="hb-wide">or a pasted <code>config.json</code>
      <textarea name="config" rows="3" placeholder='{"model_type": "llama", ...}'></textarea></label>
    <span class="hb-error" data-for="config"></span>
  </fieldset>
  <fieldset><legend>GPUs</legend>
    <label>GPU <select name="gpu">
      <option>a100-40gb</option><option>a100-80gb</option><option selected>h100-80gb</option>
      <option>h200-141gb</option><option>b200-180gb</option><option>l4-24gb</option>
      <option>mi300x-192gb</option></select></label>
    <label>GPUs <input name="gpus" value="32" inputmode="numeric" size="6"></label>
    <span class="hb-error" data-for="gpus"></span>
    <label>GPUs per node <input name="gpus_per_node" inputmode="numeric" size="4" placeholder="8"></label>
    <label>network <select name="inter_link"><option>ib-ndr400</option><option>ib-hdr200</option>
      <option>100gbe</option><option>25gbe</option></select></label>
    <label>ports per node <input name="nics_per_node" inputmode="numeric" size="10" placeholder="one a GPU"></label>
    <label>HSDP shard group <input name="shard_group_size" inputmode="numeric" size="7" placeholder="a node"></label>
    <span class="hb-error" data-for="shard_group_size"></span>
  </fieldset>
  <fieldset><legend>Job</legend>
    <label>sequence length <input name="seq_len" value="4096" inputmode="numeric" size="7"></label>
    <span class="hb-error" data-for="seq_len"></span>
    <label>micro-batch <input name="micro_batch" value="1" inputmode="numeric" size="4"></label>
    <label>accumulation <input name="grad_accum" inputmode="numeric" size="3" placeholder="1"></label>
    <label>loss chunks <input name="loss_chunks" inputmode="numeric" size="3" placeholder="1"></label>
    <span class="hb-error" data-for="loss_chunks"></span>
    <span class="hb-error" data-for="grad_accum"></span>
    <label><input type="checkbox" name="sync_every_micro_step"> reduce every micro-step</label>
    <label>precision <select name="precision"><option selected>bf16-mixed</option><option>fp32</option>
      <option>fp16-mixed</option><option>bf16</option></select></label>
    <label>optimizer <select name="optimizer"><option selected>adamw</option><option>adam</option>
      <option>sgd-momentum</option><option>sgd</option></select></label>
    <label>optimizer step <select name="optimizer_impl"><option value="">default</option><option>foreach</option>
      <option>fused</option><option>for-loop</option></select></label>
    <label>checkpointing (AC) <select name="activation_checkpointing"><option value="">full</option>
      <option>selective</option></select></label>
    <label>AC every <input name="ac_every" inputmode="numeric" size="3" placeholder="1"> layers</label>
    <label>selective keeps <select name="ac_save"><option value="">matmul+attention</option><option>matmul</option>
      <option>attention</option></select></label>
    <label>every <input name="ac_matmul_every" inputmode="numeric" size="3" placeholder="1"> products</label>
    <span class="hb-error" data-for="ac_every"></span><span class="hb-error" data-for="ac_save"></span>
    <span class="hb-error" data-for="ac_matmul_every"></span>
    <label>headroom <input name="headroom" value="0" size="4"></label>
    <span class="hb-error" data-for="headroom"></span>
    <label><input type="checkbox" name="sensitivity"> sensitivity</label>
  </fieldset>
  <fieldset><legend>Layout beyond FSDP (optional)</legend>
    <label>TP <input name="tp_size" inputmode="numeric" size="3" placeholder="1"></label>
    <label>SP <input name="sp_size" inputmode="numeric" size="3" placeholder="1"></label>
    <label>SP method <select name="sp_method"><option value="">-</option><option>ulysses</option>
      <option>ring</option></select></label>
    <label>PP <input name="pp_size" inputmode="numeric" size="3" placeholder="auto"></label>
    <label>batch tokens <input name="batch_tokens" inputmode="numeric" size="9"></label>
    <span class="hb-error" data-for="tp_size"></span><span class="hb-error" data-for="sp_method"></span>
  </fieldset>
</form>
<p id="hb-status" class="hb-status" role="status">The planner starts when this part of the page is in view.</p>
<div id="hb-answer" aria-live="polite"></div>
`;
const widget = document.getElementById("hb-planner");
widget.innerHTML = FORM;
const status = document.getElementById("hb-status");
const answer = document.getElementById("hb-answer");
const form = document.getElementById("hb-form");
let ask = null;          // the Python entry, once loaded
let lastGood = null;     // the last answer drawn, kept on screen under an error
let pending = 0;

const fmtBytes = (b) => (b >= 1e12 ? (b / 1e12).toFixed(2) + " TB" : (b / 1e9).toFixed(2) + " GB");
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
const margin = (m) => (m >= 0 ? "+" : "") + (Math.abs(m) < 1 ? (100 * m).toFixed(1) : (100 * m).toFixed(0)) + " %";

function fields() {
  const out = {};
  for (const el of form.elements) {
    if (!el.name) continue;
    out[el.name] = el.type === "checkbox" ? el.checked : el.value.trim();
  }
  return out;
}

function table(headers, rows) {
  const head = headers.map((h) => `<th>${esc(h)}</th>`).join("");
  const body = rows.map((r) => "<tr>" + r.map((c) => `<td>${esc(c)}</td>`).join("") + "</tr>").join("");
  return `<div class="hb-scroll"><table class="hb-table"><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table></div>`;
}

// The recommended option's peak (or the first option's) by part, as a stacked bar (SVG), with the budget.
function bar(pick) {
  const parts = Object.entries(pick.parts).filter(([, v]) => v > 0);
  const total = Math.max(pick.peak, pick.budget, 1);
  const width = 640, height = 34, colours = ["#1f77b4", "#ff7f0e", "#2ca02c"];
  let x = 0, svg = "";
  parts.forEach(([name, bytes], i) => {
    const w = (bytes / total) * width;
    svg += `<rect x="${x.toFixed(1)}" y="0" width="${w.toFixed(1)}" height="${height}" fill="${colours[i % 3]}">` +
      `<title>${esc(name)}: ${fmtBytes(bytes)}</title></rect>`;
    x += w;
  });
  const limit = (pick.budget / total) * width;
  svg += `<line x1="${limit.toFixed(1)}" x2="${limit.toFixed(1)}" y1="0" y2="${height}" stroke="black" ` +
    `stroke-width="2" stroke-dasharray="4 3"/>`;
  const legend = parts.map(([name, bytes], i) =>
    `<span class="hb-key"><span style="background:${colours[i % 3]}"></span>${esc(name)} ${fmtBytes(bytes)}</span>`);
  return `<svg class="hb-bar" viewBox="0 0 ${width} ${height}" role="img" aria-label="memory per GPU by part">` +
    `${svg}</svg><p class="hb-legend">${legend.join(" ")} <span class="hb-key">dashed: the budget ` +
    `${fmtBytes(pick.budget)}</span></p>`;
}

function draw(result) {
  const view = result.view, report = result.report;
  const rows = view.options.map((o) => [o.name, o.gpus, fmtBytes(o.allocated), fmtBytes(o.reserved),
    fmtBytes(o.budget), o.fits || o.margin < 0 ? margin(o.margin) : "host RAM", o.comm_s.toFixed(3),
    o.compute_s.toFixed(3), o.step_s.toFixed(3), o.bound === "communication" ? "comm" : "comp"]);
  let html = `<p class="hb-shape">${esc(result.shape)}</p>`;
  html += table(["option", "GPUs", "allocated", "reserved", "budget", "margin", "comm s", "comp s", "step s",
    "bound"], rows);
  html += `<p class="hb-legend">AC: activation checkpointing, ${esc(report.checkpointing)}</p>`;
  const pick = view.pick;
  html += `<p><strong>${esc(pick.name)}</strong>${report.recommended ? " (recommended)" : " (nothing fits)"}: ` +
    `${fmtBytes(pick.peak)} allocated at its peak, ${fmtBytes(pick.reserved)} reserved, per GPU</p>`;
  html += bar(pick);
  html += "<ul>" + report.reasons.map((r) => `<li>${esc(r)}</li>`).join("") + "</ul>";
  html += `<p class="hb-legend">Not modelled: ${report.not_modelled.map(esc).join("; ")}.</p>`;
  if (report.sensitivity) {
    html += table(["assumption", "changed to", "recommended", "step s", "verdict"], report.sensitivity.map((c) =>
      [c.assumption, c.changed, c.recommended, c.step_s.toFixed(3), c.flips ? "FLIPS" : "same"]));
  }
  if (report.search) {
    html += `<p><strong>Searched</strong> ${esc(report.search.searched)}</p>`;
    html += table(["fastest that fit", "reserved", "step s", "tok/s/GPU", "vs best"], view.search.map((c) =>
      [c.name, fmtBytes(c.reserved), c.step_s.toFixed(3), Math.round(c.tokens_per_s_per_gpu).toLocaleString("en"),
       c.vs_best === 0 ? "best" : c.tie ? "tie" : margin(c.vs_best)]));
    html += `<p>${esc(report.search.verdict)}</p>`;
  }
  if (report.axes) {
    html += "<p><strong>Beyond FSDP</strong> (chapter 9)</p>";
    html += table(["layout", "reserved", "margin", "bubble s", "step s", "tok/s/GPU"], view.axes.map((r) =>
      [r.name, fmtBytes(r.reserved), r.fits && !r.within_batch ? "batch" : margin(r.margin), r.bubble_s.toFixed(3),
       r.step_s.toFixed(3), Math.round(r.tokens_per_s_per_gpu).toLocaleString("en")]));
    html += `<p>${esc(report.axes.why)}</p>`;
  }
  html += `<p class="hb-command">The same from a terminal: <code>${esc(result.command)}</code></p>`;
  answer.innerHTML = html;
}

function showError(result) {
  for (const span of form.querySelectorAll(".hb-error")) span.textContent = "";
  const where = result.field && form.querySelector(`.hb-error[data-for="${result.field}"]`);
  if (where) where.textContent = result.error;
  status.textContent = "error: " + result.error + (lastGood ? " (the last good answer is kept below)" : "");
}

async function update() {
  if (!ask) return;
  const ticket = ++pending;
  const start = performance.now();
  const result = JSON.parse(ask(JSON.stringify(fields())));
  if (ticket !== pending) return;
  if (result.error) { showError(result); return; }
  for (const span of form.querySelectorAll(".hb-error")) span.textContent = "";
  lastGood = result;
  draw(result);
  const ms = performance.now() - start;
  status.textContent = `answered in ${ms.toFixed(0)} ms`;
  window.hbPlanner.last = { result, ms };
}

async function start() {
  const t0 = performance.now();
  status.textContent = "loading the planner's Python (about 14 MB, once)...";
  const { loadPyodide } = await import(root + "_static/pyodide/pyodide.mjs");
  const pyodide = await loadPyodide({ indexURL: root + "_static/pyodide/" });
  status.textContent = "loading the book's models...";
  const zip = await (await fetch(root + "_static/planner/handbook_models.zip")).arrayBuffer();
  pyodide.unpackArchive(new Uint8Array(zip), "zip");
  ask = pyodide.runPython("from handbook_lib.models.plan_output import plan_page\nplan_page");
  window.hbPlanner.ask = (f) => JSON.parse(ask(JSON.stringify(f)));
  await update();
  window.hbPlanner.firstAnswerMs = performance.now() - t0;
  status.textContent += ` (first answer ${(window.hbPlanner.firstAnswerMs / 1000).toFixed(1)} s after the page asked)`;
}

window.hbPlanner = { ready: null };
form.addEventListener("input", () => { update().catch((e) => { status.textContent = "error: " + e; }); });
const observer = new IntersectionObserver((entries) => {
  if (entries.some((e) => e.isIntersecting) && !window.hbPlanner.ready) {
    window.hbPlanner.ready = start().catch((e) => { status.textContent = "the planner could not start: " + e; });
    observer.disconnect();
  }
});
observer.observe(widget);

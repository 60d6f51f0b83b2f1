// The run page: runs list (#/), one run (#/run/<id>), launch form (#/new). Plain DOM, no build step.
"use strict";

const TOKEN_KEY = "shardtune-token";
const view = document.getElementById("view");
let current = { source: null, charts: [], cleanup: [] };

// --- helpers -------------------------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
function fmtNum(value, digits) { return value === null || value === undefined ? "–" : Number(value).toFixed(digits); }
function fmtBytes(value) {
  if (value === null || value === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = value, i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
}
function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(seconds));
  return `${Math.floor(s / 3600)}:${String(Math.floor(s % 3600 / 60)).padStart(2, "0")}:${String(s % 60).padStart(2, "0")}`;
}
function fmtTime(unix) { return unix ? new Date(unix * 1000).toLocaleString() : "–"; }
function stateBadge(state) { return el("span", { class: `state ${state}`, "data-state": state }, state); }
function token() { return localStorage.getItem(TOKEN_KEY) || ""; }
// Every read needs the token too (the server refuses one without it, with a line saying why).
async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store", headers: { "X-Shardtune-Token": token() } });
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(body.error || `${url}: ${response.status}`);
  }
  return response.json();
}
async function postJSON(url, body) {
  const response = await fetch(url, {
    method: "POST", headers: { "Content-Type": "application/json", "X-Shardtune-Token": token() },
    body: JSON.stringify(body || {}),
  });
  return { status: response.status, body: await response.json() };
}
function runLink(id, text) { return el("a", { href: "#/run/" + encodeURIComponent(id) }, text); }
function fill(node, ...children) { node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined)); }
function clearView() {
  if (current.source) current.source.close();
  current.charts.forEach((chart) => chart.destroy());
  current.cleanup.forEach((fn) => fn());
  current = { source: null, charts: [], cleanup: [] };
  view.replaceChildren();
}
function showError(where, error) { where.replaceChildren(el("p", { class: "error" }, String(error.message || error))); }

// --- token: given once in the URL by `shardtune web`, then kept in this browser ----------------------------------
(function takeToken() {
  const params = new URLSearchParams(location.search);
  if (params.has("token")) {
    localStorage.setItem(TOKEN_KEY, params.get("token"));
    history.replaceState(null, "", location.pathname + location.hash);
  }
  document.getElementById("token-state").textContent =
    token() ? "" : "no token: open the URL shardtune web printed";
})();

// --- runs list -----------------------------------------------------------------------------------------------
async function showRuns() {
  clearView();
  const card = el("section", { class: "card" }, el("h2", {}, "Runs"), el("p", { class: "muted" }, "loading…"));
  view.append(el("h1", {}, "Runs"), card);
  const refresh = async () => {
    try {
      const data = await getJSON("/api/runs");
      const rows = data.runs.map((run) => el("tr", { "data-run-id": run.id },
        el("td", {}, runLink(run.id, run.name)), el("td", { class: "muted" }, run.id), el("td", {}, stateBadge(run.state)),
        el("td", { class: "num" }, `${run.step}/${run.total_steps || "?"}`),
        el("td", { class: "num" }, run.percent === null ? "–" : run.percent.toFixed(1) + "%"),
        el("td", { class: "num" }, fmtDuration(run.eta_seconds)), el("td", { class: "num" }, fmtNum(run.loss, 4)),
        el("td", { class: "num" }, run.world_size || "–"), el("td", {}, fmtTime(run.started))));
      card.replaceChildren(el("h2", {}, `Runs under ${data.root}`), rows.length ? el("table", { id: "runs" },
        el("thead", {}, el("tr", {}, ["name", "folder", "state", "step", "done", "ETA", "loss", "ranks", "started"]
          .map((h) => el("th", {}, h)))), el("tbody", {}, rows))
        : el("p", { class: "muted" }, "No runs yet: start one with New run, or `shardtune train` with output_dir under this folder."));
    } catch (error) { showError(card, error); }
  };
  await refresh();
  const timer = setInterval(refresh, 3000);
  current.cleanup.push(() => clearInterval(timer));
}

// --- one run -------------------------------------------------------------------------------------------------
const chartState = { log: true, smoothing: 0.0, overlays: [], logSize: -1, ids: "" };

async function showRun(id) {
  clearView();
  chartState.logSize = -1;
  const header = el("section", { class: "card", id: "run-header" }, el("p", { class: "muted" }, "loading…"));
  const charts = el("section", { class: "card", id: "charts" });
  const ranks = el("section", { class: "card", id: "ranks" });
  const memory = el("section", { class: "card", id: "memory" });
  const errors = el("section", { class: "card", id: "errors", hidden: true });
  const checkpoints = el("section", { class: "card", id: "checkpoints" });
  const nodes = el("section", { class: "card", id: "nodes" });
  const config = el("section", { class: "card", id: "config" });
  const consoleCard = el("section", { class: "card", id: "console", hidden: true });
  view.append(el("h1", {}, el("span", { id: "run-name" }, id)), header, errors, ranks,
    el("div", { class: "grid2" }, charts, memory), checkpoints, nodes, config, consoleCard);
  buildChartControls(charts, id);
  let configShown = await buildConfig(config, id);
  const render = (detail) => {
    if (!configShown && detail.step > 0) buildConfig(config, id).then((shown) => { configShown = shown; });
    renderHeader(header, detail);
    renderRanks(ranks, detail);
    renderMemory(memory, detail);
    renderErrors(errors, consoleCard, detail);
    renderCheckpoints(checkpoints, detail);
    renderNodes(nodes, detail);
    if (detail.log_size !== chartState.logSize) { chartState.logSize = detail.log_size; drawCharts(id); }
  };
  try { render(await getJSON("/api/run?id=" + encodeURIComponent(id))); } catch (error) { showError(header, error); return; }
  // Live: the server pushes the run's state whenever its files change (it reads them every half second).
  // An EventSource cannot send a header: the token goes in its URL (accepted for reads only).
  const source = new EventSource("/api/events?id=" + encodeURIComponent(id) + "&token=" + encodeURIComponent(token()));
  source.onmessage = (event) => render(JSON.parse(event.data));
  current.source = source;
}

// Stop asks for a second click within 5 s; the header is redrawn on every update, so the first click is kept here.
let stopArmed = { id: null, at: 0 };

function renderHeader(card, d) {
  const live = ["running", "starting", "stalled"].includes(d.state);
  const stopping = d.stop && !d.stop.done;
  const armed = stopArmed.id === d.id && Date.now() - stopArmed.at < 5000;
  const stop = el("button", { class: "danger", id: "stop-button", disabled: !live || !token() || stopping },
    stopping ? "Stopping…" : armed ? "Confirm stop" : "Stop");
  stop.addEventListener("click", async () => {
    if (!(stopArmed.id === d.id && Date.now() - stopArmed.at < 5000)) {
      stopArmed = { id: d.id, at: Date.now() }; stop.textContent = "Confirm stop"; return;
    }
    stopArmed = { id: null, at: 0 };
    stop.disabled = true; stop.textContent = "Stopping…";
    const result = await postJSON("/api/stop?id=" + encodeURIComponent(d.id));
    if (result.status >= 300) alertBox(card, result.body.error);
  });
  const percent = d.percent === null ? 0 : d.percent;
  card.replaceChildren(...[
    el("div", { class: "row" }, el("span", { id: "run-state" }, stateBadge(d.state)),
      el("span", {}, "step ", el("b", { id: "run-step" }, d.step), ` / ${d.total_steps || "?"}`),
      el("span", {}, "ETA ", el("b", { id: "run-eta" }, fmtDuration(d.eta_seconds))),
      el("span", { class: "muted" }, `elapsed ${fmtDuration(d.elapsed_seconds)}`),
      el("span", { class: "muted" }, `${d.world_size || "?"} rank(s)`),
      el("span", { class: "muted" }, `folder ${d.id}`), stop),
    el("div", { class: "progress" }, el("div", { style: `width:${percent}%` })),
    d.stop ? el("p", { id: "stop-report", class: d.stop.done ? (Object.keys(d.stop.remaining).length ? "error" : "ok") : "muted" },
      stopText(d.stop)) : null].filter(Boolean));
}
function stopText(stop) {
  if (!stop.done) return `Stop: SIGTERM sent to ${Object.values(stop.signalled).join(", ") || "no process"}; waiting for the ranks to save and exit…`;
  const killed = Object.values(stop.killed);
  const left = Object.values(stop.remaining);
  if (left.length) return `Stop: processes still running: ${left.join(", ")}`;
  return "Stopped: no process of this run is left" + (killed.length ? ` (killed after the grace period: ${killed.join(", ")})` : "");
}
function alertBox(card, text) { card.append(el("p", { class: "error" }, text)); }

function renderRanks(card, d) {
  const rows = d.ranks.map((r) => {
    const flags = [];
    if (r.straggler) flags.push(el("span", { class: "flag straggler" }, "straggler"));
    if (r.stalled) flags.push(el("span", { class: "flag stalled" }, "stalled"));
    if (r.phase) flags.push(el("span", { class: "flag phase" }, r.phase));
    const memory = r.mem_allocated !== null && r.mem_allocated !== undefined
      ? `${fmtBytes(r.mem_allocated)} / ${fmtBytes(r.mem_reserved)} / ${fmtBytes(r.mem_peak)}` : `${fmtBytes(r.rss)} rss`;
    return el("tr", { "data-rank": r.rank, class: [r.straggler ? "straggler" : "", r.stalled ? "stalled" : ""].join(" ").trim() || null },
      el("td", {}, r.rank), el("td", {}, r.host || "–"), el("td", { class: "num" }, r.pid || "–"),
      el("td", { class: "num step" }, r.step), el("td", { class: "num" }, fmtNum(r.step_s, 3)),
      el("td", { class: "num" }, fmtNum(r.own_s, 3)), el("td", { class: "num" }, fmtNum(r.wait_s, 3)),
      el("td", { class: "num" }, fmtNum(r.data_s, 3)), el("td", { class: "num" }, fmtNum(r.tokens_per_s, 0)),
      el("td", { class: "num" }, fmtNum(r.loss, 4)), el("td", { class: "num" }, memory),
      el("td", { class: "num heartbeat" }, r.heartbeat_age === null ? "–" : r.heartbeat_age.toFixed(1) + " s"),
      el("td", { class: "flags" }, flags));
  });
  fill(card, el("h2", {}, "Ranks"),
    rows.length ? el("table", { id: "rank-table" }, el("thead", {}, el("tr", {},
      ["rank", "host", "pid", "step", "step s", "own s", "wait s", "data s", "tokens/s", "loss",
        "memory (alloc / reserved / peak, or host rss)", "heartbeat", ""].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows))
      : el("p", { class: "muted" }, "No rank has written a step log yet (each rank writes it once its model and data are ready)."),
    el("p", { class: "muted" }, "own s: step time less the time the rank waited for the others; a straggler's own time is over 1.3× the median of the ranks. Stalled: no record for 10× the median step time (30 s at least)."));
}

function renderMemory(card, d) {
  const rows = d.ranks.map((r) => {
    const estimate = r.estimate_peak_bytes, measured = r.measured_peak_bytes;
    const top = Math.max(estimate || 0, measured || 0, 1);
    return el("tr", {}, el("td", {}, r.rank), el("td", { class: "num" }, fmtBytes(estimate)),
      el("td", { class: "num" }, fmtBytes(measured)),
      el("td", { class: "num" }, estimate && measured ? (measured / estimate).toFixed(2) : "–"),
      el("td", {}, el("span", { class: "bar estimate", style: `width:${Math.round(120 * (estimate || 0) / top)}px` }), el("br"),
        el("span", { class: "bar", style: `width:${Math.round(120 * (measured || 0) / top)}px` })));
  });
  const results = d.results || {};
  fill(card, el("h2", {}, "Memory per rank: estimated vs measured"),
    rows.length ? el("table", {}, el("thead", {}, el("tr", {}, ["rank", "estimated peak", "measured peak", "ratio", ""]
      .map((h) => el("th", {}, h)))), el("tbody", {}, rows)) : el("p", { class: "muted" }, "–"),
    results.peak_memory_bytes_per_rank ? el("p", { class: "muted" }, "At the end (train_results.json): " +
      results.peak_memory_bytes_per_rank.map(fmtBytes).join(", ")) : null,
    el("p", { class: "muted" }, "Measured: device peak on a GPU; on the CPU the resident memory gained since the model started loading (as the estimate counts it)."));
}

function renderErrors(card, consoleCard, d) {
  card.hidden = !d.errors.length;
  card.replaceChildren(el("h2", { class: "error" }, "Errors"), ...d.errors.map((e) => el("div", { class: "rank-error", "data-rank": e.rank },
    el("p", { class: e.consequence ? "muted" : "error" }, e.summary),
    el("details", {}, el("summary", {}, `rank ${e.rank}'s traceback (${e.file})`), el("pre", {}, e.traceback)))));
  const showConsole = d.console_tail.length && ["failed", "exited", "starting", "stopped"].includes(d.state);
  consoleCard.hidden = !showConsole;
  consoleCard.replaceChildren(el("h2", {}, "Console (the end of .shardtune/console.log)"), el("pre", {}, d.console_tail.join("\n")));
}

function renderCheckpoints(card, d) {
  const rows = d.checkpoints.map((c) => el("tr", { "data-name": c.name, "data-complete": c.complete ? "1" : "0" },
    el("td", {}, c.name), el("td", { class: "num" }, c.step), el("td", {}, c.complete ? "complete" : "incomplete (interrupted mid-save)"),
    el("td", { class: "num" }, fmtBytes(c.size_bytes)), el("td", { class: "num" }, saveCost(c)),
    el("td", {}, c.resume_command ? el("code", {}, c.resume_command) : "–")));
  card.replaceChildren(el("h2", {}, "Checkpoints"), rows.length ? el("table", { id: "checkpoint-table" },
    el("thead", {}, el("tr", {}, ["folder", "step", "state", "size", "training held / write", "resume with"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows)) : el("p", { class: "muted" }, "No checkpoint yet."));
}

function saveCost(c) {
  if (typeof c.blocked_seconds !== "number") return "–";
  const mode = c.async_save ? " (async)" : "";
  return `${c.blocked_seconds.toFixed(2)} s / ${(c.write_seconds ?? 0).toFixed(2)} s${mode}`;
}

function renderNodes(card, d) {
  card.replaceChildren(el("h2", {}, "Launch command of every node"), d.nodes.length ? el("table", {},
    el("thead", {}, el("tr", {}, ["node", "run on the node", "which starts"].map((h) => el("th", {}, h)))),
    el("tbody", {}, d.nodes.map((n) => el("tr", {}, el("td", {}, n.node), el("td", {}, el("code", {}, n.shardtune)),
      el("td", {}, n.torchrun ? el("code", {}, n.torchrun) : "one process, no torchrun")))))
    : el("p", { class: "muted" }, "Not recorded (a run started by another launcher)."));
}

async function buildConfig(card, id) {
  card.replaceChildren(el("h2", {}, "Resolved config"));
  const select = el("select", { id: "diff-select" }, el("option", { value: "" }, "compare with another run…"));
  const body = el("div");
  card.append(select, body);
  try {
    const runs = await getJSON("/api/runs");
    runs.runs.filter((r) => r.id !== id).forEach((r) => select.append(el("option", { value: r.id }, r.id)));
  } catch (error) { /* the list only feeds the select */ }
  let shown = false;
  const show = async () => {
    const other = select.value;
    const data = await getJSON("/api/config?id=" + encodeURIComponent(id) + (other ? "&other=" + encodeURIComponent(other) : ""));
    if (other) {
      body.replaceChildren(data.diff.length ? el("table", { id: "config-diff" }, el("thead", {}, el("tr", {},
        el("th", {}, "key"), el("th", {}, id), el("th", {}, other))), el("tbody", {}, data.diff.map((row) => el("tr", {},
          el("td", {}, el("code", {}, row.key)), el("td", {}, JSON.stringify(row.a)), el("td", {}, JSON.stringify(row.b))))))
        : el("p", { class: "muted" }, "The two configs are the same."));
    } else if (data.config) {
      shown = true;
      body.replaceChildren(el("details", {}, el("summary", {}, `${Object.keys(data.config).length} keys`),
        el("table", { id: "config-table" }, el("tbody", {}, Object.entries(data.config).map(([key, value]) =>
          el("tr", {}, el("td", {}, el("code", {}, key)), el("td", {}, JSON.stringify(value))))))));
    } else body.replaceChildren(el("p", { class: "muted" }, "Not written yet."));
  };
  select.addEventListener("change", () => show().catch((error) => showError(body, error)));
  await show().catch((error) => showError(body, error));
  return shown;
}

// --- curves (uPlot) ------------------------------------------------------------------------------------------
function buildChartControls(card, id) {
  const log = el("input", { type: "checkbox", id: "log-scale", checked: chartState.log });
  const smooth = el("input", { type: "range", id: "smoothing", min: "0", max: "0.95", step: "0.05", value: String(chartState.smoothing) });
  const overlay = el("select", { id: "overlay-select", multiple: true, size: "3" });
  const area = el("div", { id: "chart-area" });
  card.replaceChildren(el("h2", {}, "Curves"), el("div", { class: "row" },
    el("label", {}, log, " log scale"), el("label", {}, "smoothing ", smooth),
    el("label", {}, "overlay runs ", overlay)), area);
  log.addEventListener("change", () => { chartState.log = log.checked; drawCharts(id); });
  smooth.addEventListener("input", () => { chartState.smoothing = Number(smooth.value); drawCharts(id); });
  overlay.addEventListener("change", () => {
    chartState.overlays = Array.from(overlay.selectedOptions).map((o) => o.value); drawCharts(id);
  });
  chartState.overlays = [];
  getJSON("/api/runs").then((data) => data.runs.filter((r) => r.id !== id)
    .forEach((r) => overlay.append(el("option", { value: r.id }, r.id)))).catch(() => {});
}

function axisNumber(v) {
  if (v === null || v === undefined) return "";
  return v !== 0 && Math.abs(v) < 0.01 ? Number(v).toExponential(2) : String(Number(Number(v).toPrecision(3)));
}

function smoothed(points, alpha) {
  if (!alpha) return points;
  let value = null;
  return points.map(([x, y]) => { value = value === null ? y : alpha * value + (1 - alpha) * y; return [x, value]; });
}

async function drawCharts(id) {
  const area = document.getElementById("chart-area");
  if (!area) return;
  let runs;
  try {
    runs = await Promise.all([id, ...chartState.overlays].map((r) => getJSON("/api/curves?id=" + encodeURIComponent(r))));
  } catch (error) { showError(area, error); return; }
  current.charts.forEach((chart) => chart.destroy());
  current.charts = [];
  area.replaceChildren();
  const panels = [["loss", ["loss", "eval_loss"]], ["learning rate", ["learning_rate"]]];
  for (const [title, keys] of panels) {
    const series = [];
    for (const run of runs) for (const key of keys) {
      const points = run.curves[key] || [];
      if (points.length) series.push({ label: `${run.id} ${key}`, points: key === "learning_rate" ? points : smoothed(points, chartState.smoothing) });
    }
    const box = el("div", { class: "chart", "data-chart": title });
    area.append(box);
    if (!series.length) { box.append(el("p", { class: "muted" }, `${title}: nothing logged yet`)); continue; }
    const logScale = chartState.log && title === "loss";  // a learning rate decays to 0: linear
    const positive = (v) => (logScale && !(v > 0) ? null : v);
    const data = uPlot.join(series.map((s) => [s.points.map((p) => p[0]), s.points.map((p) => positive(p[1]))]));
    const colours = ["#0b63c5", "#c62828", "#1a7f37", "#b26a00", "#6f42c1", "#00838f"];
    const options = {
      title, width: Math.max(320, box.clientWidth || 600), height: 240,
      scales: { x: { time: false }, y: logScale ? { distr: 3 } : {} },
      series: [{ label: "step" }, ...series.map((s, i) => ({ label: s.label, stroke: colours[i % colours.length], width: 1.5,
        points: { show: s.points.length < 60 }, spanGaps: true }))],
      axes: [{ label: "step" }, { size: 76, values: (u, ticks) => ticks.map(axisNumber) }],
    };
    current.charts.push(new uPlot(options, data, box));
  }
}

// --- launch form ---------------------------------------------------------------------------------------------
const EXAMPLE = `# A tiny full-parameter SFT on the bundled demo data; edit or upload your own YAML.
model_name_or_path: models/tiny-llama
build_tiny_model_if_missing: true
stage: sft
finetuning_type: full
dataset: demo
dataset_dir: data
template: chatml
output_dir: outputs/from-the-page
overwrite_output_dir: true
max_steps: 50
save_steps: 10
logging_steps: 5
`;

async function showNew() {
  clearView();
  const problemsBox = el("div", { id: "problems" });
  const yaml = el("textarea", { id: "yaml", rows: "16", spellcheck: "false" });
  yaml.value = EXAMPLE;
  const upload = el("input", { type: "file", id: "upload", accept: ".yaml,.yml,.json" });
  upload.addEventListener("change", async () => { if (upload.files[0]) yaml.value = await upload.files[0].text(); });
  const nproc = el("input", { type: "number", id: "nproc", min: "1", max: "64", value: "1" });
  const fieldsBox = el("div", { id: "fields" }, el("p", { class: "muted" }, "loading the keys…"));
  const check = el("button", { id: "check-button" }, "Check");
  const launch = el("button", { class: "primary", id: "launch-button" }, "Launch");
  const verdict = el("p", { id: "verdict", class: "muted" });
  view.append(el("h1", {}, "New run"),
    el("section", { class: "card" }, el("h2", {}, "Config"), el("p", { class: "muted" },
      "A YAML file (shardtune's or LLaMA-Factory's keys); the fields below override it. Relative paths are read from the page's root folder."),
      upload, yaml, el("div", { class: "row" }, el("label", {}, "processes per node (NPROC_PER_NODE) ", nproc), check, launch),
      verdict, problemsBox),
    el("section", { class: "card" }, el("h2", {}, "Keys"), fieldsBox));
  try { renderFields(fieldsBox, (await getJSON("/api/schema")).fields); } catch (error) { showError(fieldsBox, error); }
  const request = () => ({ yaml: yaml.value, nproc_per_node: Number(nproc.value) || 1, values: formValues(fieldsBox) });
  const run = async (url, button) => {
    if (!token()) { problemsBox.replaceChildren(el("p", { class: "error" }, "This page was opened without its token: open the URL shardtune web printed.")); return null; }
    button.disabled = true; verdict.textContent = "checking (the same checks as shardtune check)…";
    problemsBox.replaceChildren();
    try { return await postJSON(url, request()); } finally { button.disabled = false; }
  };
  check.addEventListener("click", async () => {
    const result = await run("/api/check", check);
    if (result) showProblems(result.body, problemsBox, fieldsBox, verdict);
  });
  launch.addEventListener("click", async () => {
    const result = await run("/api/launch", launch);
    if (!result) return;
    if (result.body.ok) { location.hash = "#/run/" + encodeURIComponent(result.body.id); return; }
    showProblems(result.body, problemsBox, fieldsBox, verdict);
  });
}

function renderFields(box, fields) {
  const groups = {};
  fields.forEach((f) => { (groups[f.group] = groups[f.group] || []).push(f); });
  box.replaceChildren(...Object.entries(groups).map(([group, items]) => el("details", { "data-group": group },
    el("summary", {}, `${group} (${items.length})`), items.map(fieldRow))));
}
function fieldRow(f) {
  let input;
  if (f.type === "bool" || f.choices) {
    const options = f.choices || ["true", "false"];
    input = el("select", { "data-key": f.key, id: "key-" + f.key }, el("option", { value: "" }, `default (${f.default})`),
      options.map((c) => el("option", { value: c }, c)));
  } else {
    input = el("input", { "data-key": f.key, id: "key-" + f.key, type: "text", placeholder: f.default });
  }
  return el("div", { class: "field", "data-field": f.key }, el("label", { for: "key-" + f.key }, f.key), input,
    el("span", { class: "doc" }, `${f.type_label}: ${f.doc}`));
}
function formValues(box) {
  const values = {};
  box.querySelectorAll("[data-key]").forEach((input) => { if (input.value !== "") values[input.dataset.key] = input.value; });
  return values;
}
function showProblems(body, problemsBox, fieldsBox, verdict) {
  fieldsBox.querySelectorAll(".field.has-error").forEach((f) => { f.classList.remove("has-error"); f.querySelector(".problem")?.remove(); });
  const problems = body.problems || [];
  if (!problems.length) {
    verdict.className = "ok"; verdict.textContent = body.verdict || "ok"; problemsBox.replaceChildren(); return;
  }
  verdict.className = "error";
  verdict.textContent = `${problems.length} problem(s); nothing was started`;
  problemsBox.replaceChildren(el("ul", { class: "errors" }, problems.map((p) => el("li", { "data-key": p.key || "" }, p.problem))));
  for (const p of problems) {
    const field = p.key && fieldsBox.querySelector(`[data-field="${CSS.escape(p.key)}"]`);
    if (!field) continue;
    field.classList.add("has-error");
    field.append(el("span", { class: "problem" }, p.problem));
    field.closest("details").open = true;
  }
}

// --- routing -------------------------------------------------------------------------------------------------
function route() {
  const hash = location.hash || "#/";
  if (hash.startsWith("#/run/")) return showRun(decodeURIComponent(hash.slice(6)));
  if (hash === "#/new") return showNew();
  return showRuns();
}
window.addEventListener("hashchange", route);
route();

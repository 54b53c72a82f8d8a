/* Turnstile dashboard: per-step charts (uPlot), live refresh of a running run, cancel, submit. */
"use strict";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

/* The uPlot instance of each chart, by figure id (the reset buttons and the tests use them). */
const CHARTS = {};

function fmtValue(v) {
  if (v == null) return "not computed"; // None from the server: absent or turned off, never a 0
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return Number.isInteger(v) ? String(v) : v.toFixed(a < 1 ? 4 : 2);
}

/* A tick label with as many digits as the ticks' spacing `incr` needs (-0.00775 next to -0.0078),
   so neighbouring ticks never read the same. */
function fmtTick(t, incr) {
  const a = Math.abs(t);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) {
    const digits = incr ? Math.ceil(Math.log10(a / incr) - 1e-9) : 1;
    return t.toExponential(Math.min(6, Math.max(1, digits)));
  }
  return String(Number(t.toFixed(incr ? decimalsOf(incr) : 3)));
}

/* The decimals that write `incr` exactly (0.25 -> 2, 0.0005 -> 4), at most 10. */
function decimalsOf(incr) {
  for (let d = 0; d < 10; d++) {
    const scaled = incr * Math.pow(10, d);
    if (Math.abs(scaled - Math.round(scaled)) < 1e-6 * scaled) return d;
  }
  return 10;
}

function tickLabels(u, ticks) {
  const incr = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) : 0;
  return ticks.map((t) => fmtTick(t, incr));
}

/* The y range of an unpinned chart: the data's, padded.  A flat line (every value equal, or one
   step) gets half its value around it (+-1 around 0), so 0.04 is not drawn on a 0..1 axis's 0 line
   and uPlot's 0..100 default never reads as a scale. */
function fitRange(u, min, max) {
  if (min == null || max == null || !Number.isFinite(min) || !Number.isFinite(max)) return [0, 1];
  // Values that differ only past the 7th digit (a PPO ratio of 1 + 3e-8) count as flat, and a span
  // under 1e-4 of the values' size is widened to that: uPlot's ticks over a span that small against
  // the values overflow ("RangeError: Invalid array length", seen with ratios of 1 + 3e-7).
  const size = Math.max(Math.abs(min), Math.abs(max)), mid = (min + max) / 2;
  if (max - min <= 1e-7 * size) {
    const pad = mid === 0 ? 1 : Math.abs(mid) * 0.5;
    return [mid - pad, mid + pad];
  }
  if (max - min < 1e-4 * size) return [mid - 1e-4 * size, mid + 1e-4 * size];
  return uPlot.rangeNum(min, max, 0.1, true);
}

/* The x range: the steps done, one step either side when only one is.  uPlot widens a single x value
   to 0..100 before it asks, so the data are read (`u` is null for the reset button's call). */
function stepRange(u, min, max) {
  const xs = u ? u.data[0] : [];
  if (xs.length === 1) return [xs[0] - 1, xs[0] + 1];
  if (min == null || max == null) return [0, 1];
  return min === max ? [min - 1, max + 1] : [min, max];
}

/* The y axis is as wide as its longest tick label (sign included) plus the tick and a gap: a fixed
   56 px clipped the "-" of -0.0077.  Measured with the axis's own font (uPlot's default). */
const AXIS_FONT = '12px system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, "Noto Sans", sans-serif';
let measureCtx = null;
function yAxisSize(u, values) {
  if (!values || !values.length) return 40;
  measureCtx = measureCtx || document.createElement("canvas").getContext("2d");
  measureCtx.font = AXIS_FONT;
  const widest = Math.max(...values.map((v) => measureCtx.measureText(String(v)).width));
  return Math.ceil(widest) + 10 + 8; // tick (10 px) and a gap on the canvas's left edge
}

/* W&B's smoothing slider (https://docs.wandb.ai/guides/app/features/panels/line-plot/smoothing),
   the debiased exponential moving average, as in TensorBoard:
       last_t = a * last_{t-1} + (1 - a) * y_t,  last_0 = 0,   smoothed_t = last_t / (1 - a^n_t)
   with a in [0, 1) the slider's weight and n_t the count of values seen so far; the debias term
   keeps the first points from being pulled to 0.  None (not computed) stays None and is skipped. */
function smooth(values, a) {
  if (!a) return values.slice();
  let last = 0, n = 0;
  return values.map((v) => {
    if (v == null || !Number.isFinite(v)) return v;
    last = a * last + (1 - a) * v;
    n += 1;
    return last / (1 - Math.pow(a, n));
  });
}

const SMOOTHING_KEY = "turnstile.chartSmoothing";
function smoothing() {
  const v = Number(window.localStorage.getItem(SMOOTHING_KEY));
  return Number.isFinite(v) && v >= 0 && v < 1 ? v : 0;
}

/* One chart's data as CSV: step, then each series (raw values; empty where not computed). */
function chartCsv(c) {
  const quote = (s) => (/[",\n]/.test(s) ? `"${s.replace(/"/g, '""')}"` : s);
  const lines = [["step", ...c.series.map((s) => quote(s.label))].join(",")];
  c.x.forEach((step, i) => {
    lines.push([String(step), ...c.series.map((s) => (s.values[i] == null ? "" : String(s.values[i])))].join(","));
  });
  return lines.join("\n") + "\n";
}

function downloadCsv(c) {
  const url = URL.createObjectURL(new Blob([chartCsv(c)], { type: "text/csv" }));
  const a = document.createElement("a");
  a.href = url;
  a.download = `${c.title.replace(/[^A-Za-z0-9]+/g, "-").replace(/^-|-$/g, "")}.csv`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

/* Series and data of chart `c` at smoothing `a`: with smoothing on, each line is drawn smoothed
   and its raw values faintly behind it (the legend's hover value is the raw, stored number). */
function chartSeries(c, a) {
  const series = [{ label: "step", value: (u, v, si, idx) => (idx == null || v == null ? "-" : String(v)) }];
  const data = [c.x];
  c.series.forEach((s, i) => {
    const band = c.band && (i === 1 || i === 2);  // the band is series 2 and 3; a 4th is a line of its own
    const colour = PALETTE[(s.colour == null ? i : s.colour) % PALETTE.length];
    const line = { label: s.label, stroke: band ? "#93c5fd" : colour, width: band ? 1 : 2,
                   dash: band ? [4, 4] : undefined, spanGaps: false, points: { show: true, size: 5 },
                   value: (u, v, si, idx) => (idx == null ? "-" : fmtValue(s.values[idx])) };
    series.push(line);
    data.push(a && !band ? smooth(s.values, a) : s.values);
  });
  if (a) {
    c.series.forEach((s, i) => {
      if (c.band && (i === 1 || i === 2)) return;
      const colour = PALETTE[(s.colour == null ? i : s.colour) % PALETTE.length];
      series.push({ label: `${s.label} (raw)`, stroke: colour + "44", width: 1, spanGaps: false,
                    points: { show: false }, value: (u, v, si, idx) => (idx == null ? "-" : fmtValue(v)) });
      data.push(s.values);
    });
  }
  return { series, data };
}

function drawCharts(root) {
  const node = root.querySelector("#chart-data");
  if (!node || typeof uPlot === "undefined") return;
  const charts = JSON.parse(node.textContent);
  const a = smoothing();
  const slider = root.querySelector("#chart-smoothing");
  if (slider) {
    slider.value = String(a);
    const shown = root.querySelector("#chart-smoothing-value");
    if (shown) shown.textContent = a.toFixed(2);
    slider.oninput = () => { // kept per user in this browser, like W&B's per-workspace setting
      window.localStorage.setItem(SMOOTHING_KEY, slider.value);
      drawCharts(document);
    };
  }
  for (const c of charts) {
    const box = root.querySelector("#" + c.id);
    if (!box || c.not_computed) continue;
    box.querySelectorAll(".uplot").forEach((el) => el.remove());
    if (CHARTS[c.id]) CHARTS[c.id].plot.destroy();
    const { series, data } = chartSeries(c, a);
    const y = c.range ? { range: c.range, auto: false } : { auto: true, range: fitRange };
    const opts = {
      width: Math.max(300, box.clientWidth - 12), height: 190,
      scales: { x: { time: false, range: stepRange }, y: y },
      axes: [{ label: "step", size: 36, space: 30, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
               values: (u, ticks) => ticks.map((t) => (Number.isInteger(t) && t >= 0 ? String(t) : "")) },
             { size: yAxisSize, space: 24, values: tickLabels }],
      series: series,
      cursor: { drag: { x: true, y: false } },
      legend: { live: true },
    };
    if (c.band) opts.bands = [{ series: [3, 2], fill: "rgba(37, 99, 235, 0.12)" }];
    CHARTS[c.id] = { plot: new uPlot(opts, data, box), x: c.x, chart: c };
  }
  root.querySelectorAll("button.chart-reset").forEach((button) => {
    button.onclick = () => resetZoom(button.dataset.chart);
  });
  root.querySelectorAll("button.chart-csv").forEach((button) => {
    button.onclick = () => { const c = charts.find((ch) => ch.id === button.dataset.chart); if (c) downloadCsv(c); };
  });
}

/* Back to every step after a drag-zoom. */
function resetZoom(id) {
  const chart = CHARTS[id];
  if (!chart || !chart.x.length) return;
  const [min, max] = stepRange(null, chart.x[0], chart.x[chart.x.length - 1]);
  chart.plot.setScale("x", { min, max });
}

/* Live refresh: poll the run's JSON; when anything changed, re-render the live sections from the page. */
function signature(status, counts, version, stepStates, completions, waiting) {
  const sorted = Object.keys(counts || {}).sort().map((k) => [k, counts[k]]);
  return JSON.stringify([status, sorted, version, stepStates, completions, Boolean(waiting)]);
}

function liveRun(page) {
  const runId = page.dataset.runId;
  const rendered = JSON.parse(document.getElementById("run-state").textContent);
  const terminalStates = page.dataset.terminalStates.split(" "); // rendered by the server (app.transitions)
  let last = signature(rendered.status, rendered.episodes_by_status, rendered.policy_version, rendered.steps,
                       rendered.completions, rendered.waiting);
  let lastGood = new Date();
  async function tick() {
    let run;
    try {
      const resp = await fetch(`/api/runs/${runId}`, { headers: { Accept: "application/json" } });
      if (!resp.ok) return failed(`HTTP ${resp.status}`);
      run = await resp.json();
    } catch (err) {
      return failed("the API cannot be reached"); // API restarting: try again on the next tick
    }
    const sig = signature(run.status, run.episodes_by_status, run.policy_version,
                          (run.steps || []).map((s) => s.status), (run.live || {}).completions, run.waiting);
    if (sig !== last) {
      const error = await refreshSections();
      if (error) return failed(error); // keep `last`: the next tick tries the refresh again
    }
    last = sig;
    lastGood = new Date();
    showLive(null);
    if (terminalStates.includes(run.status)) return; // the last refresh showed the end
    schedule();
  }
  function schedule() { setTimeout(tick, 2000); }
  function failed(why) {
    showLive(`refresh failed (${why}); showing ${lastGood.toLocaleTimeString()}, retrying`);
    schedule();
  }
  /* The "live" mark says when the page stopped following the run, instead of going on saying "live". */
  function showLive(problem) {
    const mark = document.getElementById("live-indicator");
    if (!mark) return;
    mark.classList.toggle("stale", Boolean(problem));
    mark.textContent = problem || "live";
  }
  async function refreshSections() {
    let resp;
    try {
      resp = await fetch(window.location.href, { headers: { Accept: "text/html" } });
    } catch (err) {
      return "the page cannot be reached";
    }
    if (!resp.ok) return `the page answered HTTP ${resp.status}`;
    const doc = new DOMParser().parseFromString(await resp.text(), "text/html");
    let previous = null;
    for (const id of ["run-head", "run-stats", "curves", "eval-section", "groups-section", "episodes-section"]) {
      const fresh = doc.getElementById(id), current = document.getElementById(id);
      if (fresh && current) current.replaceWith(fresh);
      else if (fresh && previous) previous.after(fresh); // a section the run has only now (its first group)
      else if (current) current.remove();
      previous = document.getElementById(id) || previous;
    }
    const freshPage = doc.getElementById("run-page");
    if (freshPage) page.dataset.terminal = freshPage.dataset.terminal;
    drawCharts(document);
    bindCancel();
    return null;
  }
  schedule();
}

/* Requests that change something carry the page's CSRF value (the session cookie alone is not enough). */
function csrfHeaders() {
  const meta = document.querySelector('meta[name="csrf-token"]');
  return meta && meta.content ? { "X-CSRF-Token": meta.content } : {};
}

function bindCancel() {
  const button = document.getElementById("cancel-run");
  const page = document.getElementById("run-page");
  if (!button || !page) return;
  button.addEventListener("click", async () => {
    if (!window.confirm(`Cancel run ${page.dataset.runId}? Running episodes are stopped.`)) return;
    button.disabled = true;
    const resp = await fetch(`/api/runs/${page.dataset.runId}/cancel`, { method: "POST", headers: csrfHeaders() });
    const body = await resp.json();
    const out = document.getElementById("cancel-result");
    if (out) out.textContent = resp.ok ? `run ${body.id}: ${body.status}` : body.error.message;
  });
}

/* The submit form: fields -> JSON body; the API's 400 details appear next to their fields. */
function setPath(obj, path, value) {
  const keys = path.split(".");
  let node = obj;
  keys.slice(0, -1).forEach((k) => { node = node[k] = node[k] || {}; });
  node[keys[keys.length - 1]] = value;
}

function fieldValue(el) {
  const raw = el.value.trim();
  if (raw === "") return undefined;
  if (el.tagName === "SELECT") return JSON.parse(raw);
  if (el.dataset.input === "list") return raw.split(",").map((s) => s.trim()).filter((s) => s);
  if (el.dataset.type === "integer" || el.dataset.type === "number") {
    const n = Number(raw);
    return raw !== "" && !Number.isNaN(n) ? n : raw; // a non-number goes as typed: the API names the field
  }
  return raw;
}

function bindSubmit(form) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    form.querySelectorAll("[data-error-for]").forEach((el) => { el.textContent = ""; });
    form.querySelectorAll(".invalid").forEach((el) => el.classList.remove("invalid"));
    const summary = document.getElementById("submit-errors");
    summary.textContent = "";
    const body = {};
    form.querySelectorAll("[data-path]").forEach((el) => {
      const value = fieldValue(el);
      if (value !== undefined) setPath(body, el.dataset.path, value);
    });
    const resp = await fetch("/api/runs", { method: "POST", headers: { "Content-Type": "application/json", ...csrfHeaders() },
                                            body: JSON.stringify(body) });
    const answer = await resp.json();
    if (resp.status === 202) {
      window.location.assign(`/runs/${answer.id}`);
      return;
    }
    const err = answer.error || { message: `HTTP ${resp.status}` };
    const details = err.details && err.details.length ? err.details : [{ field: err.field, message: err.message }];
    const unplaced = [];
    for (const d of details) {
      const slot = d.field ? form.querySelector(`[data-error-for="${CSS.escape(d.field)}"]`) : null;
      if (slot) {
        slot.textContent = d.message;
        const input = form.querySelector(`[data-path="${CSS.escape(d.field)}"]`);
        if (input) input.classList.add("invalid");
      } else {
        unplaced.push(d.field ? `${d.field}: ${d.message}` : d.message);
      }
    }
    summary.textContent = err.message + (unplaced.length && details.length > 1 ? "\n" + unplaced.join("\n") : "");
  });
}

/* The overlay page's legend swatches take the colour of their run's lines. */
function paintSwatches(root) {
  root.querySelectorAll(".swatch[data-index]").forEach((el) => {
    el.style.background = PALETTE[Number(el.dataset.index) % PALETTE.length];
  });
}

/* Open where it matters: a harness log at its end (the error, the final answer), a token view at
   its first sampled token (past the prompt's grey context tokens); also when a closed one is opened. */
function scrollInto(node) {
  node.querySelectorAll("pre.log-tail").forEach((pre) => { pre.scrollTop = pre.scrollHeight; });
  node.querySelectorAll(".tokens").forEach((box) => {
    const first = box.querySelector(".tok"); // .tokens is positioned: offsetTop is within the box
    if (first) box.scrollTop = Math.max(0, first.offsetTop - 24);
  });
}

function scrollToWhatMatters(root) {
  scrollInto(root);
  root.querySelectorAll("details.log, details.sequence").forEach((d) => {
    d.addEventListener("toggle", () => { if (d.open) scrollInto(d); });
  });
}

document.addEventListener("DOMContentLoaded", () => {
  drawCharts(document);
  paintSwatches(document);
  scrollToWhatMatters(document);
  bindCancel();
  const page = document.getElementById("run-page");
  if (page && page.dataset.terminal === "false") liveRun(page);
  const form = document.getElementById("submit-form");
  if (form) bindSubmit(form);
});

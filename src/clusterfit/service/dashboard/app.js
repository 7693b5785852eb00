// clusterfit dashboard: plain JS over the HTTP API, no build step. The token lives in localStorage and is
// sent as a Bearer header; the pages poll the API (jobs every 1.5 s, a job page every 1 s).
"use strict";

const TOKEN_KEY = "clusterfit-token";
const POLL_MS = { jobs: 1500, job: 1000, sweeps: 3000, sweep: 2000 };
// One colour per trial, in trial order (a sweep's chart); the first is LINE_COLOURS.loss.
const TRIAL_COLOURS = ["#1f6fd1", "#e0521b", "#15803d", "#7a3db8", "#b8860b", "#0e7490", "#be185d", "#4b5563"];
const LINE_COLOURS = { loss: "#1f6fd1", rate: "#e0521b", valLoss: "#7a3db8", top1: "#15803d", top5: "#a3a3a3" };
let timer = null;
let logCursor = null;
let logJob = null;

const $ = (id) => document.getElementById(id);

async function api(path, options = {}) {
  const headers = { Authorization: `Bearer ${localStorage.getItem(TOKEN_KEY) || ""}` };
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    localStorage.removeItem(TOKEN_KEY);
    show("login");
    throw new Error((await response.json()).detail);
  }
  if (!response.ok) throw new Error(`${response.status}: ${(await response.json()).detail}`);
  return response.json();
}

function show(section) {
  for (const id of ["login", "jobs", "job", "sweeps", "sweep"]) $(id).hidden = id !== section;
  $("logout").hidden = section === "login";
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text === null || text === undefined ? "-" : String(text);
  if (className) td.className = className;
  return td;
}

const fixed = (value, digits) => (value === null || value === undefined ? "-" : Number(value).toFixed(digits));
const progress = (job) => (job.step === null ? "-" : job.total_steps ? `${job.step}/${job.total_steps}` : String(job.step));

async function renderJobs() {
  const jobs = await api("/api/jobs?limit=200");
  const body = $("jobs-table").tBodies[0];
  body.replaceChildren();
  for (const job of jobs) {
    const row = body.insertRow();
    row.className = "job";
    row.dataset.id = job.id;
    row.onclick = () => (location.hash = `#/jobs/${job.id}`);
    cell(row, job.id);
    cell(row, job.name);
    cell(row, job.state, `state ${job.state}`);
    cell(row, job.backend);
    cell(row, job.ranks);
    cell(row, progress(job));
    cell(row, fixed(job.images_per_s, 1));
    cell(row, fixed(job.loss, 4));
    cell(row, (job.submitted_at || "").slice(0, 19).replace("T", " "));
  }
  $("jobs-empty").hidden = jobs.length > 0;
}

// A line chart on a <canvas>: axes with min/max labels, one polyline per series ({points, colour}), and an
// optional dashed vertical line at `markStep` (the best validation). Enough for losses, accuracy and images/s.
function drawChart(canvas, series, markStep = null) {
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  const pad = { left: 56, right: 12, top: 12, bottom: 28 };
  ctx.clearRect(0, 0, width, height);
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, width, height);
  ctx.strokeStyle = "#999";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(pad.left, pad.top);
  ctx.lineTo(pad.left, height - pad.bottom);
  ctx.lineTo(width - pad.right, height - pad.bottom);
  ctx.stroke();
  ctx.fillStyle = "#555";
  ctx.font = "11px sans-serif";
  const all = series.flatMap((line) => line.points);
  if (all.length === 0) {
    ctx.fillText("no data yet", pad.left + 10, pad.top + 16);
    return;
  }
  const xs = all.map((p) => p[0]);
  const ys = all.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y0 === y1) [y0, y1] = [y0 - 1, y1 + 1];
  const sx = (x) => pad.left + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const sy = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);
  ctx.fillText(y1.toPrecision(4), 4, pad.top + 8);
  ctx.fillText(y0.toPrecision(4), 4, height - pad.bottom);
  ctx.fillText(`step ${x0}`, pad.left, height - 8);
  ctx.fillText(`step ${x1}`, width - pad.right - 50, height - 8);
  if (markStep != null) {
    ctx.strokeStyle = "#555";
    ctx.lineWidth = 1;
    ctx.setLineDash([4, 4]);
    ctx.beginPath();
    ctx.moveTo(sx(markStep), pad.top);
    ctx.lineTo(sx(markStep), height - pad.bottom);
    ctx.stroke();
    ctx.setLineDash([]);
  }
  for (const { points, colour } of series) {
    ctx.strokeStyle = colour;
    ctx.fillStyle = colour;
    ctx.lineWidth = 3;
    ctx.beginPath();
    points.forEach(([x, y], i) => (i ? ctx.lineTo(sx(x), sy(y)) : ctx.moveTo(sx(x), sy(y))));
    ctx.stroke();
    for (const [x, y] of points) ctx.fillRect(sx(x) - 3, sy(y) - 3, 6, 6);
  }
}

// The validation with the best top-1 (the first of equals), or null before any.
function bestValidation(validations) {
  return validations.reduce((best, v) => (v.top1 != null && (best == null || v.top1 > best.top1) ? v : best), null);
}

async function renderJob(id) {
  if (logJob !== id) {
    logJob = id;
    logCursor = null;
    $("log").textContent = "";
  }
  const [job, metrics] = await Promise.all([api(`/api/jobs/${id}`), api(`/api/jobs/${id}/metrics`)]);
  $("job-id").textContent = job.id;
  $("job-name").textContent = `(${job.name})`;
  $("job-state").textContent = job.state;
  $("job-state").className = `state ${job.state}`;
  const attempt = job.attempt ? `attempt ${job.attempt} of ${job.max_retries + 1}` : "not started";
  $("job-summary").textContent =
    `${job.backend} engine, ${job.ranks} rank(s), ${attempt}; step ${progress(job)}, ` +
    `${fixed(job.images_per_s, 1)} images/s, loss ${fixed(job.loss, 4)}; outputs ${job.outputs_dir}` +
    Object.entries(job.metrics || {}).map(([key, value]) => `; ${key} ${fixed(value, 4)}`).join("");
  $("job-cause").textContent = job.cause ? `${job.cause_words}: ${job.cause_detail || ""}` : "";
  $("cancel").hidden = !["QUEUED", "STAGING", "RUNNING", "RETRYING"].includes(job.state);
  $("cancel").onclick = () => cancelJob(job.id);

  const train = metrics.filter((m) => m.kind === "train");
  // A user script that reports no loss gets its first own metric charted instead.
  const charted = train.some((m) => m.loss != null) ? "loss" : Object.keys(job.metrics || {})[0] || "loss";
  $("loss-caption").textContent = charted === "loss" ? "training loss" : charted;
  const points = train.filter((m) => m[charted] != null).map((m) => [m.step, m[charted]]);
  const validations = metrics.filter((m) => m.kind === "val");
  const best = bestValidation(validations);
  const valLoss = charted === "loss" ? validations.filter((v) => v.loss != null).map((v) => [v.step, v.loss]) : [];
  drawChart(
    $("loss-chart"),
    [
      { points, colour: LINE_COLOURS.loss },
      { points: valLoss, colour: LINE_COLOURS.valLoss },
    ],
    best && best.step,
  );
  if (valLoss.length) $("loss-caption").textContent = "training loss (blue), validation loss (purple)";
  const rate = train.filter((m) => m.images_per_s != null).map((m) => [m.step, m.images_per_s]);
  drawChart($("rate-chart"), [{ points: rate, colour: LINE_COLOURS.rate }]);
  $("val-figure").hidden = validations.length === 0;
  if (best) {
    $("val-caption").textContent =
      `validation top-1 (green), top-5 (grey); best top-1 ${fixed(best.top1, 4)} at epoch ${best.epoch} (dashed)`;
    drawChart(
      $("val-chart"),
      [
        { points: validations.map((v) => [v.step, v.top5]), colour: LINE_COLOURS.top5 },
        { points: validations.map((v) => [v.step, v.top1]), colour: LINE_COLOURS.top1 },
      ],
      best.step,
    );
  }

  const body = $("ranks-table").tBodies[0];
  body.replaceChildren();
  for (const rank of job.ranks_health) {
    const row = body.insertRow();
    row.className = "rank";
    for (const value of [rank.rank, rank.host, rank.pid, rank.phase, rank.step, fixed(rank.images_per_s, 1)]) cell(row, value);
    cell(row, `${Math.round(rank.seconds_since_heartbeat)} s ago`);
    cell(row, rank.health, rank.health === "silent" ? "silent" : "");
  }

  for (let more = true; more; ) {
    const query = logCursor ? `?cursor=${encodeURIComponent(logCursor)}` : "";
    const chunk = await api(`/api/jobs/${id}/logs${query}`);
    logCursor = chunk.cursor;
    more = chunk.more;
    if (chunk.lines.length) {
      const log = $("log");
      const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
      log.textContent += chunk.lines.join("\n") + "\n";
      if (atBottom) log.scrollTop = log.scrollHeight;
    }
  }
}

async function renderSweeps() {
  const sweeps = await api("/api/sweeps");
  const body = $("sweeps-table").tBodies[0];
  body.replaceChildren();
  for (const sweep of sweeps) {
    const row = body.insertRow();
    row.className = "sweep";
    row.dataset.name = sweep.name;
    row.onclick = () => (location.hash = `#/sweeps/${encodeURIComponent(sweep.name)}`);
    cell(row, sweep.name);
    cell(row, `${sweep.metric} (${sweep.direction})`);
    for (const value of [sweep.trials, sweep.complete, sweep.pruned, sweep.running]) cell(row, value);
    cell(row, fixed(sweep.best_value, 4));
  }
  $("sweeps-empty").hidden = sweeps.length > 0;
}

async function renderSweep(name) {
  const sweep = await api(`/api/sweeps/${encodeURIComponent(name)}`);
  $("sweep-name").textContent = sweep.name;
  const best = sweep.rows.find((row) => row.state === "COMPLETE");
  $("sweep-summary").textContent =
    `${sweep.rows.length} trial(s), objective ${sweep.metric} (${sweep.direction})` +
    (best ? `; best: trial ${best.trial}, ${fixed(best.value, 4)}, outputs ${best.outputs}` : "");
  const numbers = Object.keys(sweep.curves).map(Number).sort((a, b) => a - b);
  drawChart(
    $("sweep-chart"),
    numbers.map((n) => ({ points: sweep.curves[n], colour: TRIAL_COLOURS[n % TRIAL_COLOURS.length] })),
  );
  $("sweep-caption").textContent =
    `${sweep.metric} per step, one line per trial (a pruned trial's ends where it was stopped): ` +
    numbers.map((n) => `trial ${n} ${TRIAL_COLOURS[n % TRIAL_COLOURS.length]}`).join(", ");
  const body = $("trials-table").tBodies[0];
  body.replaceChildren();
  for (const row of sweep.rows) {
    const tr = body.insertRow();
    tr.className = "trial";
    cell(tr, row.trial).style.color = TRIAL_COLOURS[row.trial % TRIAL_COLOURS.length];
    cell(tr, Object.entries(row.params).map(([key, value]) => `${key}=${value}`).join(", "));
    cell(tr, row.state, `state ${row.state}`);
    cell(tr, fixed(row.value, 4));
    cell(tr, row.reports);
    cell(tr, fixed(row.wall_s, 1));
    const job = cell(tr, row.job ? `${row.job} (${row.job_state || "?"})` : null);
    if (row.job) job.onclick = () => (location.hash = `#/jobs/${row.job}`);
  }
}

async function cancelJob(id) {
  if (!confirm(`Cancel job ${id}? Every process of it is stopped.`)) return;
  try {
    await api(`/api/jobs/${id}/cancel`, { method: "POST" });
  } catch (error) {
    $("error").textContent = `cancel refused: ${error.message}`;
  }
}

async function route() {
  clearTimeout(timer);
  $("error").textContent = "";
  if (!localStorage.getItem(TOKEN_KEY)) return show("login");
  const job = location.hash.match(/^#\/jobs\/([0-9a-f]+)$/);
  const sweep = location.hash.match(/^#\/sweeps\/(.+)$/);
  const [section, render, every] = job
    ? ["job", () => renderJob(job[1]), POLL_MS.job]
    : sweep
      ? ["sweep", () => renderSweep(decodeURIComponent(sweep[1])), POLL_MS.sweep]
      : location.hash === "#/sweeps"
        ? ["sweeps", renderSweeps, POLL_MS.sweeps]
        : ["jobs", renderJobs, POLL_MS.jobs];
  show(section);
  const tick = async () => {
    try {
      await render();
      $("error").textContent = "";
    } catch (error) {
      $("error").textContent = error.message;
    }
    if (localStorage.getItem(TOKEN_KEY)) timer = setTimeout(tick, every);
  };
  tick();
}

async function whoami() {
  try {
    const me = await api("/api/whoami");
    $("who").textContent = me.name ? `${me.name} (${me.scopes})` : "no authentication";
  } catch (error) {
    $("login-error").textContent = error.message;
  }
}

$("login-form").onsubmit = async (event) => {
  event.preventDefault();
  localStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("login-error").textContent = "";
  await whoami();
  route();
};
$("logout").onclick = () => {
  localStorage.removeItem(TOKEN_KEY);
  $("who").textContent = "";
  route();
};
window.addEventListener("hashchange", route);
(async () => {
  // A server started with --no-auth (loopback only) needs no token: skip the sign-in page.
  const health = await fetch("/api/health").then((r) => r.json());
  if (!health.auth && !localStorage.getItem(TOKEN_KEY)) localStorage.setItem(TOKEN_KEY, "none");
  if (localStorage.getItem(TOKEN_KEY)) whoami();
  route();
})();

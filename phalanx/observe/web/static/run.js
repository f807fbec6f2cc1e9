// One run, live: polls /api/runs/ID (every 2 s while it trains) and redraws with Plotly.react.
// The chart controls (x axis, smoothing, log scale) are query parameters: the server builds the figures.
"use strict";

(() => {
  const runId = document.querySelector("main").dataset.runId;
  const MAX_EVENT_ROWS = 300;
  let shownEvents = -1;
  let shownConfig = null;
  let shownAnnotations = null;
  let editing = false;

  function text(id, value) {
    document.getElementById(id).textContent = value;
  }

  function renderHeader(data) {
    const {run, now} = data;
    text("run-name", run.name);
    const status = document.getElementById("run-status");
    status.textContent = run.status;
    status.className = `status status-${run.status}`;
    text("run-model", run.model || "");
    text("run-updated", `updated ${phalanx.ago(run.updated_at, now)}`);
    const error = document.getElementById("run-error");
    error.textContent = run.error || "";
    error.hidden = !run.error;
    // tokens/s, MFU and TFLOP/s are the run's averages over its training time, from the runs row: the
    // figures of the training summary and `phalanx runs show` (the charts below are per step). Where
    // MFU cannot be known (a CPU has no peak FLOP/s in the table) the tile says so.
    const mfuNote = data.notes && data.notes.mfu;
    const tflops = run.achieved_tflops;
    const flopRate = tflops !== null && tflops !== undefined ? `${phalanx.number(tflops, 3)} TFLOP/s per device` : "";
    const cards = [
      ["step", phalanx.steps(run)], ["loss", phalanx.number(run.last_loss)],
      ["val loss", phalanx.number(run.last_val_loss)], ["tokens", phalanx.si(run.tokens_seen)],
      ["tokens/s", phalanx.rate(run.tokens_per_sec), "run average"],
      ["MFU", mfuNote ? "unknown" : phalanx.percent(run.mfu),
        mfuNote ? `${mfuNote}${flopRate ? `; ${flopRate}` : ""}` : flopRate || null],
      ["ETTR", phalanx.percent(run.ettr)], ["restarts", run.restarts],
      ["ranks", run.world_size], ["started", phalanx.localTime(run.started_at)],
      ["duration", phalanx.duration(phalanx.durationSeconds(run, now))],
    ];
    document.getElementById("cards").replaceChildren(...cards.map(([label, value, note]) => {
      const div = document.createElement("div");
      div.dataset.card = label;
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = label;
      dd.textContent = value === null || value === undefined ? "–" : String(value);
      div.append(dt, dd);
      if (note) {
        const small = document.createElement("small");
        small.className = "card-note";
        small.textContent = note;
        div.append(small);
      }
      return div;
    }));
  }

  function renderAnnotations(run) {
    const key = JSON.stringify([run.tags, run.note]);
    if (key === shownAnnotations || editing) return;  // never overwrite what the reader is typing
    shownAnnotations = key;
    const tags = document.getElementById("run-tags");
    tags.replaceChildren(...phalanx.tagChips(run.tags));
    text("run-note", run.note || "");
    if (!run.tags.length && !run.note) text("run-note", "no tags or note");
    document.getElementById("run-note").classList.toggle("muted", !run.note);
  }

  const form = document.getElementById("annotations-form");
  const view = document.getElementById("annotations-view");
  function edit(on, run) {
    editing = on;
    form.hidden = !on;
    view.hidden = on;
    text("annotations-error", "");
    if (on) {
      form.elements.tags.value = run.tags.join(", ");
      form.elements.note.value = run.note || "";
      form.elements.tags.focus();
    }
  }
  let current = null;
  document.getElementById("annotations-edit").addEventListener("click", () => current && edit(true, current));
  document.getElementById("annotations-cancel").addEventListener("click", () => edit(false));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const tags = form.elements.tags.value.split(",").map((t) => t.trim()).filter(Boolean);
    try {
      const saved = await phalanx.patchJson(`/api/runs/${runId}`, {tags, note: form.elements.note.value});
      current = {...current, ...saved};
      edit(false);
      shownAnnotations = null;
      renderAnnotations(current);
    } catch (error) {
      text("annotations-error", error.message);
    }
  });

  function details(event) {
    const rest = {};
    for (const [key, value] of Object.entries(event)) {
      if (!["time", "node", "rank", "kind"].includes(key)) rest[key] = value;
    }
    return rest;
  }

  function renderEvents(events, steps) {
    if (events.length === shownEvents) return;  // unchanged: keep the reader's selection and scroll
    shownEvents = events.length;
    const first = Math.max(0, events.length - MAX_EVENT_ROWS);
    const rows = [];
    for (let i = events.length - 1; i >= first; i--) {
      const event = events[i];
      const tr = document.createElement("tr");
      tr.className = `event-${event.kind}`;
      const cell = document.createElement("td");
      cell.className = "details";
      cell.append(phalanx.keyValues(details(event)));
      tr.append(phalanx.cell(phalanx.localTime(event.time), "when"), phalanx.cell(event.kind, "kind"),
        phalanx.cell(steps[i], "num"), phalanx.cell(event.rank, "num"), phalanx.cell(event.node), cell);
      rows.push(tr);
    }
    document.getElementById("events-body").replaceChildren(...rows);
    text("events-count", events.length > MAX_EVENT_ROWS
      ? `(newest ${MAX_EVENT_ROWS} of ${events.length})` : `(${events.length})`);
  }

  // Benchmark scores: a table per evaluated checkpoint (newest first), one row per task and metric with
  // the harness's standard error; a step evaluated twice has a table per report.
  let shownScores = null;
  function renderEvalScores(scores) {
    const key = JSON.stringify(scores);
    if (key === shownScores) return;
    shownScores = key;
    const reports = new Map();
    for (const row of scores) {
      if (!reports.has(row.report)) reports.set(row.report, []);
      reports.get(row.report).push(row);
    }
    const blocks = [...reports.values()].reverse().map((rows) => {
      const first = rows[0];
      const table = document.createElement("table");
      table.className = "grid eval-table";
      table.dataset.step = first.step;
      const caption = table.createCaption();
      const limit = first.limit ? `, at most ${first.limit} samples a task` : "";
      caption.textContent = `step ${first.step} · ${phalanx.localTime(first.time)}${limit}`;
      const head = table.createTHead().insertRow();
      for (const [label, cls] of [["task"], ["metric"], ["value", "num"], ["± stderr", "num"], ["samples", "num"]]) {
        const th = document.createElement("th");
        th.textContent = label;
        if (cls) th.className = cls;
        head.append(th);
      }
      const body = table.createTBody();
      for (const row of rows) {
        const tr = body.insertRow();
        tr.append(phalanx.cell(row.task), phalanx.cell(row.metric),
          phalanx.cell(row.value === null ? "–" : row.value.toFixed(4), "num"),
          phalanx.cell(row.stderr === null ? "" : `± ${row.stderr.toFixed(4)}`, "num"),
          phalanx.cell(row.samples, "num"));
      }
      return table;
    });
    document.getElementById("eval-tables").replaceChildren(...blocks);
    document.getElementById("eval").hidden = !blocks.length;
    text("eval-count", blocks.length ? `(${blocks.length} report${blocks.length > 1 ? "s" : ""})` : "");
  }

  function renderNodes(nodes) {
    document.getElementById("nodes").replaceChildren(...(nodes || []).map((node) => {
      const li = document.createElement("li");
      li.textContent = node;
      return li;
    }));
  }

  function renderSystemNote(hidden) {
    const reasons = new Set(Object.entries(hidden).filter(([name]) => name.startsWith("sys_")).map(([, r]) => r));
    text("system-note", [...reasons].join("; "));
  }

  const controls = phalanx.chartControls(() => refreshNow());

  async function refresh() {
    const query = controls.query();
    const data = await phalanx.getJson(`/api/runs/${runId}?${query}`);
    current = data.run;
    renderHeader(data);
    renderAnnotations(data.run);
    phalanx.plotAll(data.figures, data.hidden);
    renderSystemNote(data.hidden);
    renderEvents(data.events, data.event_steps);
    renderEvalScores(data.eval_scores || []);
    renderNodes(data.run.nodes);
    if (data.config_yaml !== shownConfig) {
      shownConfig = data.config_yaml;
      text("config", data.config_yaml || "(no config recorded)");
    }
    document.body.dataset.loaded = "true";  // for tests and screenshots: the first data is drawn
    document.body.dataset.drawn = query;  // ... and drawn for these options
    return phalanx.LIVE.includes(data.run.status) ? 2000 : 10000;
  }

  const refreshNow = phalanx.poll(refresh);
})();

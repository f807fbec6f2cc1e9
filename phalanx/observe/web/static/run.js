// One run, live: polls /api/runs/ID (every 2 s while it trains) and redraws with Plotly.react.
"use strict";

(() => {
  const runId = document.querySelector("main").dataset.runId;
  const MAX_EVENT_ROWS = 300;
  let shownEvents = -1;
  let shownConfig = null;

  function text(id, value) {
    document.getElementById(id).textContent = value;
  }

  function renderHeader(run, now) {
    text("run-name", run.name);
    const status = document.getElementById("run-status");
    status.textContent = run.status;
    status.className = `status status-${run.status}`;
    text("run-model", run.model || "");
    text("run-updated", `updated ${phalanx.ago(run.updated_at, now)}`);
    const error = document.getElementById("run-error");
    error.textContent = run.error || "";
    error.hidden = !run.error;
    const cards = [
      ["step", phalanx.steps(run)], ["loss", phalanx.number(run.last_loss)],
      ["val loss", phalanx.number(run.last_val_loss)], ["tokens/s", phalanx.rate(run.tokens_per_sec)],
      ["MFU", phalanx.percent(run.mfu)], ["ETTR", phalanx.percent(run.ettr)], ["restarts", run.restarts],
      ["ranks", run.world_size], ["started", phalanx.localTime(run.started_at)],
    ];
    document.getElementById("cards").replaceChildren(...cards.map(([label, value]) => {
      const div = document.createElement("div");
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = label;
      dd.textContent = value === null || value === undefined ? "–" : String(value);
      div.append(dt, dd);
      return div;
    }));
  }

  function details(event) {
    const rest = {};
    for (const [key, value] of Object.entries(event)) {
      if (!["time", "node", "rank", "kind"].includes(key)) rest[key] = value;
    }
    return Object.keys(rest).length ? JSON.stringify(rest) : "";
  }

  function renderEvents(events) {
    if (events.length === shownEvents) return;  // unchanged: keep the reader's selection and scroll
    shownEvents = events.length;
    const newest = events.slice(-MAX_EVENT_ROWS).reverse();
    document.getElementById("events-body").replaceChildren(...newest.map((event) => {
      const tr = document.createElement("tr");
      tr.className = `event-${event.kind}`;
      tr.append(phalanx.cell(phalanx.localTime(event.time), "when"), phalanx.cell(event.kind, "kind"),
        phalanx.cell(event.rank, "num"), phalanx.cell(event.node), phalanx.cell(details(event), "details"));
      return tr;
    }));
    text("events-count", events.length > MAX_EVENT_ROWS
      ? `(newest ${MAX_EVENT_ROWS} of ${events.length})` : `(${events.length})`);
  }

  function renderNodes(nodes) {
    document.getElementById("nodes").replaceChildren(...(nodes || []).map((node) => {
      const li = document.createElement("li");
      li.textContent = node;
      return li;
    }));
  }

  async function refresh() {
    const data = await phalanx.getJson(`/api/runs/${runId}`);
    renderHeader(data.run, data.now);
    for (const [name, figure] of Object.entries(data.figures)) phalanx.plot(`fig-${name}`, figure);
    renderEvents(data.events);
    renderNodes(data.run.nodes);
    if (data.config_yaml !== shownConfig) {
      shownConfig = data.config_yaml;
      text("config", data.config_yaml || "(no config recorded)");
    }
    document.body.dataset.loaded = "true";  // for tests and screenshots: the first data is drawn
    return ["running", "restarting"].includes(data.run.status) ? 2000 : 10000;
  }

  phalanx.poll(refresh);
})();

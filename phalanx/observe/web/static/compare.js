// Several runs side by side: their results, where their configs differ, and every training chart
// overlaid; refreshed every few seconds while any of them trains.
"use strict";

(() => {
  const ids = document.querySelector("main").dataset.ids;
  let shownDiff = null;

  function row(run, colour, now) {
    const tr = document.createElement("tr");
    const name = document.createElement("td");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = colour;  // the run's colour in every chart
    name.append(swatch);
    const link = document.createElement("a");
    link.href = `/runs/${run.id}`;
    link.textContent = `${run.name} (#${run.id})`;
    name.append(link);
    if (run.tags.length) {
      const tags = document.createElement("div");
      tags.className = "tags";
      tags.append(...phalanx.tagChips(run.tags));
      name.append(tags);
    }
    const status = document.createElement("td");
    status.append(phalanx.statusBadge(run.status));
    tr.append(name, status, phalanx.cell(run.model), phalanx.cell(phalanx.steps(run), "num"),
      phalanx.cell(phalanx.number(run.last_loss), "num"), phalanx.cell(phalanx.number(run.last_val_loss), "num"),
      phalanx.cell(phalanx.si(run.tokens_seen), "num"), phalanx.cell(phalanx.rate(run.tokens_per_sec), "num"),
      phalanx.cell(phalanx.percent(run.mfu), "num"), phalanx.cell(phalanx.percent(run.ettr), "num"),
      phalanx.cell(phalanx.duration(phalanx.durationSeconds(run, now)), "num"));
    return tr;
  }

  function value(v) {
    return v === null || v === undefined ? "–" : typeof v === "object" ? JSON.stringify(v) : String(v);
  }

  // One row per config key that differs, one column per run (as `phalanx runs compare` prints it).
  function renderDiff(runs, diff) {
    const key = JSON.stringify(diff);
    if (key === shownDiff) return;
    shownDiff = key;
    const head = document.createElement("tr");
    const corner = document.createElement("th");
    corner.textContent = "key";
    head.append(corner, ...runs.map((entry) => {
      const th = document.createElement("th");
      th.textContent = `${entry.run.name} (#${entry.run.id})`;
      return th;
    }));
    document.getElementById("diff-head").replaceChildren(head);
    document.getElementById("diff-body").replaceChildren(...diff.map((item) => {
      const tr = document.createElement("tr");
      tr.append(phalanx.cell(item.key, "key"), ...item.values.map((v) => phalanx.cell(value(v), "value")));
      return tr;
    }));
    document.getElementById("config-diff").hidden = diff.length === 0;
    document.getElementById("diff-none").hidden = diff.length > 0;
    document.getElementById("diff-count").textContent = `(${diff.length})`;
  }

  const controls = phalanx.chartControls(() => refreshNow());

  async function refresh() {
    const query = controls.query();
    const data = await phalanx.getJson(`/api/compare?ids=${encodeURIComponent(ids)}&${query}`);
    document.getElementById("compare-body").replaceChildren(...data.runs.map((entry) => row(entry.run, entry.colour, data.now)));
    renderDiff(data.runs, data.config_diff);
    phalanx.plotAll(data.figures, data.hidden);
    document.getElementById("hidden-note").textContent = Object.entries(data.hidden)
      .map(([name, reason]) => `${name === "mfu" ? "MFU" : "peak memory"}: ${reason}`).join("; ");
    document.body.dataset.loaded = "true";
    document.body.dataset.drawn = query;
    const live = data.runs.some((entry) => phalanx.LIVE.includes(entry.run.status));
    return live ? 3000 : 15000;
  }

  const refreshNow = phalanx.poll(refresh);
})();

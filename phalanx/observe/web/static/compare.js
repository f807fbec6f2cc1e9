// Several runs' loss curves overlaid; refreshed every few seconds while any of them trains.
"use strict";

(() => {
  const ids = document.querySelector("main").dataset.ids;

  function row(run) {
    const tr = document.createElement("tr");
    const name = document.createElement("td");
    const link = document.createElement("a");
    link.href = `/runs/${run.id}`;
    link.textContent = `${run.name} (#${run.id})`;
    name.append(link);
    const status = document.createElement("td");
    status.append(phalanx.statusBadge(run.status));
    tr.append(name, status, phalanx.cell(run.model), phalanx.cell(phalanx.steps(run), "num"),
      phalanx.cell(phalanx.number(run.last_loss), "num"), phalanx.cell(phalanx.number(run.last_val_loss), "num"),
      phalanx.cell(phalanx.rate(run.tokens_per_sec), "num"), phalanx.cell(phalanx.percent(run.ettr), "num"));
    return tr;
  }

  async function refresh() {
    const data = await phalanx.getJson(`/api/compare?ids=${encodeURIComponent(ids)}`);
    document.getElementById("compare-body").replaceChildren(...data.runs.map((entry) => row(entry.run)));
    for (const [name, figure] of Object.entries(data.figures)) phalanx.plot(`fig-${name}`, figure);
    document.body.dataset.loaded = "true";
    const live = data.runs.some((entry) => ["running", "restarting"].includes(entry.run.status));
    return live ? 3000 : 15000;
  }

  phalanx.poll(refresh);
})();

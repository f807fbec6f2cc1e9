// The runs list: refreshed every few seconds; the ticked rows survive refreshes.
"use strict";

(() => {
  const STALE_S = 120;
  const selected = new Set();
  const body = document.getElementById("runs-body");
  const compare = document.getElementById("compare");

  function updateButton() {
    compare.disabled = selected.size < 2;
    compare.textContent = selected.size ? `Compare selected (${selected.size})` : "Compare selected";
  }

  compare.addEventListener("click", () => {
    location.assign(`/compare?ids=${[...selected].sort((a, b) => a - b).join(",")}`);
  });

  function row(run, now) {
    const tr = document.createElement("tr");
    tr.dataset.runId = run.id;
    const pick = document.createElement("td");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.checked = selected.has(run.id);
    box.setAttribute("aria-label", `select run ${run.name}`);
    box.addEventListener("change", () => {
      box.checked ? selected.add(run.id) : selected.delete(run.id);
      updateButton();
    });
    pick.append(box);
    const name = document.createElement("td");
    const link = document.createElement("a");
    link.href = `/runs/${run.id}`;
    link.textContent = run.name;
    name.append(link);
    const status = document.createElement("td");
    status.append(phalanx.statusBadge(run.status));
    if (run.error) status.title = run.error;
    const updated = phalanx.cell(phalanx.ago(run.updated_at, now), "when");
    // A live run whose node agent stopped reporting (killed, its machine lost) still reads "running".
    if (["running", "restarting"].includes(run.status) && now - run.updated_at > STALE_S) {
      updated.classList.add("stale");
      updated.title = "no update for a while: is the node agent still alive?";
    }
    tr.append(pick, name, status, phalanx.cell(run.model),
      phalanx.cell(phalanx.steps(run), "num"), phalanx.cell(phalanx.number(run.last_loss), "num"),
      phalanx.cell(phalanx.rate(run.tokens_per_sec), "num"), phalanx.cell(phalanx.percent(run.mfu), "num"),
      phalanx.cell(phalanx.percent(run.ettr), "num"), phalanx.cell(run.restarts, "num"), updated);
    return tr;
  }

  async function refresh() {
    const data = await phalanx.getJson("/api/runs");
    const ids = new Set(data.runs.map((run) => run.id));
    for (const id of [...selected]) if (!ids.has(id)) selected.delete(id);
    body.replaceChildren(...data.runs.map((run) => row(run, data.now)));
    document.getElementById("runs-empty").hidden = data.runs.length > 0;
    updateButton();
    return 3000;
  }

  phalanx.poll(refresh);
})();

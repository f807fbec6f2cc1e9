// The runs list: refreshed every few seconds; sorted by a clicked column, filtered by status and a
// search (words match name, model, status, tags and note; tag:NAME one tag). The ticked rows, the sort
// and the filter survive refreshes; sort and filter are also in the URL, so a link keeps them.
"use strict";

(() => {
  const STALE_S = 120;
  const selected = new Set();
  const body = document.getElementById("runs-body");
  const compare = document.getElementById("compare");
  const search = document.getElementById("search");
  const statusFilter = document.getElementById("status-filter");
  const params = new URLSearchParams(location.search);
  let sort = {key: params.get("sort") || "started", desc: params.get("order") !== "asc"};
  let last = null;  // the newest answer, redrawn at once when the sort or filter changes

  search.value = params.get("q") || "";
  statusFilter.value = params.get("status") || "";

  // What each sortable column sorts by; null sorts last in either direction.
  const SORT_KEYS = {
    name: (r) => r.name.toLowerCase(), status: (r) => r.status, model: (r) => (r.model || "").toLowerCase(),
    step: (r) => r.last_step, loss: (r) => r.last_loss, val_loss: (r) => r.last_val_loss,
    tokens: (r) => r.tokens_seen, tokens_per_sec: (r) => r.tokens_per_sec, mfu: (r) => r.mfu,
    ettr: (r) => r.ettr, restarts: (r) => r.restarts, started: (r) => r.started_at,
    duration: (r, now) => phalanx.durationSeconds(r, now), updated: (r) => r.updated_at,
  };

  function updateButton() {
    compare.disabled = selected.size < 2;
    compare.textContent = selected.size ? `Compare selected (${selected.size})` : "Compare selected";
  }

  compare.addEventListener("click", () => {
    location.assign(`/compare?ids=${[...selected].sort((a, b) => a - b).join(",")}`);
  });

  function remember() {
    const next = new URLSearchParams();
    if (search.value.trim()) next.set("q", search.value.trim());
    if (statusFilter.value) next.set("status", statusFilter.value);
    if (sort.key !== "started" || !sort.desc) {
      next.set("sort", sort.key);
      next.set("order", sort.desc ? "desc" : "asc");
    }
    const query = next.toString();
    history.replaceState(null, "", query ? `/?${query}` : "/");
  }

  function showTag(tag) {
    search.value = `tag:${tag}`;
    remember();
    render();
  }

  function matches(run) {
    const status = statusFilter.value;
    if (status === "live" ? !phalanx.LIVE.includes(run.status) : status && run.status !== status) return false;
    const tags = run.tags.map((t) => t.toLowerCase());
    const haystack = [run.name, run.model || "", run.status, run.note || "", ...tags].join("\n").toLowerCase();
    return search.value.toLowerCase().split(/\s+/).filter(Boolean).every((word) =>
      word.startsWith("tag:") ? tags.includes(word.slice(4)) : haystack.includes(word));
  }

  function compareRuns(a, b, now) {
    const key = SORT_KEYS[sort.key] || SORT_KEYS.started;
    const x = key(a, now), y = key(b, now);
    if (x === null || x === undefined) return y === null || y === undefined ? 0 : 1;
    if (y === null || y === undefined) return -1;
    const order = x < y ? -1 : x > y ? 1 : 0;
    return sort.desc ? -order : order;
  }

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
    name.className = "name";
    const link = document.createElement("a");
    link.href = `/runs/${run.id}`;
    link.textContent = run.name;
    name.append(link);
    if (run.tags.length) {
      const tags = document.createElement("div");
      tags.className = "tags";
      tags.append(...phalanx.tagChips(run.tags, showTag));
      name.append(tags);
    }
    if (run.note) {
      const note = document.createElement("div");
      note.className = "note muted";
      note.textContent = run.note;
      note.title = run.note;
      name.append(note);
    }
    const status = document.createElement("td");
    status.append(phalanx.statusBadge(run.status));
    if (run.error) status.title = run.error;
    const updated = phalanx.cell(phalanx.ago(run.updated_at, now), "when");
    // A live run whose node agent stopped reporting (killed, its machine lost) still reads "running".
    if (phalanx.LIVE.includes(run.status) && now - run.updated_at > STALE_S) {
      updated.classList.add("stale");
      updated.title = "no update for a while: is the node agent still alive?";
    }
    tr.append(pick, name, status, phalanx.cell(run.model, "model"),
      phalanx.cell(phalanx.steps(run), "num"), phalanx.cell(phalanx.number(run.last_loss), "num"),
      phalanx.cell(phalanx.number(run.last_val_loss), "num"), phalanx.cell(phalanx.si(run.tokens_seen), "num"),
      phalanx.cell(phalanx.rate(run.tokens_per_sec), "num"), phalanx.cell(phalanx.percent(run.mfu), "num"),
      phalanx.cell(phalanx.percent(run.ettr), "num"), phalanx.cell(run.restarts, "num"),
      phalanx.cell(phalanx.localTime(run.started_at), "when"),
      phalanx.cell(phalanx.duration(phalanx.durationSeconds(run, now)), "num"), updated);
    return tr;
  }

  function render() {
    if (!last) return;
    const shown = last.runs.filter(matches).sort((a, b) => compareRuns(a, b, last.now));
    body.replaceChildren(...shown.map((run) => row(run, last.now)));
    document.getElementById("runs-empty").hidden = last.runs.length > 0;
    document.getElementById("runs-none-match").hidden = !last.runs.length || shown.length > 0;
    document.getElementById("runs-count").textContent = shown.length === last.runs.length
      ? `(${last.runs.length})` : `(${shown.length} of ${last.runs.length})`;
    for (const th of document.querySelectorAll("th.sortable")) {
      const active = th.dataset.sort === sort.key;
      th.classList.toggle("sorted", active);
      th.setAttribute("aria-sort", active ? (sort.desc ? "descending" : "ascending") : "none");
    }
    updateButton();
  }

  for (const th of document.querySelectorAll("th.sortable")) {
    th.tabIndex = 0;
    const choose = () => {
      // A new column starts with the order most wanted first: names A-Z, numbers and times largest first.
      sort = sort.key === th.dataset.sort ? {key: sort.key, desc: !sort.desc}
        : {key: th.dataset.sort, desc: !["name", "model", "status"].includes(th.dataset.sort)};
      remember();
      render();
    };
    th.addEventListener("click", choose);
    th.addEventListener("keydown", (event) => { if (event.key === "Enter") choose(); });
  }
  search.addEventListener("input", () => { remember(); render(); });
  statusFilter.addEventListener("change", () => { remember(); render(); });
  document.getElementById("filters").addEventListener("submit", (event) => event.preventDefault());

  async function refresh() {
    const data = await phalanx.getJson("/api/runs");
    const ids = new Set(data.runs.map((run) => run.id));
    for (const id of [...selected]) if (!ids.has(id)) selected.delete(id);
    last = data;
    render();
    document.body.dataset.loaded = "true";
    return 3000;
  }

  phalanx.poll(refresh);
})();

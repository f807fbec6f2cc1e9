// Shared by the dashboard's pages: fetching the JSON API, polling, chart controls, and formatting.
// Text from runs only ever reaches the page through textContent; figures come built from the server.
"use strict";

const phalanx = (() => {
  const PLOT_CONFIG = {responsive: true, displaylogo: false};
  const CHART_DEFAULTS = {x: "step", smooth: 0, log: false};
  const CHART_STORAGE = "phalanx.chart-options";

  async function request(url, options = {}) {
    const response = await fetch(url, {credentials: "same-origin", ...options,
      headers: {Accept: "application/json", ...(options.headers || {})}});
    if (response.status === 401) {  // the session cookie went away: log in again, then come back here
      location.assign("/login?next=" + encodeURIComponent(location.pathname + location.search));
      throw new Error("login required");
    }
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || response.statusText);
    return body;
  }

  const getJson = (url) => request(url);

  // PATCH with a JSON body (the only kind of write the dashboard takes: a run's tags and note).
  const patchJson = (url, body) => request(url, {method: "PATCH", body: JSON.stringify(body),
    headers: {"Content-Type": "application/json"}});

  function banner(message) {
    const el = document.getElementById("banner");
    el.textContent = message || "";
    el.hidden = !message;
  }

  // Calls refresh() now and again after the delay (ms) it returns; an error shows a banner and retries.
  // Returns a function that refreshes at once (after a control changed), still one request at a time.
  function poll(refresh) {
    let timer = null, running = false, again = false;
    async function tick() {
      clearTimeout(timer);
      if (running) {
        again = true;
        return;
      }
      running = true;
      let delay = 5000;
      try {
        delay = await refresh();
        banner("");
      } catch (error) {
        banner(`Cannot update: ${error.message}. Retrying...`);
      }
      running = false;
      if (again) {
        again = false;
        tick();
      } else {
        timer = setTimeout(tick, delay);
      }
    }
    tick();
    return tick;
  }

  // Draws each figure in its element (fig-NAME); charts the server left out (hidden: {name: reason})
  // are hidden rather than drawn empty.
  function plotAll(figures, hidden = {}) {
    for (const [name, figure] of Object.entries(figures)) {
      const el = document.getElementById(`fig-${name}`);
      if (!el) continue;
      el.hidden = name in hidden;
      if (!el.hidden) Plotly.react(el, figure.data, figure.layout, PLOT_CONFIG);
    }
  }

  // The x axis / smoothing / log-scale controls: state in the page's URL (a link keeps the view),
  // remembered for the next page. onChange(options) runs after each change.
  function chartControls(onChange) {
    const form = document.getElementById("chart-controls");
    const params = new URLSearchParams(location.search);
    let saved = {};
    try {
      saved = JSON.parse(localStorage.getItem(CHART_STORAGE) || "{}");
    } catch (error) {
      saved = {};
    }
    const options = {...CHART_DEFAULTS, ...saved};
    if (params.has("x")) options.x = params.get("x");
    if (params.has("smooth")) options.smooth = Number(params.get("smooth")) || 0;
    if (params.has("log")) options.log = params.get("log") === "1";
    if (!["step", "tokens", "time"].includes(options.x)) options.x = "step";
    options.smooth = Math.min(0.99, Math.max(0, Number(options.smooth) || 0));

    const smooth = form.elements.smooth, smoothValue = document.getElementById("smooth-value");
    form.elements.x.value = options.x;
    smooth.value = options.smooth;
    smoothValue.textContent = Number(options.smooth).toFixed(2);
    form.elements.log.checked = options.log;

    let debounce = null;
    function changed() {
      options.x = form.elements.x.value;
      options.smooth = Number(smooth.value);
      options.log = form.elements.log.checked;
      smoothValue.textContent = options.smooth.toFixed(2);
      try {
        localStorage.setItem(CHART_STORAGE, JSON.stringify(options));
      } catch (error) { /* private mode: the URL still keeps it */ }
      const next = new URLSearchParams(location.search);
      next.set("x", options.x);
      next.set("smooth", String(options.smooth));
      next.set("log", options.log ? "1" : "0");
      history.replaceState(null, "", `${location.pathname}?${next}`);
      clearTimeout(debounce);
      debounce = setTimeout(() => onChange(options), 120);  // a dragged slider asks once it settles
    }
    form.addEventListener("input", changed);
    form.addEventListener("change", changed);
    form.addEventListener("submit", (event) => event.preventDefault());
    return {
      query: () => `x=${encodeURIComponent(options.x)}&smooth=${options.smooth}&log=${options.log ? 1 : 0}`,
    };
  }

  function cell(text, className) {
    const td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "–" : String(text);
    if (className) td.className = className;
    return td;
  }

  function statusBadge(status) {
    const span = document.createElement("span");
    span.className = `status status-${status}`;
    span.textContent = status;
    return span;
  }

  function tagChips(tags, onClick) {
    return (tags || []).map((tag) => {
      const chip = document.createElement(onClick ? "button" : "span");
      chip.className = "tag";
      chip.textContent = tag;
      if (onClick) {
        chip.type = "button";
        chip.title = `show runs tagged ${tag}`;
        chip.addEventListener("click", () => onClick(tag));
      }
      return chip;
    });
  }

  // An event's details as key/value pairs; nested values (the ranks of a failure) as compact JSON.
  function keyValues(details) {
    const dl = document.createElement("dl");
    dl.className = "kv";
    for (const [key, value] of Object.entries(details)) {
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = key;
      // Durations and the like to 6 significant digits: 0.186652, not 0.18665176580007874.
      dd.textContent = value === null || value === undefined ? "–"
        : typeof value === "number" && !Number.isInteger(value) ? String(Number(value.toPrecision(6)))
          : typeof value === "object" ? JSON.stringify(value) : String(value);
      dl.append(dt, dd);
    }
    return dl;
  }

  function number(value, digits = 4) {
    return value === null || value === undefined ? "–" : Number(value).toPrecision(digits);
  }

  function rate(value) {
    return value === null || value === undefined ? "–" : Math.round(value).toLocaleString("en");
  }

  // 1234567 -> "1.23M": token counts.
  function si(value) {
    if (value === null || value === undefined) return "–";
    const units = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (const [size, unit] of units) if (Math.abs(value) >= size) return `${(value / size).toPrecision(3)}${unit}`;
    return String(Math.round(value));
  }

  function percent(value) {
    return value === null || value === undefined ? "–" : `${(100 * value).toFixed(1)}%`;
  }

  function steps(run) {
    const last = run.last_step === null ? "–" : run.last_step;
    return run.max_steps ? `${last}/${run.max_steps}` : String(last);
  }

  const LIVE = ["running", "restarting"];

  // Wall time from the run's first start to its end (or, while it trains, to now).
  function durationSeconds(run, now) {
    if (!run.started_at) return null;
    const end = run.ended_at || (LIVE.includes(run.status) ? now : run.updated_at);
    return Math.max(0, end - run.started_at);
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    if (seconds < 60) return `${Math.round(seconds)} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
    if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
    return `${(seconds / 86400).toFixed(1)} d`;
  }

  // How long ago, by the server's clock (the browser's may differ).
  function ago(then, now) {
    if (!then) return "–";
    const s = Math.max(0, now - then);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
    return `${(s / 86400).toFixed(1)} d ago`;
  }

  function localTime(unixSeconds) {
    return unixSeconds ? new Date(unixSeconds * 1000).toLocaleString() : "–";
  }

  return {getJson, patchJson, banner, poll, plotAll, chartControls, cell, statusBadge, tagChips, keyValues,
    number, rate, si, percent, steps, LIVE, durationSeconds, duration, ago, localTime};
})();

// Shared by the dashboard's pages: fetching the JSON API, polling, and formatting.
// Text from runs only ever reaches the page through textContent; figures come built from the server.
"use strict";

const phalanx = (() => {
  const PLOT_CONFIG = {responsive: true, displaylogo: false};

  async function getJson(url) {
    const response = await fetch(url, {headers: {Accept: "application/json"}, credentials: "same-origin"});
    if (response.status === 401) {  // the session cookie went away: log in again, then come back here
      location.assign("/login?next=" + encodeURIComponent(location.pathname + location.search));
      throw new Error("login required");
    }
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || response.statusText);
    return body;
  }

  function banner(message) {
    const el = document.getElementById("banner");
    el.textContent = message || "";
    el.hidden = !message;
  }

  // Calls refresh() now and again after the delay (ms) it returns; an error shows a banner and retries.
  function poll(refresh) {
    async function tick() {
      let delay = 5000;
      try {
        delay = await refresh();
        banner("");
      } catch (error) {
        banner(`Cannot update: ${error.message}. Retrying...`);
      }
      setTimeout(tick, delay);
    }
    tick();
  }

  function plot(id, figure) {
    const el = document.getElementById(id);
    if (el) Plotly.react(el, figure.data, figure.layout, PLOT_CONFIG);
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

  function number(value, digits = 4) {
    return value === null || value === undefined ? "–" : Number(value).toPrecision(digits);
  }

  function rate(value) {
    return value === null || value === undefined ? "–" : Math.round(value).toLocaleString("en");
  }

  function percent(value) {
    return value === null || value === undefined ? "–" : `${(100 * value).toFixed(1)}%`;
  }

  function steps(run) {
    const last = run.last_step === null ? "–" : run.last_step;
    return run.max_steps ? `${last}/${run.max_steps}` : String(last);
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
    return new Date(unixSeconds * 1000).toLocaleString();
  }

  return {getJson, banner, poll, plot, cell, statusBadge, number, rate, percent, steps, ago, localTime};
})();

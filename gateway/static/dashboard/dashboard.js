// The live dashboard: an EventSource on /dashboard/events gives the last 15 minutes at once
// ("init") and then one point a second ("point"); every chart and number is drawn from those.
// No build step: plain browser JavaScript and the vendored uPlot.
"use strict";

(function () {
  const HISTORY_POINTS = 15 * 60;
  const RATIO_WINDOW = 10; // points (seconds) the displayed rejection ratio is taken over
  const COLORS = { allowed: "#2e7d32", delayed: "#e0a100", rejected: "#c62828", ratio: "#6a1b9a" };

  // Exposed for tests and the curious: the history, the charts and how often we drew.
  const dash = { history: [], state: null, limits: {}, updates: 0, lastUpdate: null };
  window.gatewayDashboard = dash;

  const $ = (id) => document.getElementById(id);
  const fmt = (n, digits) =>
    n === null || n === undefined || Number.isNaN(n) ? "—" : Number(n).toFixed(digits);
  const fmtInt = (n) => (n === null || n === undefined ? "—" : Number(n).toLocaleString("en"));
  const fmtSeconds = (s) =>
    s === null || s === undefined ? "—" : s < 1 ? (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms" : s.toFixed(2) + " s";
  const fmtWait = (p50, p99) =>
    p50 === null || p50 === undefined
      ? "—"
      : p99 < 1
        ? (p50 * 1000).toFixed(p50 < 0.01 ? 1 : 0) + " / " + fmtSeconds(p99)
        : fmtSeconds(p50) + " / " + fmtSeconds(p99);
  const clock = uPlot.fmtDate("{HH}:{mm}:{ss}");
  // Ticks on whole seconds (the labels have a resolution of one second), minutes past 2 min.
  const timeAxis = {
    incrs: [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900],
    values: (u, splits) => splits.map((v) => clock(new Date(v * 1000))),
  };
  const fmtPercent = (r) => (r === null || r === undefined ? "—" : (r * 100).toFixed(1) + "%");

  function chartWidth(el) {
    return Math.max(240, Math.floor(el.getBoundingClientRect().width));
  }

  function makeLimit(name, info) {
    const node = $("limit-template").content.firstElementChild.cloneNode(true);
    node.id = "limit-" + name;
    node.dataset.limit = name;
    node.querySelector(".name").textContent = name;
    node.querySelector(".algorithm").textContent = info.algorithm;
    const dry = info.dry_run;
    node.querySelector(".badge.dry").hidden = !dry;
    node.classList.toggle("dry-run", dry);
    for (const label of node.querySelectorAll(".rejected-label")) {
      label.textContent = dry ? "would reject" + (label.classList.contains("label") ? "/s" : "") : label.textContent;
    }
    $("limits").appendChild(node);

    const ratesEl = node.querySelector(".chart.rates");
    const ratioEl = node.querySelector(".chart.ratio");
    const dash_ = dry ? [6, 4] : undefined;
    const rates = new uPlot(
      {
        width: chartWidth(ratesEl),
        height: 200,
        scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
        series: [
          {},
          { label: "admitted/s", stroke: COLORS.allowed, width: 1.5 },
          { label: dry ? "would delay/s" : "delayed/s", stroke: COLORS.delayed, width: 1.5, dash: dash_ },
          { label: dry ? "would reject/s" : "rejected/s", stroke: COLORS.rejected, width: 2, dash: dash_ },
        ],
        axes: [timeAxis, { size: 50 }],
      },
      [[], [], [], []],
      ratesEl
    );
    const ratio = new uPlot(
      {
        width: chartWidth(ratioEl),
        height: 200,
        scales: { x: { time: true }, y: { range: [0, 1] } },
        series: [
          {},
          {
            label: dry ? "would-reject ratio" : "rejection ratio",
            stroke: COLORS.ratio,
            width: 2,
            dash: dash_,
            value: (u, v) => fmtPercent(v),
          },
        ],
        axes: [timeAxis, { size: 50, values: (u, ticks) => ticks.map((t) => Math.round(t * 100) + "%") }],
      },
      [[], []],
      ratioEl
    );
    return { node, rates, ratio, dryRun: dry };
  }

  function seriesFor(name, dryRun) {
    const x = [], allowed = [], delayed = [], rejected = [], ratio = [];
    for (const point of dash.history) {
      const lim = point.limits[name];
      x.push(point.t);
      if (!lim) {
        allowed.push(null); delayed.push(null); rejected.push(null); ratio.push(null);
        continue;
      }
      allowed.push(lim.allowed);
      delayed.push(dryRun ? lim.dry_run_delayed : lim.delayed);
      rejected.push(dryRun ? lim.dry_run_rejected : lim.rejected);
      ratio.push(lim.ratio);
    }
    return { x, allowed, delayed, rejected, ratio };
  }

  // Rejected over all decisions in the last RATIO_WINDOW points (each point is a 1 s rate).
  function recentRatio(name, dryRun) {
    let refused = 0, total = 0;
    for (const point of dash.history.slice(-RATIO_WINDOW)) {
      const lim = point.limits[name];
      if (!lim) continue;
      // Points hold rates over their own dt seconds (1 s, longer on a busy machine): counts
      // are rate x dt, or a point that lasted longer would weigh less than its requests.
      const dt = point.dt || 1;
      const r = dryRun ? lim.dry_run_rejected : lim.rejected;
      refused += r * dt;
      total += (lim.allowed + (dryRun ? lim.dry_run_delayed : lim.delayed) + r) * dt;
    }
    return total > 0 ? refused / total : null;
  }

  function setField(node, field, text) {
    const el = node.querySelector('[data-field="' + field + '"]');
    if (el) el.textContent = text;
  }

  function renderHeader(state) {
    const last = dash.history[dash.history.length - 1];
    $("requests-rate").textContent = last ? fmt(last.requests, 1) : "—";
    $("requests-total").textContent = fmtInt(state.requests);
    $("workers").textContent = state.workers + (state.worker_ids.length ? " (" + state.worker_ids.join(", ") + ")" : "");
    const store = $("store");
    store.textContent = state.store.name + (state.store.state !== "ok" ? ": " + state.store.state : "");
    store.dataset.state = state.store.state;
    store.title = "calls " + state.store.calls + ", errors " + state.store.errors;
    const policy = $("policy");
    policy.textContent = state.policy.sha256.map((s) => s.slice(0, 12)).join(" / ");
    policy.title = state.policy.source + "\n" + state.policy.sha256.join("\n");
    const reload = $("reload");
    if (state.reload) {
      const r = state.reload;
      const when = r.last_attempt_at ? new Date(r.last_attempt_at * 1000).toLocaleTimeString() : "";
      reload.textContent = r.last_result + (when ? " at " + when : "") + " (" + r.succeeded + " ok, " + r.failed + " failed)";
      reload.dataset.result = r.last_result;
      reload.title = r.last_error || "";
    } else {
      reload.textContent = "no policy file";
    }
  }

  function renderLimit(name, info) {
    let view = dash.limits[name];
    if (view && view.dryRun !== info.dry_run) {
      view.node.remove();
      view = null;
    }
    if (!view) view = dash.limits[name] = makeLimit(name, info);
    const { node, dryRun } = view;
    const last = dash.history.length ? dash.history[dash.history.length - 1].limits[name] : null;
    setField(node, "allowed-rate", last ? fmt(last.allowed, 1) : "—");
    setField(node, "delayed-rate", last ? fmt(dryRun ? last.dry_run_delayed : last.delayed, 1) : "—");
    setField(node, "rejected-rate", last ? fmt(dryRun ? last.dry_run_rejected : last.rejected, 1) : "—");
    setField(node, "ratio", fmtPercent(recentRatio(name, dryRun)));
    setField(node, "waiting", fmtInt(info.waiting));
    setField(node, "wait", last ? fmtWait(last.wait_p50, last.wait_p99) : "—");
    setField(node, "allowed-total", fmtInt(info.allowed));
    setField(node, "delayed-total", fmtInt(dryRun ? info.dry_run_delayed : info.delayed));
    setField(node, "rejected-total", fmtInt(dryRun ? info.dry_run_rejected : info.rejected));
    setField(node, "tracked-keys", fmtInt(info.tracked_keys));
    setField(node, "evictions", fmtInt(info.evictions));
    const lease = info.lease;
    node.querySelector(".lease").hidden = !lease;
    if (lease) {
      setField(node, "lease-granted", fmtInt(lease.granted));
      setField(node, "lease-size", fmtInt(lease.last_size));
      setField(node, "lease-returned", fmtInt(lease.returned));
      setField(node, "lease-expired", fmtInt(lease.expired));
      const decided = info.allowed + info.rejected;
      setField(node, "lease-calls", decided ? fmt(lease.calls / decided, 4) : "—");
    }

    const tbody = node.querySelector(".top tbody");
    tbody.replaceChildren(
      ...info.top_keys.map((hitter) => {
        const row = document.createElement("tr");
        // Key parts are joined by U+001F; a key of constant parts only ([global]) is empty.
        const key = hitter.key ? hitter.key.split("\u001f").map(keyPart).join(" · ") : "(all clients)";
        for (const text of [key, fmtInt(hitter.count), fmtInt(hitter.error)]) {
          const cell = document.createElement("td");
          cell.textContent = text;
          row.appendChild(cell);
        }
        return row;
      })
    );
    const none = node.querySelector(".top .none");
    none.hidden = info.top_keys.length > 0;
    // A dry-run limit's view holds the keys it would have rejected.
    none.textContent = dryRun ? "no key would have been limited lately" : "no key limited lately";
    const summary = node.querySelector(".top summary");
    summary.textContent = dryRun
      ? "keys it would have limited, last 1–2 minutes"
      : "top limited keys, last 1–2 minutes";

    const s = seriesFor(name, dryRun);
    view.rates.setData([s.x, s.allowed, s.delayed, s.rejected]);
    view.ratio.setData([s.x, s.ratio]);
  }

  function renderServers(upstreams) {
    const names = Object.keys(upstreams || {});
    $("servers").hidden = names.length === 0;
    const pools = $("server-pools");
    pools.textContent = "";
    for (const name of names) {
      const row = document.createElement("div");
      row.className = "pool";
      row.dataset.upstream = name;
      const label = document.createElement("span");
      label.className = "upstream";
      label.textContent = name;
      row.appendChild(label);
      for (const server of upstreams[name]) {
        const chip = document.createElement("span");
        chip.className = "server";
        chip.dataset.state = server.state;
        chip.textContent = server.server + " " + server.state;
        chip.title = "weight " + server.weight + (server.backup ? " (backup)" : "") +
          ", in flight " + server.inflight + ", requests " + server.requests +
          ", failures " + server.failures + ", ejections " + server.ejections +
          ", workers by state " + JSON.stringify(server.states);
        row.appendChild(chip);
      }
      pools.appendChild(row);
    }
  }

  function render(state) {
    dash.state = state;
    renderHeader(state);
    renderServers(state.upstreams);
    const names = Object.keys(state.limits);
    for (const name of names) renderLimit(name, state.limits[name]);
    for (const name of Object.keys(dash.limits)) {
      if (!(name in state.limits)) {
        dash.limits[name].node.remove();
        delete dash.limits[name];
      }
    }
    $("no-limits").hidden = names.length > 0;
    dash.updates += 1;
    dash.lastUpdate = Date.now();
    document.body.dataset.updates = String(dash.updates);
  }

  function connect() {
    const live = $("live");
    const events = new EventSource("/dashboard/events");
    events.addEventListener("init", (e) => {
      const message = JSON.parse(e.data);
      dash.history = message.history;
      render(message.state);
    });
    events.addEventListener("point", (e) => {
      const message = JSON.parse(e.data);
      dash.history.push(message.point);
      if (dash.history.length > HISTORY_POINTS) dash.history.splice(0, dash.history.length - HISTORY_POINTS);
      render(message.state);
    });
    events.onopen = () => { live.textContent = "live"; live.dataset.state = "live"; };
    // EventSource reconnects by itself; the next "init" redraws everything.
    events.onerror = () => { live.textContent = "reconnecting…"; live.dataset.state = "lost"; };
  }

  window.addEventListener("resize", () => {
    for (const view of Object.values(dash.limits)) {
      for (const chart of [view.rates, view.ratio]) {
        chart.setSize({ width: chartWidth(chart.root.parentElement), height: 200 });
      }
    }
  });

  connect();
})();

// A part tagged U+001E (gateway/keys.py): "ip" + the client IP standing in for a missing
// header or query value, or "x" + the hex of a value that held a separator.
function keyPart(part) {
  if (!part.startsWith("\u001e")) return part;
  if (part.startsWith("\u001eip")) return `${part.slice(3)} (no key: client IP)`;
  return `hex:${part.slice(2)}`;
}

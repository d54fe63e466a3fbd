// The live dashboard. The page carries its first data (history and state) in
// #initial-data, so it is drawn at load; an EventSource on /dashboard/events then gives the
// history again ("init", on every reconnect) and one point a second ("point").
// No build step: plain browser JavaScript and the vendored uPlot.
"use strict";

(function () {
  const HISTORY_POINTS = 15 * 60;
  const RATIO_WINDOW = 10; // points (seconds) the displayed rejection ratios are taken over
  const FAILING_S = 60; // an upstream that failed this recently is shown as failing
  const CHART_HEIGHT = 160;
  const COLORS = { allowed: "#2e7d32", delayed: "#e0a100", rejected: "#c62828", ratio: "#6a1b9a" };

  // Exposed for tests and the curious: the history, the charts and how often we drew.
  const dash = { history: [], state: null, limits: {}, adaptive: {}, updates: 0, lastUpdate: null, range: 300 };
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
  const fmtPercent = (r) => (r === null || r === undefined ? "—" : (r * 100).toFixed(1) + "%");
  const fmtRange = (s) => (s < 60 ? s + " s" : s / 60 + " min");
  // Every time on the page in one format, 24-hour (the locale's could be 12-hour, beside
  // the charts' axes).
  const clock = uPlot.fmtDate("{HH}:{mm}:{ss}");
  // Ticks on whole seconds (the labels have a resolution of one second), minutes past 2 min.
  const timeAxis = {
    incrs: [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900],
    values: (u, splits) => splits.map((v) => clock(new Date(v * 1000))),
  };
  const timeSeries = { value: (u, v) => (v == null ? "—" : clock(new Date(v * 1000))) };

  function chartWidth(el) {
    return Math.max(240, Math.floor(el.getBoundingClientRect().width));
  }

  // The shown span: [last point - range, last point]; every chart and sparkline uses it.
  function xRange() {
    const last = dash.history.length ? dash.history[dash.history.length - 1].t : Date.now() / 1000;
    return [last - dash.range, last];
  }

  function visible() {
    const [from] = xRange();
    return dash.history.filter((point) => point.t >= from);
  }

  // Points where a series has a value between two gaps: a line needs two neighbours, so
  // these are drawn as dots (a limit that rejects now and then, a ratio of sparse traffic).
  function isolated(u, seriesIdx) {
    const values = u.data[seriesIdx];
    const out = [];
    for (let i = 0; i < values.length; i++) {
      if (values[i] == null) continue;
      if ((i === 0 || values[i - 1] == null) && (i === values.length - 1 || values[i + 1] == null)) out.push(i);
    }
    return out;
  }

  // The legend shows the newest values unless the cursor is over the chart.
  function showLatest(u) {
    const n = u.data[0].length;
    if (n && (u.cursor.left == null || u.cursor.left < 0)) u.setLegend({ idx: n - 1 });
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
    const points = { show: true, size: 5, filter: isolated };
    const rate = (u, v) => fmt(v, 1);
    const rates = new uPlot(
      {
        width: chartWidth(ratesEl),
        height: CHART_HEIGHT,
        scales: { x: { time: true, range: () => xRange() }, y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
        series: [
          timeSeries,
          { label: "admitted/s", stroke: COLORS.allowed, width: 1.5, points, value: rate },
          { label: dry ? "would delay/s" : "delayed/s", stroke: COLORS.delayed, width: 1.5, dash: dash_, points, value: rate },
          { label: dry ? "would reject/s" : "rejected/s", stroke: COLORS.rejected, width: 2, dash: dash_, points, value: rate },
        ],
        axes: [timeAxis, { size: 50 }],
        hooks: { setData: [showLatest] },
      },
      [[], [], [], []],
      ratesEl
    );
    const ratio = new uPlot(
      {
        width: chartWidth(ratioEl),
        height: CHART_HEIGHT,
        scales: { x: { time: true, range: () => xRange() }, y: { range: [0, 1] } },
        series: [
          timeSeries,
          {
            label: dry ? "would-reject ratio" : "rejection ratio",
            stroke: COLORS.ratio,
            fill: COLORS.ratio + "22",
            width: 2,
            dash: dash_,
            points: { show: true, size: 6, fill: COLORS.ratio, filter: isolated },
            value: (u, v) => fmtPercent(v),
          },
        ],
        axes: [timeAxis, { size: 50, values: (u, ticks) => ticks.map((t) => Math.round(t * 100) + "%") }],
        hooks: { setData: [showLatest] },
      },
      [[], []],
      ratioEl
    );
    const row = makeRow(name, dry);
    return { node, rates, ratio, row, dryRun: dry };
  }

  function makeRow(name, dry) {
    const row = document.createElement("tr");
    row.dataset.limit = name;
    row.classList.toggle("dry-run", dry);
    const cells = ["name", "allowed", "delayed", "rejected", "ratio", "spark", "worst"];
    for (const cell of cells) {
      const td = document.createElement("td");
      td.className = cell;
      if (["allowed", "delayed", "rejected", "ratio"].includes(cell)) td.classList.add("num");
      row.appendChild(td);
    }
    const link = document.createElement("a");
    link.href = "#limit-" + name;
    link.textContent = name;
    row.querySelector(".name").append(link);
    if (dry) {
      const badge = document.createElement("span");
      badge.className = "badge dry";
      badge.textContent = "dry run";
      row.querySelector(".name").append(" ", badge);
    }
    const canvas = document.createElement("canvas");
    canvas.width = 200;
    canvas.height = 28;
    row.querySelector(".spark").appendChild(canvas);
    $("overview-rows").appendChild(row);
    return row;
  }

  // Admitted (green) and rejected (red) per second over the range, each scaled to its own
  // peak, on a plain canvas: sparse points are drawn as dots.
  function drawSparkline(canvas, series) {
    const ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    const [from, to] = xRange();
    const x = (t) => ((t - from) / (to - from || 1)) * (w - 2) + 1;
    for (const { times, values, color } of series) {
      const peak = Math.max(0, ...values.filter((v) => v != null));
      if (peak <= 0) continue;
      const y = (v) => h - 2 - (v / peak) * (h - 4);
      ctx.strokeStyle = ctx.fillStyle = color;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let open = false;
      for (let i = 0; i < values.length; i++) {
        const v = values[i];
        if (v == null) { open = false; continue; }
        const lonely = (i === 0 || values[i - 1] == null) && (i === values.length - 1 || values[i + 1] == null);
        if (lonely) ctx.fillRect(x(times[i]) - 1.5, y(v) - 1.5, 3, 3);
        if (open) ctx.lineTo(x(times[i]), y(v));
        else ctx.moveTo(x(times[i]), y(v));
        open = true;
      }
      ctx.stroke();
    }
  }

  function seriesFor(name, dryRun, points) {
    const x = [], allowed = [], delayed = [], rejected = [], ratio = [];
    for (const point of points) {
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

  // Rejected over all decisions in the last RATIO_WINDOW points (each point is a rate over its
  // own dt seconds, so counts are rate x dt: a point that lasted longer weighs more).
  function recentRatio(name, dryRun) {
    let refused = 0, total = 0;
    for (const point of dash.history.slice(-RATIO_WINDOW)) {
      const lim = point.limits[name];
      if (!lim) continue;
      const dt = point.dt || 1;
      const r = dryRun ? lim.dry_run_rejected : lim.rejected;
      refused += r * dt;
      total += (lim.allowed + (dryRun ? lim.dry_run_delayed : lim.delayed) + r) * dt;
    }
    return total > 0 ? refused / total : null;
  }

  // The same over the whole gateway: requests the limits refused, over all requests.
  function gatewayRatio() {
    let refused = 0, total = 0;
    for (const point of dash.history.slice(-RATIO_WINDOW)) {
      const dt = point.dt || 1;
      refused += (point.rejected || 0) * dt;
      total += point.requests * dt;
    }
    return total > 0 ? Math.min(1, refused / total) : null;
  }

  function setField(node, field, text) {
    const el = node.querySelector('[data-field="' + field + '"]');
    if (el) el.textContent = text;
  }

  function renderHeader(state) {
    const last = dash.history[dash.history.length - 1];
    $("requests-rate").textContent = last ? fmt(last.requests, 1) : "—";
    $("rejected-rate").textContent = last ? fmt(last.rejected, 1) : "—";
    $("rejected-rate").classList.toggle("bad", Boolean(last && last.rejected > 0));
    $("delayed-rate").textContent = last ? fmt(last.delayed, 1) : "—";
    $("rejected-ratio").textContent = fmtPercent(gatewayRatio());
    $("requests-total").textContent = fmtInt(state.requests);
    $("rejected-total").textContent = fmtInt(state.rejected);
    // The count, then which workers answered (their ids: a restarted worker keeps its id).
    const ids = state.worker_ids;
    $("workers").textContent = state.workers + (ids.length ? (ids.length === 1 ? " (id " : " (ids ") + ids.join(", ") + ")" : "");
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
      const when = r.last_attempt_at ? clock(new Date(r.last_attempt_at * 1000)) : "";
      reload.textContent = r.last_result + (when ? " at " + when : "") + " (" + r.succeeded + " ok, " + r.failed + " failed)";
      reload.dataset.result = r.last_result;
      reload.title = r.last_error || "";
    } else {
      reload.textContent = "no policy file";
    }
  }

  // Each upstream: its servers (state chips), failing or not (a failure in the last minute),
  // its failures and the latest.
  function renderUpstreams(state) {
    const rows = Object.entries(state.upstreams || {}).map(([name, up]) => {
      const row = document.createElement("tr");
      row.className = "pool";
      row.dataset.upstream = name;
      row.title = up.url;
      const latest = up.recent.length ? up.recent[0] : null;
      const failing = latest !== null && state.at - latest.at < FAILING_S;
      const nameCell = document.createElement("td");
      nameCell.className = "upstream";
      nameCell.textContent = name;
      const servers = document.createElement("td");
      servers.className = "servers";
      for (const server of up.servers) {
        const chip = document.createElement("span");
        chip.className = "server";
        chip.dataset.state = server.state;
        chip.textContent = server.server + " " + server.state;
        chip.title = "weight " + server.weight + (server.backup ? " (backup)" : "") +
          ", in flight " + server.inflight + ", requests " + server.requests +
          ", failures " + server.failures + ", ejections " + server.ejections +
          ", workers by state " + JSON.stringify(server.states);
        servers.appendChild(chip);
      }
      const status = document.createElement("td");
      status.className = "state " + (failing ? "bad" : "good");
      status.textContent = failing ? "failing" : "ok";
      const count = document.createElement("td");
      count.className = "num";
      count.textContent = fmtInt(up.failures_total);
      const last = document.createElement("td");
      last.className = "detail";
      last.textContent = latest
        ? clock(new Date(latest.at * 1000)) + " " + latest.address + " " +
          latest.cause + ": " + latest.detail
        : "none";
      row.append(nameCell, servers, status, count, last);
      return row;
    });
    $("server-pools").replaceChildren(...rows);
    $("upstreams").hidden = rows.length === 0;
  }

  function keyText(hitter) {
    // Key parts are joined by U+001F; a key of constant parts only ([global]) is empty.
    return hitter.key ? hitter.key.split("\u001f").map(keyPart).join(" · ") : "(all clients)";
  }

  function renderLimit(name, info, points) {
    let view = dash.limits[name];
    if (view && view.dryRun !== info.dry_run) {
      view.node.remove();
      view.row.remove();
      view = null;
    }
    if (!view) view = dash.limits[name] = makeLimit(name, info);
    const { node, row, dryRun } = view;
    // null when the newest point has no figures for it (a limit a reload just added)
    const last = (dash.history.length && dash.history[dash.history.length - 1].limits[name]) || null;
    const ratio = fmtPercent(recentRatio(name, dryRun));
    const allowed = last ? fmt(last.allowed, 1) : "—";
    const delayed = last ? fmt(dryRun ? last.dry_run_delayed : last.delayed, 1) : "—";
    const rejected = last ? fmt(dryRun ? last.dry_run_rejected : last.rejected, 1) : "—";
    setField(node, "allowed-rate", allowed);
    setField(node, "delayed-rate", delayed);
    setField(node, "rejected-rate", rejected);
    setField(node, "ratio", ratio);
    setField(node, "waiting", fmtInt(info.waiting));
    setField(node, "wait", last ? fmtWait(last.wait_p50, last.wait_p99) : "—");
    setField(node, "allowed-total", fmtInt(info.allowed));
    setField(node, "delayed-total", fmtInt(dryRun ? info.dry_run_delayed : info.delayed));
    setField(node, "rejected-total", fmtInt(dryRun ? info.dry_run_rejected : info.rejected));
    setField(node, "tracked-keys", fmtInt(info.tracked_keys) + (info.tracked_keys === 1 ? " key" : " keys"));
    setField(node, "evictions", fmtInt(info.evictions));
    node.querySelector(".slots").hidden = info.algorithm !== "concurrency";
    // A limit with a penalty, or whose keys an operator blocked: what its boxes did. The keys
    // blocked now are null where the store keeps the boxes (Redis).
    const blocked = info.blocked_keys;
    node.querySelector(".penalty").hidden = !(info.penalty || info.penalized > 0 || blocked > 0);
    setField(node, "blocked-keys", blocked == null ? "—" : fmtInt(blocked) + (blocked === 1 ? " key" : " keys"));
    setField(node, "penalized-total", fmtInt(info.penalized));
    node.querySelector(".penalty").classList.toggle("bad", blocked > 0);
    setField(node, "slots-in-use", fmtInt(info.slots_in_use));
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

    renderUnits(node, info.units, last);

    const tbody = node.querySelector(".top tbody");
    tbody.replaceChildren(
      ...info.top_keys.map((hitter) => {
        const tr = document.createElement("tr");
        for (const text of [keyText(hitter), hitter.tier || "—", fmtInt(hitter.count), fmtInt(hitter.error)]) {
          const cell = document.createElement("td");
          cell.textContent = text;
          tr.appendChild(cell);
        }
        return tr;
      })
    );
    const none = node.querySelector(".top .none");
    none.hidden = info.top_keys.length > 0;
    // A dry-run limit's view holds the keys it would have rejected.
    none.textContent = dryRun ? "no key would have been limited lately" : "no key limited lately";
    node.querySelector(".top summary").textContent = dryRun
      ? "keys it would have limited, last 1–2 minutes"
      : "top limited keys, last 1–2 minutes";

    const s = seriesFor(name, dryRun, points);
    view.rates.setData([s.x, s.allowed, s.delayed, s.rejected]);
    view.ratio.setData([s.x, s.ratio]);

    // The overview row: the same figures, a sparkline over the range, the worst key.
    row.querySelector(".allowed").textContent = allowed;
    row.querySelector(".delayed").textContent = delayed;
    row.querySelector(".rejected").textContent = rejected;
    row.querySelector(".rejected").classList.toggle("bad", rejected !== "—" && Number(rejected) > 0);
    row.querySelector(".ratio").textContent = ratio;
    row.classList.toggle("rejecting", last !== null && (dryRun ? last.dry_run_rejected : last.rejected) > 0);
    drawSparkline(row.querySelector(".spark canvas"), [
      { times: s.x, values: s.allowed, color: COLORS.allowed },
      { times: s.x, values: s.rejected, color: COLORS.rejected },
    ]);
    const worst = info.top_keys[0];
    // The key, its plan (unless the key says it), and its rejections in the last minute or two.
    const plan = worst && worst.tier && worst.key !== "\u001eunlisted" ? " (" + worst.tier + ")" : "";
    row.querySelector(".worst").textContent = worst ? keyText(worst) + plan + ": " + fmtInt(worst.count) : "—";
  }

  // A limit with cost_from: the tokens its calls were charged, held while in flight and
  // given back when settled, since start, those the calls in flight hold now, and the models
  // charged the most ("" is a response
  // that named none, "other" the models past server.metrics_max_models).
  function renderUnits(node, units, last) {
    const box = node.querySelector(".units");
    box.hidden = !units;
    if (!units) return;
    setField(box, "units-charged", fmtInt(units.charged));
    setField(box, "units-held", fmtInt(units.held));
    setField(box, "units-returned", fmtInt(units.returned));
    setField(box, "units-in-flight", fmtInt(units.in_flight));
    setField(box, "units-rate", last && last.charged_units != null ? fmt(last.charged_units, 1) : "—");
    box.querySelector(".models tbody").replaceChildren(
      ...units.models.map((row) => {
        const tr = document.createElement("tr");
        tr.dataset.model = row.model;
        const name = row.model === "" ? "(none named)" : row.model;
        for (const text of [name, fmtInt(row.charged), fmtInt(row.held), fmtInt(row.returned)]) {
          const cell = document.createElement("td");
          cell.textContent = text;
          tr.appendChild(cell);
        }
        return tr;
      })
    );
    box.querySelector(".models").hidden = units.models.length === 0;
  }

  // An upstream's adaptive limit over time beside its latency: the limit moves with it.
  function makeAdaptive(name) {
    const node = $("adaptive-template").content.firstElementChild.cloneNode(true);
    node.dataset.upstream = name;
    node.querySelector(".name").textContent = name;
    $("adaptive-upstreams").appendChild(node);
    const limitEl = node.querySelector(".chart.limit");
    const latencyEl = node.querySelector(".chart.latency");
    const count = (u, v) => fmt(v, 0);
    const limit = new uPlot(
      {
        width: chartWidth(limitEl),
        height: CHART_HEIGHT,
        scales: { x: { time: true, range: () => xRange() }, y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
        series: [
          timeSeries,
          { label: "limit", stroke: COLORS.ratio, width: 2, value: count },
          { label: "in flight", stroke: COLORS.allowed, width: 1.5, value: count },
          { label: "shed/s", stroke: COLORS.rejected, width: 1.5, points: { show: true, size: 5, filter: isolated }, value: (u, v) => fmt(v, 1) },
        ],
        axes: [timeAxis, { size: 50 }],
        hooks: { setData: [showLatest] },
      },
      [[], [], [], []],
      limitEl
    );
    const latency = new uPlot(
      {
        width: chartWidth(latencyEl),
        height: CHART_HEIGHT,
        scales: { x: { time: true, range: () => xRange() }, y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
        series: [
          timeSeries,
          { label: "latency", stroke: COLORS.delayed, width: 2, value: (u, v) => fmt(v, 1) + " ms" },
          { label: "minimum", stroke: COLORS.allowed, width: 1.5, dash: [6, 4], value: (u, v) => fmt(v, 1) + " ms" },
        ],
        axes: [timeAxis, { size: 50, values: (u, ticks) => ticks.map((t) => t + " ms") }],
        hooks: { setData: [showLatest] },
      },
      [[], [], []],
      latencyEl
    );
    return { node, limit, latency };
  }

  function renderAdaptive(state, points) {
    const gates = state.adaptive || {};
    for (const [name, gate] of Object.entries(gates)) {
      const view = dash.adaptive[name] || (dash.adaptive[name] = makeAdaptive(name));
      const last = (dash.history.length && (dash.history[dash.history.length - 1].adaptive || {})[name]) || null;
      setField(view.node, "limit", fmtInt(gate.limit));
      setField(view.node, "in-flight", fmtInt(gate.in_flight));
      setField(view.node, "waiting", fmtInt(gate.waiting));
      setField(view.node, "latency", fmtSeconds(gate.latency_s) + " (" + fmtSeconds(gate.min_latency_s) + ")");
      setField(view.node, "shed-rate", last ? fmt(last.shed, 1) : "—");
      const x = [], limit = [], inFlight = [], shed = [], latency = [], minimum = [];
      for (const point of points) {
        const one = (point.adaptive || {})[name];
        x.push(point.t);
        limit.push(one ? one.limit : null);
        inFlight.push(one ? one.in_flight : null);
        shed.push(one && one.shed > 0 ? one.shed : null);
        latency.push(one && one.latency_s > 0 ? one.latency_s * 1000 : null);
        minimum.push(one && one.min_latency_s > 0 ? one.min_latency_s * 1000 : null);
      }
      view.limit.setData([x, limit, inFlight, shed]);
      view.latency.setData([x, latency, minimum]);
    }
    for (const name of Object.keys(dash.adaptive)) {
      if (!(name in gates)) {
        dash.adaptive[name].node.remove();
        delete dash.adaptive[name];
      }
    }
    $("adaptive").hidden = Object.keys(gates).length === 0;
  }

  function render(state) {
    dash.state = state;
    renderHeader(state);
    renderUpstreams(state);
    const points = visible();
    const names = Object.keys(state.limits);
    for (const name of names) renderLimit(name, state.limits[name], points);
    renderAdaptive(state, points);
    for (const name of Object.keys(dash.limits)) {
      if (!(name in state.limits)) {
        dash.limits[name].node.remove();
        dash.limits[name].row.remove();
        delete dash.limits[name];
      }
    }
    $("no-limits").hidden = names.length > 0;
    for (const label of document.querySelectorAll(".range-label")) label.textContent = fmtRange(dash.range);
    for (const button of document.querySelectorAll(".range button")) {
      button.setAttribute("aria-pressed", String(Number(button.dataset.range) === dash.range));
    }
    dash.updates += 1;
    dash.lastUpdate = Date.now();
    document.body.dataset.updates = String(dash.updates);
  }

  function receive(message) {
    dash.history = message.history;
    render(message.state);
  }
  dash.receive = receive;

  function connect() {
    const live = $("live");
    const events = new EventSource("/dashboard/events");
    events.addEventListener("init", (e) => receive(JSON.parse(e.data)));
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

  for (const button of document.querySelectorAll(".range button")) {
    button.addEventListener("click", () => {
      dash.range = Number(button.dataset.range);
      if (dash.state) render(dash.state);
    });
  }

  window.addEventListener("resize", () => {
    const charts = Object.values(dash.adaptive).map((view) => [view.limit, view.latency]);
    for (const view of Object.values(dash.limits)) charts.push([view.rates, view.ratio]);
    for (const pair of charts) {
      for (const chart of pair) {
        chart.setSize({ width: chartWidth(chart.root.parentElement), height: CHART_HEIGHT });
      }
    }
  });

  // Drawn from the data the page came with, before the event stream says anything.
  const initial = JSON.parse($("initial-data").textContent);
  if (initial) receive(initial);
  connect();
})();

// A part tagged U+001E (gateway/limits/keys.py): "ip" + the client IP standing in for a missing
// header or query value, "x" + the hex of a value that held a separator, or the one key of
// every unlisted key (unlisted: shared).
function keyPart(part) {
  if (!part.startsWith("\u001e")) return part;
  if (part.startsWith("\u001eip")) return `${part.slice(3)} (no key: client IP)`;
  if (part === "\u001eunlisted") return "(unlisted keys, shared)";
  return `hex:${part.slice(2)}`;
}

// mlx-gateway console: reads /console/api (state, then live updates as server-sent events,
// read with fetch so the key travels in a header), controls models (admin keys), and chats
// through the gateway's own OpenAI API. No framework; charts by uPlot (vendored).
"use strict";

(() => {
  const KEY_STORE = "mlx-gateway.key";
  const WINDOW_S = 300; // the charts show the last five minutes
  const PALETTE = ["#0b57d0", "#d93025", "#188038", "#e37400", "#9334e6", "#007b83", "#b06000", "#5f6368"];
  const $ = (id) => document.getElementById(id);

  const state = {
    key: sessionStorage.getItem(KEY_STORE) || "",
    session: null,
    models: [],
    history: [], // samples: {t, models: {name: {tokens_per_s, ...}}}
    recent: [],
    charts: {},
    chartModels: "",
    streamAbort: null,
    retry: 0,
    pending: new Set(), // models with a control call in flight
    chat: [],
    chatAbort: null,
    retryTimer: null,
    paused: false, // a hidden tab's live stream is closed (see "background tabs")
    rows: new Map(), // model -> {tr, cells, buttons}: the table is updated in place
  };
  window.mlxConsole = state; // for people poking at it in the browser's devtools

  // ---- calls ---------------------------------------------------------------------------

  function headers(extra) {
    const h = { ...(extra || {}) };
    if (state.key) h.authorization = `Bearer ${state.key}`;
    return h;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      const e = body.error;
      return (e && (e.message || e)) || `${response.status} ${response.statusText}`;
    } catch {
      return `${response.status} ${response.statusText}`;
    }
  }

  // Server-sent events from a fetch response: yields {event, data}.
  async function* events(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      // normalise line ends, keeping a trailing \r until its \n may follow
      const tail = buffer.endsWith("\r") ? "\r" : "";
      buffer = buffer.slice(0, buffer.length - tail.length).replace(/\r\n?/g, "\n") + tail;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  }

  // ---- the live connection ---------------------------------------------------------------

  async function connect() {
    clearTimeout(state.retryTimer);
    state.retryTimer = null;
    if (state.paused) return; // opened again when the tab is shown
    if (state.streamAbort) state.streamAbort.abort();
    const abort = new AbortController();
    state.streamAbort = abort;
    let response;
    try {
      response = await fetch("/console/api/live", { headers: headers(), signal: abort.signal });
    } catch (err) {
      if (!abort.signal.aborted) reconnect("The gateway cannot be reached");
      return;
    }
    if (response.status === 401 || response.status === 403) {
      const why = await errorText(response);
      askForKey(state.key ? why : "");
      return;
    }
    if (!response.ok) {
      reconnect(`The gateway answered ${response.status}: ${await errorText(response)}`);
      return;
    }
    try {
      for await (const { event, data } of events(response)) {
        const body = JSON.parse(data);
        if (event === "state") showState(body);
        else if (event === "update") {
          showUpdate(body);
          state.retry = 0; // a stream that keeps going: the next break retries at once
        }
      }
      if (!abort.signal.aborted) reconnect("The live connection ended");
    } catch (err) {
      if (!abort.signal.aborted) reconnect("The live connection broke");
    }
  }

  // ---- background tabs ------------------------------------------------------------------
  // A browser keeps at most six connections to one host, across all its tabs: live streams
  // held open by tabs in the background would leave a seventh tab's page waiting. A tab
  // hidden for a few seconds closes its stream; shown again, it opens it (the state event
  // brings the charts' history back).
  const HIDDEN_GRACE_MS = 3000;
  let hiding = null;

  function pause() {
    state.paused = true;
    clearTimeout(state.retryTimer);
    if (state.streamAbort) state.streamAbort.abort();
    state.streamAbort = null;
  }

  function visibility() {
    clearTimeout(hiding);
    if (document.hidden) hiding = setTimeout(pause, HIDDEN_GRACE_MS);
    else if (state.paused) {
      state.paused = false;
      state.retry = 0;
      connect();
    }
  }
  document.addEventListener("visibilitychange", visibility);

  function reconnect(why) {
    const delay = Math.min(10, 1 + state.retry++) * 1000;
    banner(`${why}; trying again in ${delay / 1000} s.`);
    clearTimeout(state.retryTimer);
    state.retryTimer = setTimeout(connect, delay);
  }

  function banner(text) {
    const el = $("connection");
    el.textContent = text || "";
    el.hidden = !text;
  }

  // ---- key -------------------------------------------------------------------------------

  // What one key saw goes when another (or none) takes over: the figures, the tables, the
  // playground's conversation, the header.
  function resetSession() {
    if (state.chatAbort) state.chatAbort.abort();
    state.chat = [];
    state.session = null;
    state.history = [];
    state.recent = [];
    state.models = [];
    state.rows.clear();
    $("models").tBodies[0].replaceChildren();
    $("recent").tBodies[0].replaceChildren();
    $("chat-log").replaceChildren();
    $("chat-stats").textContent = "";
    $("action-status").textContent = "";
    $("who").textContent = "";
    $("memory-block").hidden = true;
  }

  function askForKey(error) {
    resetSession();
    $("app").hidden = true;
    $("key-section").hidden = false;
    $("key-error").textContent = error || "";
    $("machine").textContent = "A key is needed to see this gateway.";
    $("forget").hidden = !state.key;
    $("key-input").focus();
  }

  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.key = $("key-input").value.trim();
    $("key-input").value = "";
    sessionStorage.setItem(KEY_STORE, state.key);
    resetSession();
    $("key-section").hidden = true;
    connect();
  });

  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    state.key = "";
    if (state.streamAbort) state.streamAbort.abort();
    resetSession();
    connect();
  });

  // ---- rendering ---------------------------------------------------------------------------

  function showState(body) {
    banner("");
    state.session = body.session;
    const last = body.history.length ? body.history[body.history.length - 1].t : 0;
    state.history = body.history.filter((p) => p.t >= last - WINDOW_S);
    state.recent = body.recent;
    $("key-section").hidden = true;
    $("app").hidden = false;
    const s = body.session;
    document.body.classList.toggle("no-control", !s.can_control);
    $("who").textContent = s.key ? `Key “${s.key.name}” (${s.key.scope})` : "No keys configured";
    $("forget").hidden = !state.key;
    const note = $("control-note");
    note.hidden = s.can_control;
    note.textContent = s.key
      ? "Loading and unloading models needs an admin-scope key."
      : "Loading and unloading models from here needs an admin-scope key: create one with `gatewayctl keys create NAME --scope admin`, then enter it.";
    showModels(body.models);
    showMachine(body.gateway);
    showRecent();
    drawCharts();
  }

  function showUpdate(body) {
    state.history.push(body.sample);
    const from = body.sample.t - WINDOW_S;
    while (state.history.length && state.history[0].t < from) state.history.shift();
    if (body.recent.length) {
      state.recent = body.recent.concat(state.recent).slice(0, 100);
      showRecent();
    }
    showModels(body.models);
    showMachine(body.gateway);
    drawCharts();
  }

  function bytes(n) {
    if (n == null) return "–";
    const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [unit, scale] of units) if (n >= scale) return `${(n / scale).toFixed(unit === "GiB" ? 2 : 1)} ${unit}`;
    return `${n} B`;
  }

  function duration(s) {
    if (s == null) return "–";
    s = Math.floor(s);
    if (s < 120) return `${s} s`;
    if (s < 7200) return `${Math.floor(s / 60)} min`;
    return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  }

  function ms(s) {
    return s == null ? "–" : `${Math.round(s * 1000)} ms`;
  }

  function showMachine(g) {
    $("machine").textContent = `Version ${g.version} · ${g.device} · up ${duration(g.uptime_s)}`;
    const block = $("memory-block");
    block.hidden = false;
    const meter = $("memory");
    meter.max = g.memory_budget_bytes || 1;
    meter.value = g.memory_used_bytes;
    meter.low = meter.max * 0.75;
    meter.high = meter.max * 0.9;
    $("memory-text").textContent = `${bytes(g.memory_used_bytes)} of ${bytes(g.memory_budget_bytes)} (machine: ${bytes(g.memory_total_bytes)})`;
  }

  function cell(row, text, cls, table) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    // the column's name, shown beside the value where a phone's width stacks the row
    const th = (table || row.closest("table")).tHead.rows[0].cells[row.cells.length];
    if (th) td.dataset.label = th.textContent;
    row.appendChild(td);
    return td;
  }

  function latest(model) {
    const last = state.history[state.history.length - 1];
    return last && last.models[model];
  }

  function prefixCache(stats) {
    if (!stats) return "–";
    const held = `${bytes(stats.nbytes)} of ${bytes(stats.capacity_bytes)}`;
    if (!stats.lookups) return held;
    return `${Math.round((100 * stats.hits) / stats.lookups)}% hits · ${held}`;
  }

  // One row per model, made once and then updated in place: a click or a focused button
  // survives the updates that come each second.
  function modelRow(model) {
    let row = state.rows.get(model);
    if (row) return row;
    const tr = document.createElement("tr");
    tr.dataset.model = model;
    const cells = {};
    for (const name of ["model", "kind", "state", "memory", "ttl", "restarts", "running", "waiting", "tokens", "cache", "actions"]) {
      const numeric = ["memory", "ttl", "restarts", "running", "waiting", "tokens"].includes(name);
      cells[name] = cell(tr, "", numeric ? "num" : name === "actions" ? "actions" : "", $("models"));
    }
    cells.model.tabIndex = -1; // where focus goes when the button it was on is disabled
    const name = document.createElement("span");
    const alias = document.createElement("span");
    alias.className = "alias";
    cells.model.append(name, alias);
    const badge = document.createElement("span");
    cells.state.appendChild(badge);
    const buttons = {};
    // only for a key that may use them (the rows are made again for another key)
    const actions = state.session && state.session.can_control ? [["load", "Load"], ["unload", "Unload"], ["reload", "Reload"]] : [];
    for (const [action, label] of actions) {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = label;
      b.dataset.model = model;
      b.dataset.action = action;
      b.setAttribute("aria-label", `${label} ${model}`);
      b.addEventListener("click", () => control(model, action));
      cells.actions.appendChild(b);
      buttons[action] = b;
    }
    row = { tr, cells, name, alias, badge, buttons };
    state.rows.set(model, row);
    return row;
  }

  function setText(el, text) {
    if (el.textContent !== text) el.textContent = text;
  }

  function showModels(rows) {
    state.models = rows;
    const body = $("models").tBodies[0];
    const wanted = rows.map((r) => modelRow(r.model).tr);
    if (!rows.length) {
      const tr = document.createElement("tr");
      const td = cell(tr, "No models this key may use.", "empty", $("models"));
      td.colSpan = 11;
      wanted.push(tr);
    }
    for (const [model, row] of state.rows) {
      if (!rows.some((r) => r.model === model)) state.rows.delete(model);
    }
    const current = [...body.rows];
    if (current.length !== wanted.length || current.some((tr, i) => tr !== wanted[i])) {
      body.replaceChildren(...wanted);
    }
    const control = state.session && state.session.can_control;
    for (const r of rows) {
      const row = state.rows.get(r.model);
      const c = row.cells;
      setText(row.name, r.model);
      setText(row.alias, r.aliases && r.aliases.length ? `also ${r.aliases.join(", ")}` : "");
      setText(c.kind, r.kind);
      setText(row.badge, r.state);
      row.badge.className = `badge state-${r.state}`;
      row.badge.title = r.error || r.last_error || "";
      setText(c.memory, bytes(r.memory_bytes || r.rss_bytes));
      setText(c.ttl, r.ttl_s == null ? "never" : duration(r.ttl_left_s));
      setText(c.restarts, String(r.restarts));
      setText(c.running, String(r.running));
      setText(c.waiting, String(r.waiting));
      const now = latest(r.model);
      setText(c.tokens, now ? now.tokens_per_s.toFixed(1) : "–");
      setText(c.cache, prefixCache(r.prefix_cache));
      c.actions.hidden = !control;
      const busy = state.pending.has(r.model);
      const loaded = ["ready", "loading"].includes(r.state);
      const enabled = { load: !loaded && r.state !== "unloading", unload: loaded, reload: r.state === "ready" };
      for (const [action, b] of Object.entries(row.buttons)) {
        const disabled = busy || !enabled[action];
        if (disabled && document.activeElement === b) c.model.focus(); // keep focus in the row
        b.disabled = disabled;
      }
    }
    showChatModels();
  }

  function showRecent() {
    const body = $("recent").tBodies[0];
    body.replaceChildren();
    if (!state.recent.length) {
      const td = cell(body.insertRow(), "No requests yet.", "empty");
      td.colSpan = 9;
      return;
    }
    for (const r of state.recent) {
      const tr = body.insertRow();
      cell(tr, new Date(r.finished_at * 1000).toLocaleTimeString());
      const id = cell(tr, r.id.slice(0, 8));
      id.title = `${r.id} ${r.path}`;
      cell(tr, r.model || "–");
      cell(tr, r.key || "–");
      cell(tr, String(r.status), r.status >= 400 ? "num status-bad" : "num");
      cell(tr, r.cached_tokens ? `${r.prompt_tokens} (${r.cached_tokens} cached)` : String(r.prompt_tokens), "num");
      cell(tr, String(r.completion_tokens), "num");
      cell(tr, ms(r.ttft_s), "num");
      cell(tr, ms(r.duration_s), "num");
    }
  }

  // ---- charts ------------------------------------------------------------------------------

  function chartModels() {
    const names = new Set(state.models.map((m) => m.model));
    for (const p of state.history) for (const n of Object.keys(p.models)) names.add(n);
    return [...names].sort();
  }

  function makeChart(id, series, yLabel) {
    const el = $(id);
    const opts = {
      width: Math.max(260, el.clientWidth),
      height: 200,
      series: [{}, ...series.map((label, i) => ({
        label, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: id === "chart-ttft",
        points: { show: id === "chart-ttft" },
      }))],
      axes: [{ stroke: getComputedStyle(document.body).color }, { stroke: getComputedStyle(document.body).color, label: yLabel, size: 55 }],
      scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(1, max * 1.1)] } },
      legend: { live: true },
    };
    el.replaceChildren();
    return new uPlot(opts, [[]].concat(series.map(() => [])), el);
  }

  function drawCharts() {
    if (typeof uPlot === "undefined") return;
    const models = chartModels();
    const key = models.join("\n");
    if (key !== state.chartModels || !state.charts.tokens) {
      state.chartModels = key;
      state.charts.tokens = makeChart("chart-tokens", models, "tokens/s");
      state.charts.requests = makeChart("chart-requests", ["running", "waiting"], "requests");
      state.charts.ttft = makeChart("chart-ttft", models, "ms");
    }
    const t = state.history.map((p) => p.t);
    const per = (figure, scale) => models.map((m) => state.history.map((p) => {
      const v = p.models[m] && p.models[m][figure];
      return v == null ? null : v * (scale || 1);
    }));
    const sum = (figure) => state.history.map((p) => Object.values(p.models).reduce((a, v) => a + (v[figure] || 0), 0));
    state.charts.tokens.setData([t, ...per("tokens_per_s")]);
    state.charts.requests.setData([t, sum("running"), sum("waiting")]);
    state.charts.ttft.setData([t, ...per("ttft_s", 1000)]);
    const last = state.history[state.history.length - 1];
    if (last) {
      const total = (f) => Object.values(last.models).reduce((a, v) => a + (v[f] || 0), 0);
      $("now-tokens").textContent = `now ${total("tokens_per_s").toFixed(1)}`;
      $("now-requests").textContent = `now ${total("running")} running, ${total("waiting")} waiting`;
      // the latest second in the window in which a request finished
      let ttft = null;
      for (let i = state.history.length - 1; i >= 0 && ttft === null; i--) {
        const seen = Object.values(state.history[i].models).map((v) => v.ttft_s).filter((v) => v != null);
        if (seen.length) ttft = Math.max(...seen);
      }
      $("now-ttft").textContent = ttft === null ? "" : `last ${ms(ttft)}`;
    }
  }

  new ResizeObserver(() => {
    for (const [name, chart] of Object.entries(state.charts)) {
      const el = $(`chart-${name}`);
      if (chart && el.clientWidth) chart.setSize({ width: el.clientWidth, height: 200 });
    }
  }).observe(document.querySelector(".charts"));

  // ---- model control ---------------------------------------------------------------------

  async function control(model, action) {
    state.pending.add(model);
    showModels(state.models);
    const status = $("action-status");
    status.textContent = `${action[0].toUpperCase()}${action.slice(1)}ing ${model}…`;
    try {
      const response = await fetch(`/console/api/models/${action}`, {
        method: "POST", headers: headers({ "content-type": "application/json" }),
        body: JSON.stringify({ model }),
      });
      status.textContent = response.ok ? `${model}: ${action} done.` : `${model}: ${action} failed: ${await errorText(response)}`;
    } catch (err) {
      status.textContent = `${model}: ${action} failed: ${err}`;
    } finally {
      state.pending.delete(model);
      showModels(state.models);
    }
  }

  // ---- playground ------------------------------------------------------------------------

  function showChatModels() {
    const select = $("chat-model");
    const chatty = state.models.filter((m) => ["llm", "vision"].includes(m.kind) && !["failed", "backoff"].includes(m.state));
    const names = chatty.map((m) => m.model);
    if (names.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
    const keep = select.value;
    select.replaceChildren(...names.map((n) => new Option(n, n)));
    if (names.includes(keep)) select.value = keep;
    $("chat-send").disabled = !names.length || !!state.chatAbort;
  }

  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    const who = document.createElement("span");
    who.className = "who-said";
    who.textContent = role === "user" ? "You" : role === "assistant" ? "Model" : "Error";
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    div.append(who, body);
    $("chat-log").appendChild(div);
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    return body;
  }

  async function send() {
    const text = $("chat-input").value.trim();
    const model = $("chat-model").value;
    if (!text || !model || state.chatAbort) return;
    $("chat-input").value = "";
    addMessage("user", text);
    // this conversation's: a new chat (or another key) while it streams starts another
    const chat = state.chat;
    chat.push({ role: "user", content: text });
    const out = addMessage("assistant", "");
    const abort = new AbortController();
    state.chatAbort = abort;
    $("chat-send").disabled = true;
    $("chat-stop").disabled = false;
    $("chat-stats").textContent = "Waiting for the first token…";
    const started = performance.now();
    let first = null;
    let usage = null;
    let reply = "";
    let thinking = null;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers({ "content-type": "application/json" }),
        signal: abort.signal,
        body: JSON.stringify({
          model, messages: chat, stream: true, stream_options: { include_usage: true },
          max_tokens: Number($("chat-max").value) || 256,
        }),
      });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const { data } of events(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && (delta.content || delta.reasoning_content)) {
          if (first === null) first = performance.now();
          if (delta.reasoning_content) {
            // the model's thinking: shown apart, never sent back as part of its answer
            if (!thinking) {
              thinking = document.createElement("span");
              thinking.className = "thinking";
              out.before(thinking);
            }
            thinking.textContent += delta.reasoning_content;
          }
          if (delta.content) {
            reply += delta.content;
            out.textContent = reply;
          }
          $("chat-log").scrollTop = $("chat-log").scrollHeight;
        }
      }
      chat.push({ role: "assistant", content: reply });
    } catch (err) {
      if (abort.signal.aborted) {
        chat.push({ role: "assistant", content: reply });
      } else {
        chat.pop();
        addMessage("error", String(err.message || err));
      }
    } finally {
      const end = performance.now();
      const tokens = usage ? usage.completion_tokens : null;
      const parts = [];
      if (first !== null) parts.push(`first token ${Math.round(first - started)} ms`);
      if (tokens != null) {
        parts.push(`${tokens} tokens`);
        if (first !== null && tokens > 1 && end > first) parts.push(`${((tokens - 1) / ((end - first) / 1000)).toFixed(1)} tokens/s`);
      }
      if (abort.signal.aborted) parts.push("stopped");
      $("chat-stats").textContent = parts.join(" · ");
      state.chatAbort = null;
      $("chat-send").disabled = false;
      $("chat-stop").disabled = true;
    }
  }

  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("chat-stop").addEventListener("click", () => state.chatAbort && state.chatAbort.abort());
  $("chat-clear").addEventListener("click", () => {
    if (state.chatAbort) state.chatAbort.abort();
    state.chat = [];
    $("chat-log").replaceChildren();
    $("chat-stats").textContent = "";
  });

  connect();
  visibility(); // a page opened in the background closes its stream after the grace too
})();

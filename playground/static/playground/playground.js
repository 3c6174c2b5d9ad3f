/*
 * The playground page. htmx's websocket extension owns the socket (ws-connect on <main>, ws-send on
 * the form and the Stop button, reconnects with backoff); this file shapes what is sent and applies
 * what arrives. The frame protocol is documented in playground/consumers.py.
 *
 * Speed: frames (one per worker flush, ~25 ms) only append to a buffer; a requestAnimationFrame
 * loop writes the buffer into the page once per frame, and the counters with it, so a 5,000
 * tokens/s stream costs one DOM append per frame. Counters come from the worker's clock.
 * Safety: model output enters the page only as text nodes (append(string), textContent).
 * Reconnects: every stream frame has an entry id; the page applies each id once and in order, and
 * after a reconnect asks for the entries after the last one it applied.
 */
(function () {
  "use strict";

  const ACTIVE = new Set(["sending", "queued", "streaming", "stopping", "reconnecting"]);
  const RETRIED_BY_HTMX = [1006, 1011, 1012, 1013]; // close codes htmx's ws extension reconnects after
  const FIELD_IDS = {
    prompt: "prompt", system_prompt: "system-prompt", model: "model",
    temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens",
  };

  const ui = {};
  let socket = null; // the ws extension's socket wrapper: send() queues while disconnected
  let run = newRun();
  let frameRequested = false;

  function newRun() {
    return {
      phase: "idle", jobId: null, lastId: "0-0", sent: false, note: "",
      pending: [], text: "", n: 0, t: 0, tFirst: null, queue: null,
      startedAt: 0, endedAt: null, stats: null,
    };
  }

  // ---- stream entry ids ("<ms>-<seq>") -------------------------------------------------------------

  function entryAfter(a, b) {
    const [am, as] = a.split("-").map(Number);
    const [bm, bs] = b.split("-").map(Number);
    return am > bm || (am === bm && (as || 0) > (bs || 0));
  }

  // ---- sending ---------------------------------------------------------------------------------

  function generateFrame() {
    const number = (el) => (el.value.trim() === "" ? undefined : Number(el.value));
    return {
      type: "generate",
      prompt: ui.prompt.value,
      system_prompt: ui.system.value,
      model: ui.model.value,
      temperature: number(ui.temperature),
      top_p: number(ui.topP),
      max_tokens: number(ui.maxTokens),
    };
  }

  function onConfigSend(event) {
    if (event.target === ui.stop) {
      if (!run.jobId || !ACTIVE.has(run.phase)) return event.preventDefault();
      event.detail.messageBody = JSON.stringify({ type: "stop" });
      setPhase("stopping");
      return;
    }
    if (event.target !== ui.form) return;
    if (ACTIVE.has(run.phase)) return event.preventDefault();
    event.detail.messageBody = JSON.stringify(generateFrame());
    startRun();
  }

  function startRun() {
    run = newRun();
    run.startedAt = performance.now();
    ui.output.replaceChildren();
    delete ui.output.dataset.streamCheck;
    for (const el of document.querySelectorAll(".invalid")) el.classList.remove("invalid");
    ui.finalStats.hidden = true;
    ui.copy.hidden = true;
    ui.share.hidden = true;
    setPhase("sending");
    requestRender();
  }

  // ---- receiving -------------------------------------------------------------------------------

  function onMessage(event) {
    event.preventDefault(); // JSON frames, not HTML for htmx to swap
    let frame;
    try {
      frame = JSON.parse(event.detail.message);
    } catch (err) {
      return;
    }
    if (frame.type === "workers") return showWorkers(frame);
    if (frame.job_id) {
      if (run.jobId === null && run.phase === "sending") run.jobId = frame.job_id;
      if (frame.job_id !== run.jobId) return; // a frame of an earlier run
    } else if (frame.type === "error") {
      return requestError(frame);
    }
    if (frame.id) {
      if (!entryAfter(frame.id, run.lastId)) return; // already applied before a reconnect
      run.lastId = frame.id;
    }
    switch (frame.type) {
      case "queue":
        run.queue = frame.position;
        if (frame.position === null) setPhase("queued", "starting…");
        else if (frame.workers === 0) setPhase("queued", "waiting for a worker to start");
        else setPhase("queued", frame.position === 0 ? "next in line" : `${frame.position} ahead`);
        break;
      case "started":
        run.queue = 0;
        setPhase("streaming", "prefilling…");
        break;
      case "prefilled":
        if (run.phase !== "stopping") setPhase("streaming", `${frame.prompt_tokens} prompt tokens`);
        break;
      case "delta":
        run.pending.push(frame.text);
        run.text += frame.text;
        run.n = frame.n;
        run.t = frame.t;
        run.tFirst = frame.t_first;
        if (run.phase !== "stopping" && run.phase !== "streaming") setPhase("streaming");
        requestRender();
        break;
      case "done":
        finishDone(frame);
        break;
      case "error":
        finish("error", frame.message || frame.code);
        break;
    }
  }

  function requestError(frame) {
    // A refused request (bad field, busy, queue full) or a broken frame: the socket stays usable.
    const field = frame.param && document.getElementById(FIELD_IDS[frame.param] || "");
    if (field) {
      field.classList.add("invalid");
      field.focus();
    }
    if (run.phase === "sending" && !run.jobId) finish("error", frame.message);
    else flashNote(frame.message);
  }

  function finishDone(frame) {
    flushPending();
    // The server's copy is the reference; the check is kept on the element for tests and benchmarks.
    ui.output.dataset.streamCheck = frame.text === run.text ? "ok" : "mismatch";
    run.text = frame.text;
    run.stats = frame.stats;
    if (frame.stats) {
      run.n = frame.stats.completion_tokens;
    }
    const stopped = frame.finish_reason === "cancelled";
    const why = { length: "reached max tokens", stop: "end of answer", cancelled: "partial output kept" };
    finish(stopped ? "stopped" : "done", why[frame.finish_reason] || frame.finish_reason);
    window.kogHighlight.render(ui.output, run.text);
    showFinalStats(frame.stats);
    ui.copy.hidden = !run.text;
    if (typeof frame.share_url === "string" && frame.share_url.startsWith("/g/")) {
      ui.share.href = frame.share_url;
      ui.share.hidden = false;
    }
  }

  function finish(phase, note) {
    flushPending();
    run.endedAt = performance.now();
    setPhase(phase, note);
    renderCounters(run.endedAt);
  }

  // ---- connection ------------------------------------------------------------------------------

  function onOpen(event) {
    socket = event.detail.socketWrapper;
    setConnection(true);
    if (run.jobId && ACTIVE.has(run.phase)) {
      socket.send(JSON.stringify({ type: "resume", job_id: run.jobId, after: run.lastId }));
      setPhase(run.phase === "reconnecting" ? "streaming" : run.phase, "resumed");
    } else if (run.phase === "reconnecting") {
      // the request went out but its job id never came back: nothing to resume
      finish("error", "the connection dropped before the job started; please try again");
    }
  }

  function onClose(event) {
    setConnection(false);
    // (a request still waiting in the extension's send queue simply goes out after the reconnect)
    if (ACTIVE.has(run.phase) && (run.jobId || run.sent)) setPhase("reconnecting", "connection lost — reconnecting…");
    const wrapper = event.detail.socketWrapper;
    if (!RETRIED_BY_HTMX.includes(event.detail.event.code) && wrapper) {
      setTimeout(() => wrapper.reconnect(), 1000);
    }
  }

  function onAfterSend(event) {
    if (event.target === ui.form) run.sent = true;
  }

  // ---- rendering -------------------------------------------------------------------------------

  function requestRender() {
    if (!frameRequested) {
      frameRequested = true;
      requestAnimationFrame(renderFrame);
    }
  }

  function renderFrame(now) {
    frameRequested = false;
    flushPending();
    renderCounters(now);
    if (ACTIVE.has(run.phase)) requestRender(); // keeps the clocks ticking between frames
  }

  function flushPending() {
    if (!run.pending.length) return;
    const box = ui.outputBox;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 48;
    ui.output.append(run.pending.join(""));
    run.pending = [];
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  function setText(el, value) {
    if (el.textContent !== value) el.textContent = value;
  }

  function formatRate(rate) {
    return rate >= 100 ? rate.toFixed(0) : rate.toFixed(1);
  }

  function renderCounters(now) {
    const s = run.stats;
    if (s && s.decode_tok_s > 0) setText(ui.tokS, formatRate(s.decode_tok_s));
    else if (run.n > 1 && run.t > run.tFirst) setText(ui.tokS, formatRate((run.n - 1) / (run.t - run.tFirst)));
    else setText(ui.tokS, "–");
    if (s && s.ttft_ms) setText(ui.ttft, s.ttft_ms.toFixed(0));
    else setText(ui.ttft, run.tFirst === null ? "–" : (run.tFirst * 1000).toFixed(0));
    setText(ui.tokens, String(run.n));
    setText(ui.queue, run.phase === "queued" && run.queue !== null ? String(run.queue) : "–");
    setText(ui.elapsed, run.startedAt ? (((run.endedAt || now) - run.startedAt) / 1000).toFixed(2) : "–");
  }

  function showFinalStats(stats) {
    if (!stats) return;
    const ms = (v) => (v >= 1000 ? (v / 1000).toFixed(2) + " s" : v.toFixed(1) + " ms");
    setText(ui.statPromptTokens, `${stats.prompt_tokens} tokens`);
    setText(ui.statPrefill, ms(stats.prefill_ms));
    setText(ui.statTtft, ms(stats.ttft_ms));
    setText(ui.statDecode, `${formatRate(stats.decode_tok_s)} tok/s · ${stats.completion_tokens} tokens`);
    setText(ui.statTotal, ms(stats.total_ms));
    const peak = stats.peak_bandwidth_gbs;
    ui.bandwidthRow.hidden = !peak;
    if (peak) {
      const pct = (100 * stats.bandwidth_gbs) / peak;
      setText(ui.statBandwidth, `${stats.bandwidth_gbs.toFixed(0)} GB/s · ${pct.toFixed(0)}% of peak`);
    }
    ui.finalStats.hidden = false;
  }

  function setPhase(phase, note) {
    run.phase = phase;
    run.note = note || "";
    const labels = {
      idle: "Ready", sending: "Sending…", queued: "Queued", streaming: "Streaming", stopping: "Stopping…",
      reconnecting: "Reconnecting", done: "Done", stopped: "Stopped", error: "Error",
    };
    ui.state.dataset.state = phase;
    setText(ui.state, run.note ? `${labels[phase]} · ${run.note}` : labels[phase]);
    const active = ACTIVE.has(phase);
    ui.generate.disabled = active;
    ui.stop.disabled = !active || !run.jobId || phase === "stopping";
    ui.app.dataset.phase = phase;
  }

  let noteTimer = null;
  function flashNote(message) {
    ui.note.textContent = message;
    ui.note.hidden = false;
    clearTimeout(noteTimer);
    noteTimer = setTimeout(() => (ui.note.hidden = true), 6000);
  }

  // ---- workers ---------------------------------------------------------------------------------

  function setConnection(connected) {
    ui.app.dataset.connected = connected ? "true" : "false";
    if (!connected) {
      ui.workerStatus.dataset.up = "false";
      setText(ui.workerText, "connection lost · reconnecting");
    }
  }

  function showWorkers(frame) {
    ui.workerStatus.dataset.up = frame.up ? "true" : "false";
    let text = frame.error || "no worker up";
    if (frame.up) {
      text = `${frame.count} worker${frame.count === 1 ? "" : "s"} up · ${frame.devices.join(", ")}`;
      if (frame.busy) text += ` · ${frame.busy} busy`;
    }
    setText(ui.workerText, text);

    const names = frame.models.map((m) => m.name);
    const current = Array.from(ui.model.options).filter((o) => !o.disabled).map((o) => o.value);
    if (names.join("\n") === current.join("\n")) return;
    const selected = ui.model.value;
    const options = names.map((name) => {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = name;
      return option;
    });
    if (!options.length) {
      const waiting = document.createElement("option");
      waiting.textContent = "waiting for a worker…";
      waiting.disabled = true;
      options.push(waiting);
    }
    ui.model.replaceChildren(...options);
    if (names.includes(selected)) ui.model.value = selected;
  }

  // ---- copy ------------------------------------------------------------------------------------

  function copyOutput() {
    const done = () => {
      setText(ui.copy, "Copied");
      setTimeout(() => setText(ui.copy, "Copy"), 1500);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(run.text).then(done, selectOutput);
    } else {
      selectOutput();
    }
  }

  function selectOutput() {
    const range = document.createRange();
    range.selectNodeContents(ui.output);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    setText(ui.copy, "Press Ctrl+C");
  }

  // ---- wiring ----------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", function () {
    const ids = {
      app: "app", form: "prompt-form", prompt: "prompt", system: "system-prompt", model: "model",
      temperature: "temperature", topP: "top-p", maxTokens: "max-tokens", generate: "generate",
      stop: "stop", output: "output", outputBox: "output-box", state: "state", note: "note",
      tokS: "tok-s", ttft: "ttft", tokens: "tokens", queue: "queue", elapsed: "elapsed",
      copy: "copy", share: "share", finalStats: "final-stats", statPromptTokens: "stat-prompt-tokens",
      statPrefill: "stat-prefill", statTtft: "stat-ttft", statDecode: "stat-decode", statTotal: "stat-total",
      statBandwidth: "stat-bandwidth", bandwidthRow: "stat-bandwidth-row",
      workerStatus: "worker-status", workerText: "worker-text",
    };
    for (const [key, id] of Object.entries(ids)) ui[key] = document.getElementById(id);
    if (!ui.app) return;

    ui.form.addEventListener("submit", (event) => event.preventDefault()); // htmx sends it over the socket
    ui.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        ui.form.requestSubmit();
      }
    });
    ui.copy.addEventListener("click", copyOutput);
    for (const id of Object.values(FIELD_IDS)) {
      document.getElementById(id).addEventListener("input", (e) => e.target.classList.remove("invalid"));
    }

    ui.app.addEventListener("htmx:wsConfigSend", onConfigSend);
    ui.app.addEventListener("htmx:wsAfterSend", onAfterSend);
    ui.app.addEventListener("htmx:wsBeforeMessage", onMessage);
    ui.app.addEventListener("htmx:wsOpen", onOpen);
    ui.app.addEventListener("htmx:wsClose", onClose);
    setConnection(false);
    setText(ui.workerText, "connecting…");
    setPhase("idle");
  });
})();

/*
 * The playground page. htmx's websocket extension owns the socket (ws-connect on <main>, ws-send on
 * the form); this file shapes what is sent, applies what arrives, and decides when to reconnect. The
 * frame protocol is documented in playground/consumers.py.
 *
 * Speed: frames (one per worker flush, ~25 ms) only append to a buffer; a requestAnimationFrame
 * loop writes the buffer into the page once per frame, and the counters with it, so a 5,000
 * tokens/s stream costs one DOM append per frame. Counters come from the worker's clock.
 * Safety: model output enters the page only as text nodes (kogHighlight.appendText, textContent), its
 * text-direction controls shown rather than obeyed.
 * Reconnects: every stream frame has an entry id; the page applies each id once and in order, and
 * after a reconnect asks for the entries after the last one it applied. A reload keeps the form and
 * the run's job id in sessionStorage (each entry of the tab's history its own) and replays the run from
 * its first entry.
 * A new run takes the output pane only once it produces (its prefill): until then the last answer stays,
 * and a request the worker refuses (a prompt over the context) leaves it in place.
 * Conversations: "Follow up" moves a chat run's prompt and answer into the earlier turns, which go with
 * the next prompt as its history (the server renders them through the model's chat template).
 */
(function () {
  "use strict";

  const ACTIVE = new Set(["sending", "queued", "streaming", "stopping", "reconnecting"]);
  const ENDED = new Set(["done", "stopped", "cancelled", "error"]);
  const FIELD_IDS = {
    prompt: "prompt", system_prompt: "system-prompt", model: "model",
    temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens",
  };
  const STORE_KEY = "kog-playground"; // the tab's latest state, where a new history entry starts from
  const ENTRY_PREFIX = "kog-playground:entry:"; // the state of one entry of the tab's history
  const ENTRIES_KEY = "kog-playground:entries"; // those entries' ids, the most recently saved last
  const ENTRIES_KEPT = 20; // a prompt may be 100,000 characters: older entries make room
  const RETRY_MS = [250, 500, 1000, 2000, 3000]; // reconnect delays after each failed try; the last repeats
  const UNREACHABLE_AFTER = 3; // failed reconnects (~1.75 s) before the page calls the server unreachable

  const ui = {};
  let socket = null; // the ws extension's socket wrapper: send() queues while disconnected
  let connection = "connecting"; // connecting | open | closed
  let run = newRun(); // the run the page shows
  // the run whose answer stays on screen while the next one has not produced yet (null once it has)
  let lastRun = null;
  // a generate frame on its way: {frame, at, sent, stopRequested}, until its job id comes back; one
  // asked for while disconnected waits here (sent: false) for the connection
  let request = null;
  let models = {}; // name -> {chat, max_context}, from the latest workers frame
  let conversation = []; // the earlier turns the next prompt follows up on: [{prompt, answer}], oldest first
  let frameRequested = false;
  let persistTimer = null; // a form save waiting for the typing to pause
  let historyEntry = ""; // the id of this entry of the tab's history (its stored state's key)
  let countdownTimer = null; // a rate limit's "try again in N s", counting down
  const retry = { timer: null, count: 0 };

  function newRun() {
    return {
      phase: "idle", jobId: null, lastId: "0-0", note: "", model: "", maxTokens: null,
      chat: false, prompt: "", system: "", context: "", stopRequested: false, restored: false,
      pending: [], text: "", n: 0, t: 0, tFirst: null, queue: null,
      startedAt: 0, endedAt: null, stats: null, outcome: "", outcomeNote: "",
      shown: false, // its output has the pane (from its prefill on)
      replaying: false, // a finished run brought back by a reload, replayed without announcing it
      resuming: false, // a resume was sent after a reconnect; no frame has come back yet
      frozenAt: null, // when the connection dropped: the clock stops there until it is back
    };
  }

  // ---- stream entry ids ("<ms>-<seq>") -------------------------------------------------------------

  function entryAfter(a, b) {
    const [am, as] = a.split("-").map(Number);
    const [bm, bs] = b.split("-").map(Number);
    return am > bm || (am === bm && (as || 0) > (bs || 0));
  }

  // ---- the form, and what survives a reload ------------------------------------------------------

  function formValues() {
    return {
      prompt: ui.prompt.value, system_prompt: ui.system.value, model: ui.model.value,
      temperature: ui.temperature.value, top_p: ui.topP.value, max_tokens: ui.maxTokens.value,
    };
  }

  // Each entry of the tab's history keeps its own state, so that Back to an earlier playground brings its
  // own run back (a share page's "Try it yourself" opens a new entry with other values); the entry's id
  // lives in history.state, which a reload and Back keep. A new entry starts from the tab's latest state.
  function entryId() {
    const state = history.state && typeof history.state === "object" ? history.state : {};
    if (typeof state.kogEntry === "string") return state.kogEntry;
    const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
    history.replaceState({ ...state, kogEntry: id }, "");
    return id;
  }

  function readStore() {
    try {
      const saved = sessionStorage.getItem(ENTRY_PREFIX + historyEntry) || sessionStorage.getItem(STORE_KEY);
      return JSON.parse(saved) || {};
    } catch (err) {
      return {}; // storage disabled or a broken entry: start afresh
    }
  }

  function writeStore(saved) {
    const text = JSON.stringify(saved);
    let entries = [];
    try {
      entries = JSON.parse(sessionStorage.getItem(ENTRIES_KEY)) || [];
    } catch (err) {
      entries = []; // a broken list: its entries stay until the storage is full
    }
    entries = entries.filter((id) => typeof id === "string" && id !== historyEntry);
    entries.push(historyEntry);
    for (const old of entries.slice(0, -ENTRIES_KEPT)) sessionStorage.removeItem(ENTRY_PREFIX + old);
    entries = entries.slice(-ENTRIES_KEPT);
    sessionStorage.setItem(ENTRIES_KEY, JSON.stringify(entries));
    sessionStorage.setItem(ENTRY_PREFIX + historyEntry, text);
    sessionStorage.setItem(STORE_KEY, text);
  }

  function persist() {
    clearTimeout(persistTimer);
    const job = run.jobId && {
      id: run.jobId, model: run.model, chat: run.chat, prompt: run.prompt, system: run.system,
      maxTokens: run.maxTokens,
      startedAt: Date.now() - (performance.now() - run.startedAt), // wall clock: survives the reload
      endedAt: run.endedAt === null ? null : Date.now() - (performance.now() - run.endedAt),
      outcome: run.outcome, note: run.outcomeNote, // a finished run comes back as it ended
    };
    try {
      writeStore({ form: formValues(), job: job || null, conversation });
    } catch (err) {
      // full or disabled storage: a reload then starts afresh, nothing else changes
    }
  }

  // Typing saves the form once it pauses, not at every key (a prompt may be 100,000 characters); a
  // page being left saves at once.
  function persistSoon() {
    clearTimeout(persistTimer);
    persistTimer = setTimeout(persist, 300);
  }

  function restoreForm(form) {
    const fields = {
      prompt: ui.prompt, system_prompt: ui.system, temperature: ui.temperature, top_p: ui.topP,
      max_tokens: ui.maxTokens,
    };
    for (const [name, el] of Object.entries(fields)) {
      if (typeof form[name] === "string") el.value = form[name];
    }
    if (typeof form.model === "string" && form.model) {
      ui.model.dataset.wanted = form.model; // selected once a workers frame lists it
      selectWantedModel();
    }
    if (ui.system.value) ui.systemDetails.open = true;
  }

  // A run that was going (or had ended) when the page reloaded: show it again from its first entry;
  // the server keeps a job's whole event stream for an hour. A finished run comes back quietly, as it
  // ended: its replay is no news to announce, and there is nothing to stop.
  function restoreRun(job) {
    if (!job || typeof job.id !== "string") return;
    const finished = !!job.endedAt && ENDED.has(job.outcome);
    run = Object.assign(newRun(), {
      jobId: job.id, model: job.model || "", chat: !!job.chat, prompt: job.prompt || "",
      system: job.system || "", maxTokens: job.maxTokens ?? null, restored: true, shown: true,
      replaying: finished,
      startedAt: performance.now() - (Date.now() - job.startedAt),
      endedAt: job.endedAt ? performance.now() - (Date.now() - job.endedAt) : null,
    });
    showContext();
    followOutput();
    if (finished) setPhase(job.outcome, typeof job.note === "string" ? job.note : "");
    else setPhase("reconnecting", "restoring the last run…");
  }

  function restoreFromLoad() {
    historyEntry = entryId();
    const saved = readStore();
    if (ui.form.dataset.prefilled === "true") {
      // "Try it yourself" on a share page: its values win (its conversation too), and the address
      // loses ?from= so that a reload keeps what the person types from here on
      history.replaceState(history.state, "", location.pathname);
      setConversation(ui.form.dataset.history ? JSON.parse(ui.form.dataset.history) : []);
    } else {
      if (saved.form) restoreForm(saved.form);
      setConversation(saved.conversation);
      restoreRun(saved.job); // not under a shared conversation: this tab's last run is no part of it
    }
    persist();
  }

  // ---- a conversation ----------------------------------------------------------------------------

  function setConversation(turns) {
    const valid = (turn) => turn && typeof turn.prompt === "string" && typeof turn.answer === "string";
    conversation = Array.isArray(turns) ? turns.filter(valid) : [];
    renderConversation();
  }

  // The earlier turns above the output, each as text; the prompt's label says the next one follows up.
  function renderConversation() {
    const items = [];
    for (const turn of conversation) {
      for (const [speaker, text, model] of [["You", turn.prompt, false], ["Model", turn.answer, true]]) {
        const item = document.createElement("li");
        item.className = "turn";
        const who = document.createElement("span");
        who.className = "turn-speaker";
        who.textContent = speaker;
        const box = document.createElement("pre");
        box.className = "prompt-box";
        if (model) {
          // the model's answer highlighted as it was in the output; the person's prompt stays plain
          const code = document.createElement("code");
          code.className = "hljs";
          box.classList.add("answer-box");
          box.append(code);
          window.kogHighlight.render(code, text);
        } else {
          window.kogHighlight.appendText(box, text);
        }
        item.append(who, box);
        items.push(item);
      }
    }
    ui.conversationTurns.replaceChildren(...items);
    const n = conversation.length;
    const turns = `${n} earlier turn${n === 1 ? "" : "s"}`;
    ui.conversation.hidden = !n;
    ui.conversationNote.hidden = !n;
    // once shown: a hidden list has no height to scroll (a reload, the first Follow up)
    ui.conversationTurns.scrollTop = ui.conversationTurns.scrollHeight; // the latest turn in view
    setText(ui.conversationSummary, `Earlier turns · ${n}`);
    setText(ui.conversationCount, `follows up on ${turns}`);
    const followUpHint = "Ask a follow-up: the model reads the earlier turns.";
    ui.prompt.placeholder = n ? followUpHint : ui.prompt.dataset.placeholder;
    showFollowUp();
  }

  // A chat run that ended with an answer can be followed up on (still after a refused request, which
  // leaves it on screen).
  function showFollowUp() {
    const answered = run.outcome === "done" || run.outcome === "stopped";
    const room = !filledContext(run.stats); // a follow-up on a full context could only be refused
    ui.followUp.hidden = !(answered && room && run.chat && run.text && !request && !ACTIVE.has(run.phase));
  }

  function followUp() {
    if (ui.followUp.hidden) return;
    const typedSince = ui.prompt.value !== run.prompt; // the next question, already typed: it stays
    setConversation([...conversation, { prompt: run.prompt, answer: run.text }]);
    run = Object.assign(newRun(), { shown: true }); // the emptied pane is the next prompt's
    clearOutput();
    showContext();
    setPhase("idle");
    renderCounters(performance.now());
    if (!typedSince) ui.prompt.value = "";
    ui.prompt.focus();
    persist();
  }

  function newChat() {
    if (ACTIVE.has(run.phase) || request) return; // the running answer is built on these turns
    setConversation([]);
    clearPromptError();
    if (run.phase === "error") setPhase("idle"); // what went wrong was the conversation's length
    ui.prompt.focus();
    persist();
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
      history: conversation.length ? conversation : undefined,
    };
  }

  // What the server would refuse in the prompt, said in the page's words before anything is sent (and
  // before 100,000 characters go out for nothing); "" when it is fine.
  function promptProblem() {
    if (!ui.prompt.value.trim()) return "the prompt is blank: write what the model should continue or answer";
    const limit = Number(ui.form.dataset.maxPromptChars);
    const length = Array.from(ui.prompt.value).length; // characters, as Python counts them
    if (!limit || length <= limit) return "";
    const fmt = (n) => n.toLocaleString("en");
    return `the prompt is ${fmt(length)} characters; the limit is ${fmt(limit)}`;
  }

  function onConfigSend(event) {
    if (event.target !== ui.form) return;
    if (ACTIVE.has(run.phase) || request) return event.preventDefault();
    if (event.detail.errors && event.detail.errors.length) {
      ui.form.reportValidity(); // htmx halts the send itself; the browser says which field and why
      return;
    }
    const problem = promptProblem();
    if (problem) {
      event.preventDefault();
      markInvalid("prompt", problem);
      return refuse(problem);
    }
    request = { frame: generateFrame(), at: performance.now(), sent: false };
    if (connection !== "open") {
      // not handed to the extension, whose queue would send it whenever the connection returns (a Stop
      // could not take it back): onOpen sends it, and says so meanwhile
      event.preventDefault();
      setPhase("sending", waitingNote());
      return;
    }
    event.detail.messageBody = JSON.stringify(request.frame);
    setPhase("sending");
    requestRender();
  }

  function waitingNote() {
    const unreachable = retry.count > UNREACHABLE_AFTER;
    return `waiting for the connection${unreachable ? " (the server is unreachable)" : ""} · sends once connected`;
  }

  // A request that waited for the connection goes out now; its clock starts now, not at the click.
  function sendWaitingRequest() {
    socket.send(JSON.stringify(request.frame));
    request.sent = true;
    request.at = performance.now();
    setPhase("sending");
    requestRender();
  }

  function onAfterSend(event) {
    if (event.target === ui.form && request) request.sent = true;
  }

  // The server took the request (its first frame names the job). The last run's answer stays on screen
  // until the new one produces (takePane), so a request the worker refuses leaves it in place.
  function acceptJob(jobId) {
    const { frame, stopRequested } = request;
    lastRun = run;
    run = Object.assign(newRun(), {
      jobId, model: frame.model, chat: !!(models[frame.model] || {}).chat, prompt: frame.prompt,
      system: frame.system_prompt, maxTokens: frame.max_tokens ?? null, startedAt: request.at,
    });
    request = null;
    ui.outputBox.dataset.previous = "true"; // the last answer, waiting for the next: no cursor at its end
    for (const el of document.querySelectorAll(".invalid")) clearInvalid(el);
    clearPromptError();
    setPhase("sending");
    persist();
    if (stopRequested) requestStop(); // Stop was pressed before the job had an id: it stops now
  }

  // The new run produces (its prefill is done): its output replaces the last answer, with what
  // belonged to that one (its stats, Copy, share link).
  function takePane() {
    if (run.shown) return;
    run.shown = true;
    lastRun = null;
    delete ui.outputBox.dataset.previous;
    clearOutput();
    showContext();
    followOutput();
    // only now: a refused request leaves the page where it was, at the field it names (on a phone, far above)
    revealOutput();
  }

  // The new run ended before producing anything (refused by its worker, lost, stopped while queued): the
  // last answer, still on screen, is the page's run again, with its counters; the state says what happened.
  function restoreLastRun(phase, note) {
    if (!lastRun) return finish(phase, note);
    run = lastRun;
    lastRun = null;
    delete ui.outputBox.dataset.previous;
    setPhase(phase, note);
    renderCounters(performance.now());
    showFollowUp();
    persist();
  }

  // The output pane emptied for the next run, with what belonged to the last one (its stats and buttons).
  function clearOutput() {
    ui.output.replaceChildren();
    delete ui.output.dataset.streamCheck;
    delete ui.output.dataset.language;
    ui.finalStats.hidden = true;
    ui.copy.hidden = true;
    ui.copyCode.hidden = true;
    ui.shareActions.hidden = true;
  }

  function requestStop() {
    if (request && !request.sent) {
      // it waits for the connection: it is simply not sent
      request = null;
      return setPhase("cancelled", "not sent");
    }
    if (request) {
      // the request is on its way and its job has no id yet: stop it the moment the id comes back
      request.stopRequested = true;
      return setPhase("stopping");
    }
    if (!run.jobId || !ACTIVE.has(run.phase) || run.stopRequested) return;
    run.stopRequested = true;
    if (connection === "open") {
      socket.send(JSON.stringify({ type: "stop" }));
      setPhase("stopping");
    } else {
      // sent after the resume that follows the reconnect: a stop sent before it would reach a
      // socket that follows no job, and the run would carry on
      setPhase("stopping", "stops once reconnected");
    }
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
      if (request && frame.job_id !== run.jobId) acceptJob(frame.job_id);
      if (frame.job_id !== run.jobId) return; // a frame of an earlier run
      run.frozenAt = null; // the run's clock is live again
    } else if (frame.type === "error") {
      return requestError(frame);
    }
    if (frame.id) {
      if (!entryAfter(frame.id, run.lastId)) return; // already applied before a reconnect
      run.lastId = frame.id;
    }
    const resumed = run.resuming; // the server took the resume: this is its first frame back
    run.resuming = false;
    // Once Stop is pressed the state says so until the run ends, whatever frames are still on the way;
    // a finished run replayed after a reload keeps saying how it ended.
    const follow = (phase, note) => run.stopRequested || run.replaying || setPhase(phase, note);
    switch (frame.type) {
      case "queue":
        run.queue = frame.position;
        if (frame.position === null) follow("queued", "starting…");
        else if (frame.workers === 0) follow("queued", "waiting for a worker to start");
        else follow("queued", frame.position === 0 ? "next in line" : `${frame.position} ahead`);
        break;
      case "started":
        run.queue = 0;
        follow("streaming", "prefilling…");
        break;
      case "prefilled":
        takePane();
        follow("streaming", `${frame.prompt_tokens} prompt tokens`);
        break;
      case "delta":
        takePane();
        run.pending.push(frame.text);
        run.text += frame.text;
        run.n = frame.n;
        run.t = frame.t;
        run.tFirst = frame.t_first;
        if (run.phase !== "streaming" || resumed) follow("streaming", resumed ? "resumed" : "");
        requestRender();
        break;
      case "done":
        if (frame.stats || run.shown) finishDone(frame);
        else restoreLastRun("cancelled", finishNote(frame)); // stopped before it started
        break;
      case "error":
        if (run.shown) finish("error", errorNote(frame));
        else restoreLastRun("error", errorNote(frame)); // refused by its worker, or lost before it produced
        break;
    }
  }

  function requestError(frame) {
    // A refused request (bad field, busy, queue full) or a broken frame: the socket stays usable.
    if (frame.param) markInvalid(frame.param, frame.message);
    if (request) {
      request = null;
      if (frame.code === "rate_limited" && frame.retry_after_s > 0) return refuseUntil(frame);
      return refuse(frame.message);
    }
    const followed = run.jobId && (ACTIVE.has(run.phase) || run.replaying);
    if (frame.code === "unknown_job" && followed) return loseRun();
    flashNote(frame.message);
  }

  // The request never became a job: the last run stays on screen, the state says why.
  function refuse(message) {
    setPhase("error", message);
    renderCounters(performance.now());
  }

  // A rate limit's "try again in N s" counts down to "you can try again now", so that it stays true.
  // Screen readers hear the first words and the last: aria-busy holds the ticks in between back.
  function refuseUntil(frame) {
    const words = frame.message.replace(/;?\s*try again in \d+ s\.?$/, ""); // playground/limits.py's wording
    const until = performance.now() + 1000 * frame.retry_after_s;
    const tick = () => {
      const left = Math.ceil((until - performance.now()) / 1000);
      if (left > 0) {
        ui.state.setAttribute("aria-busy", "true"); // before the text changes
        run.note = `${words}; try again in ${left} s`;
        countdownTimer = setTimeout(tick, until - performance.now() - (left - 1) * 1000);
      } else {
        ui.state.removeAttribute("aria-busy");
        run.note = `${words}; you can try again now`;
      }
      showState();
    };
    refuse(`${words}; try again in ${frame.retry_after_s} s`);
    countdownTimer = setTimeout(tick, 1000);
  }

  // The server no longer has the run this page follows: it restarted and lost its jobs, or a run restored
  // after a reload has expired (a finished run's events are kept for an hour).
  function loseRun() {
    const lost = "the run was lost: the server no longer has it (it may have restarted)";
    if (!run.shown) return restoreLastRun("error", lost); // it had produced nothing: the last answer stays
    if (!run.text && run.restored) {
      run = newRun();
      clearOutput();
      showContext();
      setPhase("idle");
      renderCounters(performance.now());
      persist();
      flashNote("the last run is no longer on the server (it expired, or the server restarted)");
      return;
    }
    // a run the page was following live: what it showed stays, to read and copy
    finish("error", run.text ? `${lost} · partial output kept` : lost);
    persist();
  }

  // The field a refusal names, in view and focused; what is wrong with the prompt (or the conversation it
  // follows up on) is said under it too, where a phone shows it (the status line is far below there).
  function markInvalid(param, message) {
    const aboutHistory = param.startsWith("history"); // the earlier turns: no field of their own
    if ((param === "prompt" || aboutHistory) && message) showPromptError(message);
    const field = document.getElementById(aboutHistory ? "prompt" : FIELD_IDS[param] || "");
    if (!field) return;
    if (!aboutHistory) {
      field.classList.add("invalid");
      field.setAttribute("aria-invalid", "true"); // its words: #prompt-error (aria-describedby)
    }
    field.focus({ preventScroll: true });
    field.scrollIntoView({ block: "nearest" });
    if (!ui.promptError.hidden) ui.promptError.scrollIntoView({ block: "nearest" }); // just below the prompt
  }

  function clearInvalid(field) {
    field.classList.remove("invalid");
    field.removeAttribute("aria-invalid");
  }

  function showPromptError(message) {
    ui.promptError.textContent = message;
    ui.promptError.hidden = false;
  }

  function clearPromptError() {
    ui.promptError.hidden = true;
    ui.promptError.textContent = "";
  }

  function finishNote(frame) {
    const stats = frame.stats;
    if (frame.finish_reason === "cancelled") {
      if (!stats) return "before it started";
      return run.text ? "partial output kept" : "before any output";
    }
    if (frame.finish_reason === "stop") return "end of answer";
    if (frame.finish_reason !== "length") return frame.finish_reason;
    // The worker reports "length" for both limits; the tokens tell which one it was.
    if (filledContext(stats)) return `context full · ${filledContext(stats).toLocaleString("en")} tokens`;
    return "reached max tokens";
  }

  // The model's context, when the run's prompt and answer filled it (0 when they did not).
  function filledContext(stats) {
    const context = (models[run.model] || {}).max_context;
    return stats && context && stats.prompt_tokens + stats.completion_tokens >= context ? context : 0;
  }

  // A prompt (or a conversation) that the model's context cannot hold, said beside the prompt too, with the
  // way out. The worker names the API's field ("messages"), which the page does not have.
  function errorNote(frame) {
    const message = frame.message || frame.code;
    if (frame.code !== "context_length_exceeded") return message;
    const named = frame.param && message.startsWith(`${frame.param}: `);
    const detail = named ? message.slice(frame.param.length + 2) : message;
    if (!conversation.length) {
      markInvalid("prompt", `prompt: ${detail}`);
      return `prompt: ${detail}`;
    }
    const note = `the conversation no longer fits: ${detail}`;
    markInvalid("history", `${note}. New chat (or a shorter prompt) makes room.`);
    return `${note} · New chat (or a shorter prompt) makes room`;
  }

  function finishDone(frame) {
    takePane();
    flushPending();
    // The server's copy is the reference; the check is kept on the element for tests and benchmarks.
    ui.output.dataset.streamCheck = frame.text === run.text ? "ok" : "mismatch";
    run.text = frame.text;
    run.stats = frame.stats;
    if (frame.stats) run.n = frame.stats.completion_tokens;
    let phase = "done";
    if (frame.finish_reason === "cancelled") phase = frame.stats ? "stopped" : "cancelled";
    finish(phase, finishNote(frame));
    window.kogHighlight.render(ui.output, run.text, { context: showContext(), contextElement: ui.context });
    showFinalStats(frame.stats);
    ui.copy.hidden = !run.text;
    ui.copyCode.hidden = !window.kogHighlight.fencedCode(run.text); // an answer in words around its code
    if (typeof frame.share_url === "string" && frame.share_url.startsWith("/g/")) {
      ui.share.href = frame.share_url;
      ui.shareActions.hidden = false;
    }
    persist();
  }

  function finish(phase, note) {
    flushPending();
    if (run.endedAt === null) run.endedAt = run.frozenAt ?? performance.now();
    run.restored = false;
    run.replaying = false;
    run.resuming = false;
    run.outcome = phase;
    run.outcomeNote = note || "";
    setPhase(phase, note);
    renderCounters(run.endedAt);
    ui.copy.hidden = !run.text; // a run that failed midway (its worker lost) keeps its text, to copy too
  }

  // ---- connection ------------------------------------------------------------------------------

  // htmx's ws extension reconnects only after some close codes, on a jittered backoff that grows to
  // 64 s, with a timer nothing can cut short. The page keeps that schedule itself: its sockets report
  // every close to htmx as a normal one (so htmx schedules nothing), and scheduleReconnect() retries
  // within a few seconds, at once when the network comes back, the tab is shown, or Retry is clicked.
  function createSocket(url) {
    const ws = new WebSocket(url, []);
    ws.binaryType = window.htmx.config.wsBinaryType;
    Object.defineProperty(ws, "onclose", {
      set(handler) {
        ws.addEventListener("close", (event) =>
          handler(new CloseEvent("close", { code: 1000, reason: event.reason, wasClean: event.wasClean })),
        );
      },
    });
    connection = "connecting";
    if (ui.retry) ui.retry.hidden = true;
    return ws;
  }

  function scheduleReconnect() {
    clearTimeout(retry.timer);
    retry.timer = setTimeout(reconnectNow, RETRY_MS[Math.min(retry.count, RETRY_MS.length - 1)]);
    retry.count += 1;
  }

  function reconnectNow() {
    clearTimeout(retry.timer);
    retry.timer = null;
    if (connection !== "closed" || !socket) return; // one socket at a time
    socket.reconnect();
  }

  function onOpen(event) {
    socket = event.detail.socketWrapper;
    clearTimeout(retry.timer);
    retry.count = 0;
    setConnection("open");
    if (request) {
      // one that waited for the connection goes out now; one that went out before the drop never got
      // its job id back, so there is nothing to resume
      if (!request.sent) return sendWaitingRequest();
      request = null;
      return refuse("the connection dropped before the job started; please try again");
    }
    if (!run.jobId || !(ACTIVE.has(run.phase) || run.replaying)) return;
    socket.send(JSON.stringify({ type: "resume", job_id: run.jobId, after: run.lastId }));
    // "resumed" is said once the server answers with the run's next frame (onMessage), not before: it may
    // no longer have the run (a restart)
    run.resuming = !run.restored;
    if (run.stopRequested) {
      socket.send(JSON.stringify({ type: "stop" }));
      setPhase("stopping");
    } else if (run.resuming) {
      setPhase("reconnecting", "resuming the run…");
    }
  }

  function onClose(event) {
    socket = event.detail.socketWrapper;
    setConnection("closed");
    scheduleReconnect();
    showConnectionLost(retry.count > UNREACHABLE_AFTER);
  }

  // While the socket is down (and its retries go on in the background): the run's clock stops, since the
  // page cannot tell how the run goes, what arrived can be copied, and the words say what happens next.
  function showConnectionLost(unreachable) {
    setText(ui.workerText, unreachable ? "server unreachable · retrying" : "connection lost · reconnecting");
    const lost = unreachable ? "the server is unreachable" : "connection lost";
    if (request && !request.sent) return setPhase("sending", waitingNote());
    if (request) return setPhase("reconnecting", lost); // sent, and no job id came back: onOpen says so
    if (!run.jobId || !ACTIVE.has(run.phase)) return;
    if (run.frozenAt === null) run.frozenAt = performance.now();
    if (run.shown) ui.copy.hidden = !run.text;
    if (run.stopRequested) setPhase("stopping", `${lost} · stops once reconnected`);
    else if (!run.restored) setPhase("reconnecting", unreachable ? `${lost} · still trying` : lost);
  }

  function setConnection(state) {
    connection = state;
    ui.app.dataset.connected = state === "open" ? "true" : "false";
    ui.retry.hidden = state !== "closed";
    if (state !== "open") {
      ui.workerStatus.dataset.up = "false";
      if (state === "connecting") setText(ui.workerText, "connecting…");
      setText(ui.workerBusy, "");
    }
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
    window.kogHighlight.appendText(ui.output, run.pending.join(""));
    run.pending = [];
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  // A new run starts at the foot of the box, where its text streams in: a long prompt shown before a
  // completion would otherwise fill the box, and the output would stream unseen below it.
  function followOutput() {
    ui.outputBox.scrollTop = ui.outputBox.scrollHeight;
  }

  // The text the model continued, shown dimmed before its output (and copied with it): a completion
  // model's answer is runnable only after its prompt. Returns that text ("" when there is none).
  function showContext() {
    const context = window.kogHighlight.promptContext(run);
    ui.context.replaceChildren();
    window.kogHighlight.appendText(ui.context, context);
    ui.copy.title = context ? "Copies the prompt and the completion, as shown" : "Copies the output";
    return context;
  }

  // On a one-column layout (a phone) the output sits below the form: bring it into view on start,
  // its foot (where the newest lines stream in) just above the run bar that holds Stop and the speed.
  function revealOutput() {
    if (!window.matchMedia("(max-width: 900px)").matches) return;
    const box = ui.outputBox.getBoundingClientRect();
    const topbar = document.querySelector(".topbar").getBoundingClientRect().bottom;
    if (box.top >= topbar && box.bottom <= ui.actions.getBoundingClientRect().top) return;
    const reduced = window.matchMedia("(prefers-reduced-motion: reduce)").matches;
    ui.outputBox.scrollIntoView({ block: "end", behavior: reduced ? "auto" : "smooth" });
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
    setText(ui.runTokS, ui.tokS.textContent); // the phone's run bar
    setText(ui.runTokens, String(run.n));
    if (s && s.ttft_ms) setText(ui.ttft, s.ttft_ms.toFixed(0));
    else setText(ui.ttft, run.tFirst === null ? "–" : (run.tFirst * 1000).toFixed(0));
    setText(ui.tokens, String(run.n));
    setText(ui.queue, run.phase === "queued" && run.queue !== null ? String(run.queue) : "–");
    const clock = run.endedAt ?? run.frozenAt ?? now; // stopped while the connection is down
    setText(ui.elapsed, run.startedAt ? ((clock - run.startedAt) / 1000).toFixed(2) : "–");
  }

  function showFinalStats(stats) {
    if (!stats) return;
    const ms = (v) => (v >= 1000 ? (v / 1000).toFixed(2) + " s" : v.toFixed(1) + " ms");
    setText(ui.statPromptTokens, `${stats.prompt_tokens} tokens`);
    // the wait for a worker comes before the worker's own clock starts: the first token's time leaves it out
    const queued = typeof stats.queue_ms === "number";
    ui.queueRow.hidden = !queued;
    if (queued) setText(ui.statQueue, ms(stats.queue_ms));
    setText(ui.statPrefill, ms(stats.prefill_ms));
    setText(ui.statTtft, ms(stats.ttft_ms));
    // one token has no decode rate (the rate counts the gaps after the first)
    const rate = stats.decode_tok_s > 0 ? `${formatRate(stats.decode_tok_s)} tok/s` : "–";
    const n = stats.completion_tokens;
    setText(ui.statDecode, `${rate} · ${n} token${n === 1 ? "" : "s"}`);
    setText(ui.statTotal, ms(stats.total_ms));
    const peak = stats.peak_bandwidth_gbs;
    ui.bandwidthRow.hidden = !peak;
    if (peak) {
      const pct = (100 * stats.bandwidth_gbs) / peak;
      setText(ui.statBandwidth, `${stats.bandwidth_gbs.toFixed(0)} GB/s · ${pct.toFixed(0)}% of peak`);
    }
    ui.finalStats.hidden = false;
  }

  const PHASE_LABELS = {
    idle: "Ready", sending: "Sending…", queued: "Queued", streaming: "Streaming", stopping: "Stopping…",
    reconnecting: "Reconnecting", done: "Done", stopped: "Stopped", cancelled: "Cancelled", error: "Error",
  };

  function setPhase(phase, note) {
    stopCountdown();
    run.phase = phase;
    run.note = note || "";
    showState();
    const active = ACTIVE.has(phase);
    const focused = document.activeElement;
    ui.generate.disabled = active;
    ui.stop.disabled = !active || phase === "stopping" || !(run.jobId || request);
    ui.newChat.disabled = active || !!request; // the running answer is built on the earlier turns
    // before the focus moves: on a phone the run bar hides Generate, which cannot take the focus while hidden
    ui.app.dataset.phase = phase;
    ui.app.dataset.active = active ? "true" : "false"; // shows the phone's run bar
    passFocus(focused);
    showFollowUp();
  }

  // The status line (a live region): written only where it changes, the same state twice is no news.
  function showState() {
    if (ui.state.dataset.state !== run.phase) ui.state.dataset.state = run.phase;
    const label = PHASE_LABELS[run.phase];
    setText(ui.state, run.note ? `${label} · ${run.note}` : label);
  }

  function stopCountdown() {
    clearTimeout(countdownTimer);
    countdownTimer = null;
    ui.state.removeAttribute("aria-busy");
  }

  // A focused button that gets disabled drops the keyboard focus (and a screen reader's place) to the
  // top of the page: Generate hands it to Stop, and Stop back to Generate, once that one is enabled.
  let focusHeir = null;
  function passFocus(focused) {
    if (focused === ui.generate && ui.generate.disabled) focusHeir = ui.stop;
    else if (focused === ui.stop && ui.stop.disabled) focusHeir = ui.generate;
    const now = document.activeElement;
    const lost = !now || now === document.body || now.disabled;
    if (!focusHeir || focusHeir.disabled || !lost) return;
    const heir = focusHeir;
    focusHeir = null;
    heir.focus({ preventScroll: true }); // the page stays where the person reads (a phone's output, far below)
  }

  let noteTimer = null;
  function flashNote(message) {
    ui.note.textContent = message;
    ui.note.hidden = false;
    clearTimeout(noteTimer);
    noteTimer = setTimeout(() => (ui.note.hidden = true), 6000);
  }

  // ---- workers and models ------------------------------------------------------------------------

  function showWorkers(frame) {
    ui.workerStatus.dataset.up = frame.up ? "true" : "false";
    let text = frame.error || "no worker up";
    if (frame.up) {
      text = `${frame.count} worker${frame.count === 1 ? "" : "s"} up · ${frame.devices.join(", ")}`;
    }
    setText(ui.workerText, text);
    setText(ui.workerBusy, frame.up && frame.busy ? ` · ${frame.busy} busy` : "");
    models = Object.fromEntries(frame.models.map((m) => [m.name, m]));
    showModels(frame.models.map((m) => m.name));
    updateTokenLimit();
  }

  function showModels(names) {
    const current = Array.from(ui.model.options).filter((o) => !o.disabled).map((o) => o.value);
    if (names.join("\n") === current.join("\n")) return selectWantedModel();
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
    selectWantedModel();
  }

  // The model a reload or a share link asked for, as soon as a worker serves it.
  function selectWantedModel() {
    const wanted = ui.model.dataset.wanted;
    if (!wanted || !Array.from(ui.model.options).some((o) => o.value === wanted)) return;
    ui.model.value = wanted;
    delete ui.model.dataset.wanted;
    updateTokenLimit();
  }

  // A model's context holds the prompt and the answer: max tokens can be at most one less, and the
  // field says so while it is over.
  function updateTokenLimit() {
    const serverMax = Number(ui.form.dataset.maxNewTokens);
    const context = (models[ui.model.value] || {}).max_context;
    const cap = context ? Math.min(serverMax, context - 1) : serverMax;
    ui.maxTokens.max = String(cap);
    const over = Number(ui.maxTokens.value) > cap;
    ui.maxTokens.classList.toggle("over", over);
    const limited = context && context - 1 < serverMax;
    ui.tokenHint.hidden = !limited;
    ui.tokenHint.classList.toggle("warn", over);
    if (limited) {
      const fmt = (n) => n.toLocaleString("en");
      setText(ui.tokenHint, `${ui.model.value} reads ${fmt(context)} tokens, prompt and output together:`
        + ` max tokens ≤ ${fmt(cap)}${over ? "" : ", fewer with a long prompt"}.`);
    } else {
      setText(ui.tokenHint, ""); // hidden, and no stale description of Max tokens (aria-describedby)
    }
  }

  // ---- copying -----------------------------------------------------------------------------------

  // The run whose answer the pane shows: the last one until the next has produced.
  function runOnScreen() {
    return run.shown || !lastRun ? run : lastRun;
  }

  function copyOutput() {
    window.kogClipboard.copy(ui.context.textContent + runOnScreen().text).then((ok) => {
      if (ok) return window.kogClipboard.flash(ui.copy, "Copied");
      // last resort: select the text so that Ctrl+C copies it
      const range = document.createRange();
      range.selectNodeContents(ui.outputBox);
      window.getSelection().removeAllRanges();
      window.getSelection().addRange(range);
      window.kogClipboard.flash(ui.copy, "Press Ctrl+C");
    });
  }

  function copyCode() {
    window.kogClipboard.copy(window.kogHighlight.fencedCode(runOnScreen().text)).then((ok) => {
      window.kogClipboard.flash(ui.copyCode, ok ? "Copied" : "Copy failed: select it");
    });
  }

  function copyShareLink() {
    const url = new URL(ui.share.getAttribute("href"), location.href).href;
    window.kogClipboard.copy(url).then((ok) => {
      window.kogClipboard.flash(ui.copyLink, ok ? "Link copied" : "Copy failed: use Open");
    });
  }

  // ---- keys --------------------------------------------------------------------------------------

  function onFormKey(event) {
    if (event.key !== "Enter") return;
    if (event.ctrlKey || event.metaKey) {
      event.preventDefault();
      ui.form.requestSubmit();
    } else if (event.target instanceof HTMLInputElement) {
      // Enter in a number (temperature, top-p, max tokens) would submit the form: someone adjusting a value
      // means no run by it; Ctrl/Cmd+Enter generates from there as from any field
      event.preventDefault();
    }
  }

  // The shortcut Generate shows, in the platform's words: ⌘ on a Mac, an iPad or an iPhone.
  function showShortcut() {
    const platforms = [navigator.userAgentData && navigator.userAgentData.platform, navigator.platform];
    const apple = platforms.some((name) => /mac|iphone|ipad|ipod/i.test(name || ""));
    if (apple) ui.shortcutKey.textContent = "⌘";
  }

  function onDocumentKey(event) {
    if (event.key !== "Escape" || event.defaultPrevented) return;
    if (!request && !(run.jobId && ACTIVE.has(run.phase))) return;
    event.preventDefault();
    requestStop();
  }

  // ---- wiring ----------------------------------------------------------------------------------

  if (window.htmx) window.htmx.createWebSocket = createSocket; // before htmx opens the first socket

  document.addEventListener("DOMContentLoaded", function () {
    const ids = {
      app: "app", form: "prompt-form", prompt: "prompt", system: "system-prompt",
      systemDetails: "system-details", model: "model", temperature: "temperature", topP: "top-p",
      maxTokens: "max-tokens", tokenHint: "token-hint", generate: "generate", stop: "stop",
      actions: "actions", runTokS: "run-tok-s", runTokens: "run-tokens",
      result: "result", output: "output", context: "output-context", outputBox: "output-box",
      state: "state", note: "note", retry: "retry", tokS: "tok-s", ttft: "ttft", tokens: "tokens",
      queue: "queue", elapsed: "elapsed", copy: "copy", shareActions: "share-actions", share: "share",
      copyLink: "copy-link", copyCode: "copy-code", finalStats: "final-stats", statPromptTokens: "stat-prompt-tokens",
      statPrefill: "stat-prefill", statTtft: "stat-ttft", statDecode: "stat-decode", statTotal: "stat-total",
      statBandwidth: "stat-bandwidth", bandwidthRow: "stat-bandwidth-row", statQueue: "stat-queue",
      queueRow: "stat-queue-row",
      workerStatus: "worker-status", workerText: "worker-text",
      workerBusy: "worker-busy", followUp: "follow-up", newChat: "new-chat", conversation: "conversation",
      conversationTurns: "conversation-turns", conversationSummary: "conversation-summary",
      conversationNote: "conversation-note", conversationCount: "conversation-count",
      promptError: "prompt-error", shortcutKey: "shortcut-key",
    };
    for (const [key, id] of Object.entries(ids)) ui[key] = document.getElementById(id);
    if (!ui.app) return;
    ui.prompt.dataset.placeholder = ui.prompt.placeholder;
    showShortcut();

    ui.form.addEventListener("submit", (event) => event.preventDefault()); // htmx sends it over the socket
    ui.form.addEventListener("keydown", onFormKey);
    ui.form.addEventListener("input", (event) => {
      clearInvalid(event.target);
      if (run.phase === "error" && !request) setPhase("idle"); // what was refused is being changed
      if (event.target === ui.prompt) clearPromptError();
      if (event.target === ui.maxTokens) updateTokenLimit();
      persistSoon();
    });
    window.addEventListener("pagehide", persist);
    ui.model.addEventListener("change", () => {
      delete ui.model.dataset.wanted;
      updateTokenLimit();
      persist();
    });
    document.addEventListener("keydown", onDocumentKey);
    document.addEventListener("focusin", () => (focusHeir = null)); // the person went somewhere else
    ui.stop.addEventListener("click", requestStop);
    ui.copy.addEventListener("click", copyOutput);
    ui.copyCode.addEventListener("click", copyCode);
    ui.copyLink.addEventListener("click", copyShareLink);
    ui.followUp.addEventListener("click", followUp);
    ui.newChat.addEventListener("click", newChat);
    ui.retry.addEventListener("click", reconnectNow);
    window.addEventListener("online", reconnectNow);
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState === "visible") reconnectNow();
    });

    ui.app.addEventListener("htmx:wsConfigSend", onConfigSend);
    ui.app.addEventListener("htmx:wsAfterSend", onAfterSend);
    ui.app.addEventListener("htmx:wsBeforeMessage", onMessage);
    ui.app.addEventListener("htmx:wsOpen", onOpen);
    ui.app.addEventListener("htmx:wsClose", onClose);
    setConnection("connecting");
    setPhase("idle");
    restoreFromLoad();
    updateTokenLimit();
    renderCounters(performance.now());
  });
})();

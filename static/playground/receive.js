/*
 * What arrives on the socket, and a run's course from its job id to its end. Every stream frame has an
 * entry id ("<ms>-<seq>"): the page applies each id once and in order, so that the entries a resume sends
 * again after a reconnect are not applied twice.
 *
 * A new run takes the output pane only once it produces (its prefill): until then the last answer stays
 * (kogPage.state.lastRun), and a request the worker refuses (a prompt over the context) leaves it in place.
 *
 * Exposes kogPage.receive:
 *   onMessage(event)       htmx:wsBeforeMessage: applies a frame
 *   refuse(message)        a request that never became a job: the status line says why
 *   filledContext(stats)   the model's context, when the run's prompt and answer filled it (0 when not)
 */
(function () {
  "use strict";

  const page = window.kogPage;
  const state = page.state;
  const ui = page.ui;

  // ---- stream entry ids ("<ms>-<seq>") -------------------------------------------------------------

  function entryAfter(a, b) {
    const [am, as] = a.split("-").map(Number);
    const [bm, bs] = b.split("-").map(Number);
    return am > bm || (am === bm && (as || 0) > (bs || 0));
  }

  // ---- frames ------------------------------------------------------------------------------------

  function onMessage(event) {
    event.preventDefault(); // JSON frames, not HTML for htmx to swap
    let frame;
    try {
      frame = JSON.parse(event.detail.message);
    } catch (err) {
      return;
    }
    if (frame.type === "workers") {
      if (state.turnedAway) page.connection.taken(); // the server keeps this socket: it sends its workers first
      return page.view.showWorkers(frame);
    }
    if (frame.job_id) {
      if (state.request && frame.job_id !== state.run.jobId) acceptJob(frame.job_id);
      if (frame.job_id !== state.run.jobId) return; // a frame of an earlier run
      state.run.frozenAt = null; // the run's clock is live again
    } else if (frame.type === "error") {
      return requestError(frame);
    }
    const run = state.run; // the run this frame belongs to (acceptJob above may have just made it)
    if (frame.id) {
      if (!entryAfter(frame.id, run.lastId)) return; // already applied before a reconnect
      run.lastId = frame.id;
    }
    const resumed = run.resuming; // the server took the resume: this is its first frame back
    run.resuming = false;
    // Once Stop is pressed the state says so until the run ends, whatever frames are still on the way;
    // a finished run replayed after a reload keeps saying how it ended.
    const follow = (phase, note) => run.stopRequested || run.replaying || page.view.setPhase(phase, note);
    switch (frame.type) {
      case "queue":
        run.queue = frame.position;
        run.queueOverdueAt = null;
        if (frame.position === null) follow("queued", "starting…");
        else if (frame.workers === 0) follow("queued", "waiting for a worker to start");
        else {
          // the server's estimate from the model's measured job length, when it has one
          const wait = frame.wait_s == null ? "" : `, about ${Math.max(1, Math.round(frame.wait_s))} s`;
          follow("queued", (frame.position === 0 ? "next in line" : `${frame.position} ahead`) + wait);
          // an average job's length: the meters' clock says so once the wait outruns it (view.js)
          run.queueOverdueAt = frame.wait_s == null ? null : performance.now() + 1000 * frame.wait_s;
        }
        break;
      case "started":
        run.queue = 0;
        follow("streaming", "prefilling…");
        break;
      case "prefilled": {
        takePane();
        // cached: tokens an earlier request's KV cache held, which the worker did not prefill again
        const cached = frame.cached_tokens > 0 ? `, ${frame.cached_tokens} cached` : "";
        follow("streaming", `${frame.prompt_tokens} prompt tokens${cached}`);
        break;
      }
      case "delta":
        takePane();
        run.pending.push(frame.text);
        run.text += frame.text;
        run.n = frame.n;
        run.t = frame.t;
        run.tFirst = frame.t_first;
        run.steps = frame.steps || 0;
        run.draftN = frame.draft_n || 0;
        run.draftAccepted = frame.draft_n_accepted || 0;
        if (run.phase !== "streaming" || resumed) follow("streaming", resumed ? "resumed" : "");
        page.view.requestRender();
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

  // ---- a run, from its job id to its end ---------------------------------------------------------

  // The server took the request (its first frame names the job). The last run's answer stays on screen
  // until the new one produces (takePane), so a request the worker refuses leaves it in place.
  function acceptJob(jobId) {
    const { frame, stopRequested } = state.request;
    state.lastRun = state.run;
    const fim = typeof frame.suffix === "string"; // code completion: the middle between prompt and suffix
    state.run = Object.assign(page.newRun(), {
      jobId, model: frame.model, chat: !fim && !!(state.models[frame.model] || {}).chat, prompt: frame.prompt,
      system: fim ? "" : frame.system_prompt, suffix: fim ? frame.suffix : null,
      maxTokens: frame.max_tokens ?? null, startedAt: state.request.at,
    });
    state.request = null;
    ui.outputBox.dataset.previous = "true"; // the last answer, waiting for the next: no cursor at its end
    for (const el of document.querySelectorAll(".invalid")) page.view.clearInvalid(el);
    page.view.clearPromptError();
    page.view.setPhase("sending");
    page.store.persist();
    if (stopRequested) page.send.requestStop(); // Stop was pressed before the job had an id: it stops now
  }

  // The new run produces (its prefill is done): its output replaces the last answer, with what
  // belonged to that one (its stats, Copy, share link).
  function takePane() {
    if (state.run.shown) return;
    state.run.shown = true;
    state.lastRun = null;
    delete ui.outputBox.dataset.previous;
    page.view.clearOutput();
    page.view.showContext();
    page.view.followOutput();
    // only now: a refused request leaves the page where it was, at the field it names (on a phone, far above)
    page.view.revealOutput();
  }

  // The new run ended before producing anything (refused by its worker, lost, stopped while queued): the
  // last answer, still on screen, is the page's run again, with its counters; the state says what happened.
  function restoreLastRun(phase, note) {
    if (!state.lastRun) return finish(phase, note);
    state.run = state.lastRun;
    state.lastRun = null;
    delete ui.outputBox.dataset.previous;
    page.view.setPhase(phase, note);
    page.view.renderCounters(performance.now());
    page.conversation.showFollowUp();
    page.store.persist();
  }

  function finishDone(frame) {
    const run = state.run;
    takePane();
    page.view.flushPending();
    // The server's copy is the reference; the check is kept on the element for tests and benchmarks.
    ui.output.dataset.streamCheck = frame.text === run.text ? "ok" : "mismatch";
    run.text = frame.text;
    run.stats = frame.stats;
    if (frame.stats) run.n = frame.stats.completion_tokens;
    let phase = "done";
    if (frame.finish_reason === "cancelled") phase = frame.stats ? "stopped" : "cancelled";
    finish(phase, finishNote(frame));
    window.kogHighlight.render(ui.output, run.text, { context: page.view.showContext(), contextElement: ui.context });
    page.view.showFinalStats(frame.stats);
    ui.copy.hidden = !run.text;
    ui.copyCode.hidden = !window.kogHighlight.fencedCode(run.text); // an answer in words around its code
    if (typeof frame.share_url === "string" && frame.share_url.startsWith("/g/")) {
      ui.share.href = frame.share_url;
      ui.shareActions.hidden = false;
    }
    page.store.persist();
  }

  function finish(phase, note) {
    const run = state.run;
    page.view.flushPending();
    if (run.endedAt === null) run.endedAt = run.frozenAt ?? performance.now();
    run.restored = false;
    run.replaying = false;
    run.resuming = false;
    run.outcome = phase;
    run.outcomeNote = note || "";
    page.view.setPhase(phase, note);
    page.view.renderCounters(run.endedAt);
    ui.copy.hidden = !run.text; // a run that failed midway (its worker lost) keeps its text, to copy too
  }

  function finishNote(frame) {
    const stats = frame.stats;
    if (frame.finish_reason === "cancelled") {
      if (!stats) return "before it started";
      return state.run.text ? "partial output kept" : "before any output";
    }
    if (frame.finish_reason === "stop") return "end of answer";
    if (frame.finish_reason !== "length") return frame.finish_reason;
    // The worker reports "length" for both limits; the tokens tell which one it was.
    if (filledContext(stats)) return `context full · ${filledContext(stats).toLocaleString("en")} tokens`;
    return "reached max tokens";
  }

  // The model's context, when the run's prompt and answer filled it (0 when they did not).
  function filledContext(stats) {
    const context = (state.models[state.run.model] || {}).max_context;
    return stats && context && stats.prompt_tokens + stats.completion_tokens >= context ? context : 0;
  }

  // A prompt (or a conversation) that the model's context cannot hold, said beside the prompt too, with the
  // way out. The worker names the API's field ("messages"), which the page does not have.
  function errorNote(frame) {
    const message = frame.message || frame.code;
    if (frame.code !== "context_length_exceeded") return message;
    const named = frame.param && message.startsWith(`${frame.param}: `);
    const detail = named ? message.slice(frame.param.length + 2) : message;
    if (!state.conversation.length) {
      page.view.markInvalid("prompt", `prompt: ${detail}`);
      return `prompt: ${detail}`;
    }
    const note = `the conversation no longer fits: ${detail}`;
    page.view.markInvalid("history", `${note}. New chat (or a shorter prompt) makes room.`);
    return `${note} · New chat (or a shorter prompt) makes room`;
  }

  // The server no longer has the run this page follows: it restarted and lost its jobs, or a run restored
  // after a reload has expired (a finished run's events are kept for an hour).
  function loseRun() {
    const lost = "the run was lost: the server no longer has it (it may have restarted)";
    if (!state.run.shown) return restoreLastRun("error", lost); // it had produced nothing: the last answer stays
    if (!state.run.text && state.run.restored) {
      state.run = page.newRun();
      page.view.clearOutput();
      page.view.showContext();
      page.view.setPhase("idle");
      page.view.renderCounters(performance.now());
      page.store.persist();
      page.view.flashNote("the last run is no longer on the server (it expired, or the server restarted)");
      return;
    }
    // a run the page was following live: what it showed stays, to read and copy
    finish("error", state.run.text ? `${lost} · partial output kept` : lost);
    page.store.persist();
  }

  // ---- refusals ----------------------------------------------------------------------------------

  function requestError(frame) {
    if (frame.code === "too_many_sockets") {
      page.connection.turnedAway(frame.message); // the server closes this socket next
      return page.view.flashNote(frame.message);
    }
    // A refused request (bad field, busy, queue full) or a broken frame: the socket stays usable.
    if (frame.param) page.view.markInvalid(frame.param, frame.message);
    if (state.request) {
      state.request = null;
      if (frame.code === "rate_limited" && frame.retry_after_s > 0) return refuseUntil(frame);
      return refuse(frame.message);
    }
    const run = state.run;
    const followed = run.jobId && (page.ACTIVE.has(run.phase) || run.replaying);
    if (frame.code === "unknown_job" && followed) return loseRun();
    page.view.flashNote(frame.message);
  }

  // The request never became a job: the last run stays on screen, the state says why.
  function refuse(message) {
    page.view.setPhase("error", message);
    page.view.renderCounters(performance.now());
  }

  // A rate limit's "try again in N s" counts down to "you can try again now", so that it stays true.
  // Screen readers hear the first words and the last: aria-busy holds the ticks in between back.
  function refuseUntil(frame) {
    const words = frame.message.replace(/;?\s*try again in \d+ s\.?$/, ""); // playground/limits.py's wording
    const until = performance.now() + 1000 * frame.retry_after_s;
    const tick = () => {
      const left = Math.ceil((until - performance.now()) / 1000);
      if (left > 0) {
        ui.status.setAttribute("aria-busy", "true"); // before the text changes
        state.run.note = `${words}; try again in ${left} s`;
        state.countdownTimer = setTimeout(tick, until - performance.now() - (left - 1) * 1000);
      } else {
        ui.status.removeAttribute("aria-busy");
        state.run.note = `${words}; you can try again now`;
      }
      page.view.showState();
    };
    refuse(`${words}; try again in ${frame.retry_after_s} s`);
    state.countdownTimer = setTimeout(tick, 1000);
  }

  page.receive = { onMessage, refuse, filledContext };
})();

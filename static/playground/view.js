/*
 * What the page shows of kogPage.state: the status line and the buttons, the output pane and its
 * counters, the final stats, the form's refusals, the workers and the models.
 *
 * Speed: frames (one per worker flush, ~25 ms) only append to a buffer (run.pending); a
 * requestAnimationFrame loop writes the buffer into the page once per frame, and the counters with it,
 * so a 5,000 tokens/s stream costs one DOM append per frame. Counters come from the worker's clock.
 * Safety: model output enters the page only as text nodes (kogHighlight.appendText, textContent), its
 * text-direction controls shown rather than obeyed.
 *
 * Owns: the animation frame asked for, the note's timer.
 * Exposes kogPage.view:
 *   setPhase(phase, note)   the run's phase: the status line, the buttons, Follow up
 *   showState()             the status line again, after run.note changed
 *   stopCountdown()         ends a rate limit's countdown (setPhase does)
 *   flashNote(message)      a note that goes after a few seconds
 *   setText(el, value)      writes an element's text only when it changes
 *   requestRender()         the next animation frame writes the output and the counters
 *   renderCounters(now)     the counters, at this clock
 *   flushPending()          writes the run's buffered output into the pane
 *   clearOutput()           empties the pane, with what belonged to the last run
 *   showContext()           the text the model continued, before the output (and a code completion's code
 *                           after the cursor, after it); returns it
 *   showFimMode()           the form in or out of code completion (the code before and after the cursor)
 *   followOutput()          scrolls the pane to its foot
 *   revealOutput()          brings the pane into view on a phone
 *   showFinalStats(stats)   a finished run's stats
 *   markInvalid(param, message), clearInvalid(field), clearPromptError()   the form's refusals
 *   showWorkers(frame)      a workers frame: the topbar's pill and the models
 *   selectWantedModel()     the model a reload or a share link asked for, once a worker serves it
 *   updateTokenLimit()      max tokens' limit, from the model's context
 */
(function () {
  "use strict";

  const page = window.kogPage;
  const state = page.state;
  const ui = page.ui;

  const FIELD_IDS = {
    prompt: "prompt", system_prompt: "system-prompt", model: "model",
    temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens",
  };
  const PHASE_LABELS = {
    idle: "Ready", sending: "Sending…", queued: "Queued", streaming: "Streaming", stopping: "Stopping…",
    reconnecting: "Reconnecting", done: "Done", stopped: "Stopped", cancelled: "Cancelled", error: "Error",
  };

  let frameRequested = false;
  let noteTimer = null;

  // ---- the output pane -------------------------------------------------------------------------

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
    if (page.ACTIVE.has(state.run.phase)) requestRender(); // keeps the clocks ticking between frames
  }

  function flushPending() {
    const run = state.run;
    if (!run.pending.length) return;
    const box = ui.outputBox;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 48;
    window.kogHighlight.appendText(ui.output, run.pending.join(""));
    run.pending = [];
    if (atBottom) box.scrollTop = box.scrollHeight;
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

  // A new run starts at the foot of the box, where its text streams in: a long prompt shown before a
  // completion would otherwise fill the box, and the output would stream unseen below it.
  function followOutput() {
    ui.outputBox.scrollTop = ui.outputBox.scrollHeight;
  }

  // The text the model continued, shown dimmed before its output (and copied with it): a completion
  // model's answer is runnable only after its prompt. Returns that text ("" when there is none).
  function showContext() {
    const context = window.kogHighlight.promptContext(state.run);
    ui.context.replaceChildren();
    window.kogHighlight.appendText(ui.context, context);
    // a code completion's code after the cursor, dimmed after the middle: text, never markup
    ui.outputSuffix.textContent = state.run.suffix || "";
    // code, as the share page decides it (highlight.js): the stylesheet keeps its lines unwrapped on a phone
    ui.outputBox.dataset.code = String(!state.run.chat || !!context);
    ui.copy.title = state.run.suffix
      ? "Copies the code before the cursor, the completion and the code after it, as shown"
      : context ? "Copies the prompt and the completion, as shown" : "Copies the output";
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

  // ---- counters and stats ------------------------------------------------------------------------

  function setText(el, value) {
    if (el.textContent !== value) el.textContent = value;
  }

  function formatRate(rate) {
    return rate >= 100 ? rate.toFixed(0) : rate.toFixed(1);
  }

  function renderCounters(now) {
    const run = state.run;
    const s = run.stats;
    if (s && s.decode_tok_s > 0) setText(ui.tokS, formatRate(s.decode_tok_s));
    else if (run.n > 1 && run.t > run.tFirst) setText(ui.tokS, formatRate((run.n - 1) / (run.t - run.tFirst)));
    else setText(ui.tokS, "–");
    setText(ui.runTokS, ui.tokS.textContent); // the phone's run bar
    setText(ui.runTokens, String(run.n));
    if (s && s.ttft_ms) setText(ui.ttft, s.ttft_ms.toFixed(0));
    else setText(ui.ttft, run.tFirst === null ? "–" : (run.tFirst * 1000).toFixed(0));
    setText(ui.tokens, String(run.n));
    // speculative decoding, live: tokens per model step (1 without drafts) and the drafted tokens kept
    const steps = s ? s.decode_steps : run.steps;
    const drafted = s ? s.draft_n : run.draftN;
    const kept = s ? s.draft_n_accepted : run.draftAccepted;
    setText(ui.tokStep, steps > 0 && run.n > 1 ? ((run.n - 1) / steps).toFixed(2) : "–");
    setText(ui.accepted, drafted > 0 ? ((100 * kept) / drafted).toFixed(0) : "–");
    setText(ui.queue, run.phase === "queued" && run.queue !== null ? String(run.queue) : "–");
    if (run.phase === "queued" && run.queueOverdueAt !== null && now > run.queueOverdueAt) {
      run.queueOverdueAt = null; // said once: the status line is a live region, not a ticking clock
      run.note = `${run.queue === 0 ? "next in line" : `${run.queue} ahead`}, longer than the usual job`;
      showState();
    }
    const clock = run.endedAt ?? run.frozenAt ?? now; // stopped while the connection is down
    setText(ui.elapsed, run.startedAt ? ((clock - run.startedAt) / 1000).toFixed(2) : "–");
  }

  function showFinalStats(stats) {
    if (!stats) return;
    const ms = (v) => (v >= 1000 ? (v / 1000).toFixed(2) + " s" : v.toFixed(1) + " ms");
    // the tokens an earlier request's KV cache held: prefill computed only the rest
    const cached = stats.cached_tokens > 0 ? `, ${stats.cached_tokens.toLocaleString("en-US")} cached` : "";
    setText(ui.statPromptTokens, `${stats.prompt_tokens.toLocaleString("en-US")} tokens${cached}`);
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

  // ---- the phase, the status line, the buttons ---------------------------------------------------

  function setPhase(phase, note) {
    const run = state.run;
    stopCountdown();
    run.phase = phase;
    run.note = note || "";
    showState();
    const active = page.ACTIVE.has(phase);
    const focused = document.activeElement;
    ui.generate.disabled = active;
    ui.stop.disabled = !active || phase === "stopping" || !(run.jobId || state.request);
    ui.newChat.disabled = active || !!state.request; // the running answer is built on the earlier turns
    // before the focus moves: on a phone the run bar hides Generate, which cannot take the focus while hidden
    ui.app.dataset.phase = phase;
    ui.app.dataset.active = active ? "true" : "false"; // shows the phone's run bar
    passFocus(focused);
    page.conversation.showFollowUp();
  }

  // The status line (a live region): written only where it changes, the same state twice is no news.
  function showState() {
    const run = state.run;
    if (ui.status.dataset.state !== run.phase) ui.status.dataset.state = run.phase;
    const label = PHASE_LABELS[run.phase];
    setText(ui.status, run.note ? `${label} · ${run.note}` : label);
  }

  function stopCountdown() {
    clearTimeout(state.countdownTimer);
    state.countdownTimer = null;
    ui.status.removeAttribute("aria-busy");
  }

  // A focused button that gets disabled drops the keyboard focus (and a screen reader's place) to the
  // top of the page: Generate hands it to Stop, and Stop back to Generate, once that one is enabled.
  function passFocus(focused) {
    if (focused === ui.generate && ui.generate.disabled) state.focusHeir = ui.stop;
    else if (focused === ui.stop && ui.stop.disabled) state.focusHeir = ui.generate;
    const now = document.activeElement;
    const lost = !now || now === document.body || now.disabled;
    if (!state.focusHeir || state.focusHeir.disabled || !lost) return;
    const heir = state.focusHeir;
    state.focusHeir = null;
    heir.focus({ preventScroll: true }); // the page stays where the person reads (a phone's output, far below)
  }

  function flashNote(message) {
    ui.note.textContent = message;
    ui.note.hidden = false;
    clearTimeout(noteTimer);
    noteTimer = setTimeout(() => (ui.note.hidden = true), 6000);
  }

  // ---- the form's refusals -----------------------------------------------------------------------

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

  // Code completion on: the prompt is the code before the cursor, a second field the code after it, and the
  // output shows the middle the model writes between the two.
  function showFimMode() {
    const on = ui.fim.checked;
    ui.suffixField.hidden = !on;
    ui.promptLabel.textContent = on ? "Code before the cursor" : "Prompt";
    ui.prompt.required = !on; // the cursor may be at the file's start: the code after it is enough
    ui.system.closest("details").hidden = on; // a completion between two pieces of code has no system prompt
    if (page.conversation) page.conversation.setConversation(state.conversation); // nor earlier turns
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
    state.models = Object.fromEntries(frame.models.map((m) => [m.name, m]));
    showModels(frame.models.map((m) => m.name), frame.models.map(modelLabel));
    page.settings.followModel(); // a model's recommendation may have arrived with it
  }

  // A model a worker is still fetching from the Hub says how far it has got.
  function modelLabel(model) {
    const download = model.download;
    if (!download) return model.name;
    const [unit, factor] = download.total >= 1e9 ? ["GB", 1e9] : ["MB", 1e6];
    const size = (bytes) => (bytes / factor).toFixed(1);
    return `${model.name} (downloading ${size(download.done)} / ${size(download.total)} ${unit})`;
  }

  function showModels(names, labels) {
    const current = Array.from(ui.model.options).filter((o) => !o.disabled);
    const same = (o, i) => o.value === names[i] && o.textContent === labels[i];
    if (current.length === names.length && current.every(same)) return selectWantedModel();
    const selected = ui.model.value;
    const options = names.map((name, i) => {
      const option = document.createElement("option");
      option.value = name;
      option.textContent = labels[i]; // text, never markup
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
    page.settings.followModel();
  }

  // A model's context holds the prompt and the answer: max tokens can be at most one less, and the
  // field says so while it is over.
  function updateTokenLimit() {
    const serverMax = Number(ui.form.dataset.maxNewTokens);
    const context = (state.models[ui.model.value] || {}).max_context;
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

  page.view = {
    setPhase, showState, stopCountdown, flashNote, setText,
    requestRender, renderCounters, flushPending, clearOutput, showContext, followOutput, revealOutput, showFimMode,
    showFinalStats, markInvalid, clearInvalid, clearPromptError,
    showWorkers, selectWantedModel, updateTokenLimit,
  };
})();

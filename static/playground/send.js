/*
 * What the page sends: the generate frame (htmx's ws-send on the form, shaped here, or sent here once the
 * connection is back) and Stop. A request is kogPage.state.request from the click until its job id comes
 * back (kogPage.receive.acceptJob); the prompt's own problems are refused before anything goes out.
 *
 * Exposes kogPage.send:
 *   onConfigSend(event)    htmx:wsConfigSend: the form's frame, or no send at all
 *   onAfterSend(event)     htmx:wsAfterSend: the request is on its way
 *   sendWaitingRequest()   sends the request that waited for the connection
 *   waitingNote()          what the status line says while a request waits for the connection
 *   requestStop()          Stop (the button, Escape)
 */
(function () {
  "use strict";

  const page = window.kogPage;
  const state = page.state;
  const ui = page.ui;

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
      history: state.conversation.length && !ui.fim.checked ? state.conversation : undefined,
      // code completion: the prompt is the code before the cursor, this the code after it
      suffix: ui.fim.checked ? ui.suffix.value : undefined,
    };
  }

  // What the server would refuse in the prompt, said in the page's words before anything is sent (and
  // before 100,000 characters go out for nothing); "" when it is fine.
  function promptProblem() {
    const fim = ui.fim.checked;
    if (!ui.prompt.value.trim() && !(fim && ui.suffix.value.trim())) {
      return fim
        ? "the code is blank: write the code before the cursor, after it, or both"
        : "the prompt is blank: write what the model should continue or answer";
    }
    const limit = Number(ui.form.dataset.maxPromptChars);
    const suffix = fim ? ui.suffix.value : "";
    const length = Array.from(ui.prompt.value + suffix).length; // characters, as Python counts them
    if (!limit || length <= limit) return "";
    const fmt = (n) => n.toLocaleString("en");
    return `the prompt is ${fmt(length)} characters; the limit is ${fmt(limit)}`;
  }

  function onConfigSend(event) {
    if (event.target !== ui.form) return;
    if (page.ACTIVE.has(state.run.phase) || state.request) return event.preventDefault();
    if (event.detail.errors && event.detail.errors.length) {
      ui.form.reportValidity(); // htmx halts the send itself; the browser says which field and why
      return;
    }
    const problem = promptProblem();
    if (problem) {
      event.preventDefault();
      page.view.markInvalid("prompt", problem);
      return page.receive.refuse(problem);
    }
    state.request = { frame: generateFrame(), at: performance.now(), sent: false };
    if (state.connection !== "open" || state.turnedAway) {
      // not handed to the extension, whose queue would send it whenever the connection returns (a Stop
      // could not take it back): onOpen sends it, and says so meanwhile
      event.preventDefault();
      page.view.setPhase("sending", waitingNote());
      return;
    }
    event.detail.messageBody = JSON.stringify(state.request.frame);
    page.view.setPhase("sending");
    page.view.requestRender();
  }

  function waitingNote() {
    if (state.turnedAway) return `waiting: ${state.turnedAway} · sends once the server takes this page`;
    const unreachable = state.retry.count > page.UNREACHABLE_AFTER;
    return `waiting for the connection${unreachable ? " (the server is unreachable)" : ""} · sends once connected`;
  }

  // A request that waited for the connection goes out now; its clock starts now, not at the click.
  function sendWaitingRequest() {
    state.socket.send(JSON.stringify(state.request.frame));
    state.request.sent = true;
    state.request.at = performance.now();
    page.view.setPhase("sending");
    page.view.requestRender();
  }

  function onAfterSend(event) {
    if (event.target === ui.form && state.request) state.request.sent = true;
  }

  function requestStop() {
    const request = state.request;
    if (request && !request.sent) {
      // it waits for the connection: it is simply not sent
      state.request = null;
      return page.view.setPhase("cancelled", "not sent");
    }
    if (request) {
      // the request is on its way and its job has no id yet: stop it the moment the id comes back
      request.stopRequested = true;
      return page.view.setPhase("stopping");
    }
    const run = state.run;
    if (!run.jobId || !page.ACTIVE.has(run.phase) || run.stopRequested) return;
    run.stopRequested = true;
    if (state.connection === "open") {
      state.socket.send(JSON.stringify({ type: "stop" }));
      page.view.setPhase("stopping");
    } else {
      // sent after the resume that follows the reconnect: a stop sent before it would reach a
      // socket that follows no job, and the run would carry on
      page.view.setPhase("stopping", "stops once reconnected");
    }
  }

  page.send = { onConfigSend, onAfterSend, sendWaitingRequest, waitingNote, requestStop };
})();

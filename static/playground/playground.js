/*
 * The playground page's wiring, loaded last of its scripts (the map of them: state.js): it finds the
 * page's elements (kogPage.ui), hands htmx the page's sockets, and connects the events to the parts that
 * handle them; the keys and Copy are handled here.
 *
 * Exposes nothing. Sets window.htmx.createWebSocket (kogPage.connection.createSocket) as it loads, before
 * htmx opens its first socket.
 */
(function () {
  "use strict";

  const page = window.kogPage;
  const state = page.state;
  const ui = page.ui;

  // ---- copying -----------------------------------------------------------------------------------

  // The run whose answer the pane shows: the last one until the next has produced.
  function runOnScreen() {
    return state.run.shown || !state.lastRun ? state.run : state.lastRun;
  }

  function copyOutput() {
    // as shown: the prompt it continued, the output, and a code completion's code after the cursor
    const shown = ui.context.textContent + runOnScreen().text + ui.outputSuffix.textContent;
    window.kogClipboard.copy(shown).then((ok) => {
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
    if (!state.request && !(state.run.jobId && page.ACTIVE.has(state.run.phase))) return;
    event.preventDefault();
    page.send.requestStop();
  }

  // ---- wiring ----------------------------------------------------------------------------------

  if (window.htmx) window.htmx.createWebSocket = page.connection.createSocket; // before htmx opens the first socket

  document.addEventListener("DOMContentLoaded", function () {
    const ids = {
      app: "app", form: "prompt-form", prompt: "prompt", system: "system-prompt",
      systemDetails: "system-details", model: "model", temperature: "temperature", topP: "top-p",
      maxTokens: "max-tokens", tokenHint: "token-hint", generate: "generate", stop: "stop",
      actions: "actions", runTokS: "run-tok-s", runTokens: "run-tokens",
      result: "result", output: "output", context: "output-context", outputBox: "output-box",
      status: "state", note: "note", retry: "retry", tokS: "tok-s", ttft: "ttft", tokens: "tokens",
      tokStep: "tok-step", accepted: "accepted",
      queue: "queue", elapsed: "elapsed", copy: "copy", shareActions: "share-actions", share: "share",
      copyLink: "copy-link", copyCode: "copy-code", finalStats: "final-stats", statPromptTokens: "stat-prompt-tokens",
      statPrefill: "stat-prefill", statTtft: "stat-ttft", statDecode: "stat-decode", statTotal: "stat-total",
      statBandwidth: "stat-bandwidth", bandwidthRow: "stat-bandwidth-row", statQueue: "stat-queue",
      queueRow: "stat-queue-row",
      workerStatus: "worker-status", workerText: "worker-text",
      workerBusy: "worker-busy", followUp: "follow-up", newChat: "new-chat", conversation: "conversation",
      conversationTurns: "conversation-turns", conversationSummary: "conversation-summary",
      conversationNote: "conversation-note", conversationCount: "conversation-count",
      promptError: "prompt-error", shortcutKey: "shortcut-key", samplingHint: "sampling-hint",
      fim: "fim", suffix: "suffix", suffixField: "suffix-field", promptLabel: "prompt-label",
      outputSuffix: "output-suffix",
      baseHint: "base-hint",
    };
    for (const [key, id] of Object.entries(ids)) ui[key] = document.getElementById(id);
    if (!ui.app) return;
    ui.prompt.dataset.placeholder = ui.prompt.placeholder;
    showShortcut();

    ui.form.addEventListener("submit", (event) => event.preventDefault()); // htmx sends it over the socket
    ui.form.addEventListener("keydown", onFormKey);
    ui.form.addEventListener("input", (event) => {
      page.view.clearInvalid(event.target);
      // what was refused is being changed
      if (state.run.phase === "error" && !state.request) page.view.setPhase("idle");
      if (event.target === ui.prompt) page.view.clearPromptError();
      if (event.target === ui.maxTokens) page.view.updateTokenLimit();
      // a sampling field the person set is theirs: the hint under them stops naming it at once
      if (page.settings.choose(event.target.name)) page.settings.followModel();
      page.store.persistSoon();
    });
    window.addEventListener("pagehide", page.store.persist);
    ui.fim.addEventListener("change", () => {
      page.view.showFimMode();
      page.store.persist();
    });
    ui.model.addEventListener("change", () => {
      delete ui.model.dataset.wanted;
      page.settings.followModel();
      page.store.persist();
    });
    document.addEventListener("keydown", onDocumentKey);
    document.addEventListener("focusin", () => (state.focusHeir = null)); // the person went somewhere else
    ui.stop.addEventListener("click", page.send.requestStop);
    ui.copy.addEventListener("click", copyOutput);
    ui.copyCode.addEventListener("click", copyCode);
    ui.copyLink.addEventListener("click", copyShareLink);
    ui.followUp.addEventListener("click", page.conversation.followUp);
    ui.newChat.addEventListener("click", page.conversation.newChat);
    ui.retry.addEventListener("click", page.connection.reconnectNow);
    window.addEventListener("online", page.connection.reconnectNow);
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState === "visible") page.connection.reconnectNow();
    });

    ui.app.addEventListener("htmx:wsConfigSend", page.send.onConfigSend);
    ui.app.addEventListener("htmx:wsAfterSend", page.send.onAfterSend);
    ui.app.addEventListener("htmx:wsBeforeMessage", page.receive.onMessage);
    ui.app.addEventListener("htmx:wsOpen", page.connection.onOpen);
    ui.app.addEventListener("htmx:wsClose", page.connection.onClose);
    page.connection.setConnection("connecting");
    page.view.setPhase("idle");
    page.store.restoreFromLoad();
    page.settings.followModel();
    page.view.renderCounters(performance.now());
  });
})();

/*
 * What survives a reload. A reload keeps the form, the conversation and the run's job id in
 * sessionStorage (each entry of the tab's history its own) and replays the run from its first entry.
 *
 * Owns: the storage keys, this history entry's id, the form save waiting for the typing to pause.
 * Exposes kogPage.store:
 *   persist()           saves the form, the run's job and the conversation now
 *   persistSoon()       saves once the typing pauses
 *   restoreFromLoad()   brings back what this history entry (or a share page's "Try it yourself") left
 */
(function () {
  "use strict";

  const page = window.kogPage;
  const state = page.state;
  const ui = page.ui;

  const STORE_KEY = "kog-playground"; // the tab's latest state, where a new history entry starts from
  const ENTRY_PREFIX = "kog-playground:entry:"; // the state of one entry of the tab's history
  const ENTRIES_KEY = "kog-playground:entries"; // those entries' ids, the most recently saved last
  const ENTRIES_KEPT = 20; // a prompt may be 100,000 characters: older entries make room

  let persistTimer = null; // a form save waiting for the typing to pause
  let historyEntry = ""; // the id of this entry of the tab's history (its stored state's key)

  function formValues() {
    return {
      prompt: ui.prompt.value, system_prompt: ui.system.value, model: ui.model.value,
      temperature: ui.temperature.value, top_p: ui.topP.value, max_tokens: ui.maxTokens.value,
      chosen: Array.from(state.chosen), // which of those the person set (settings.js)
      fim: ui.fim.checked, suffix: ui.suffix.value, // code completion, and the code after the cursor
    };
  }

  // Each entry of the tab's history keeps its own state, so that Back to an earlier playground brings its
  // own run back (a share page's "Try it yourself" opens a new entry with other values); the entry's id
  // lives in history.state, which a reload and Back keep. A new entry starts from the tab's latest state.
  function entryId() {
    const saved = history.state && typeof history.state === "object" ? history.state : {};
    if (typeof saved.kogEntry === "string") return saved.kogEntry;
    const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
    history.replaceState({ ...saved, kogEntry: id }, "");
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
    const run = state.run;
    const job = run.jobId && {
      id: run.jobId, model: run.model, chat: run.chat, prompt: run.prompt, system: run.system,
      suffix: run.suffix, maxTokens: run.maxTokens,
      startedAt: Date.now() - (performance.now() - run.startedAt), // wall clock: survives the reload
      endedAt: run.endedAt === null ? null : Date.now() - (performance.now() - run.endedAt),
      outcome: run.outcome, note: run.outcomeNote, // a finished run comes back as it ended
    };
    try {
      writeStore({ form: formValues(), job: job || null, conversation: state.conversation });
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
      max_tokens: ui.maxTokens, suffix: ui.suffix,
    };
    for (const [name, el] of Object.entries(fields)) {
      if (typeof form[name] === "string") el.value = form[name];
    }
    // the sampling fields the person set stay theirs; a form saved before the page kept that list: all of them
    const chosen = Array.isArray(form.chosen) ? form.chosen : ["temperature", "top_p", "max_tokens"];
    for (const field of chosen) page.settings.choose(field);
    if (typeof form.model === "string" && form.model) {
      ui.model.dataset.wanted = form.model; // selected once a workers frame lists it
      page.view.selectWantedModel();
    }
    if (ui.system.value) ui.systemDetails.open = true;
    ui.fim.checked = form.fim === true;
    page.view.showFimMode();
  }

  // A run that was going (or had ended) when the page reloaded: show it again from its first entry;
  // the server keeps a job's whole event stream for an hour. A finished run comes back quietly, as it
  // ended: its replay is no news to announce, and there is nothing to stop.
  function restoreRun(job) {
    if (!job || typeof job.id !== "string") return;
    const finished = !!job.endedAt && page.ENDED.has(job.outcome);
    state.run = Object.assign(page.newRun(), {
      jobId: job.id, model: job.model || "", chat: !!job.chat, prompt: job.prompt || "",
      system: job.system || "", suffix: typeof job.suffix === "string" ? job.suffix : null,
      maxTokens: job.maxTokens ?? null, restored: true, shown: true,
      replaying: finished,
      startedAt: performance.now() - (Date.now() - job.startedAt),
      endedAt: job.endedAt ? performance.now() - (Date.now() - job.endedAt) : null,
    });
    page.view.showContext();
    page.view.followOutput();
    if (finished) page.view.setPhase(job.outcome, typeof job.note === "string" ? job.note : "");
    else page.view.setPhase("reconnecting", "restoring the last run…");
  }

  function restoreFromLoad() {
    historyEntry = entryId();
    const saved = readStore();
    if (ui.form.dataset.prefilled === "true") {
      // "Try it yourself" on a share page: its values win (its conversation too), and the address
      // loses ?from= so that a reload keeps what the person types from here on
      history.replaceState(history.state, "", location.pathname);
      page.conversation.setConversation(ui.form.dataset.history ? JSON.parse(ui.form.dataset.history) : []);
      for (const field of ["temperature", "top_p", "max_tokens"]) page.settings.choose(field); // the shared run's
      page.view.showFimMode(); // a shared code completion comes back as one: its code after the cursor shown
    } else {
      if (saved.form) restoreForm(saved.form);
      page.conversation.setConversation(saved.conversation);
      restoreRun(saved.job); // not under a shared conversation: this tab's last run is no part of it
    }
    persist();
  }

  page.store = { persist, persistSoon, restoreFromLoad };
})();

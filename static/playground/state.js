/*
 * The playground page. htmx's websocket extension owns the socket (ws-connect on <main>, ws-send on
 * the form); the page's scripts shape what is sent, apply what arrives, and decide when to reconnect.
 * The frame protocol is documented in playground/consumers.py.
 *
 * The page is a few classic scripts (not modules: each static URL carries its file's hash, see
 * playground/static_versions.py), loaded with defer in this order, each adding one part to window.kogPage:
 *
 *   state.js         kogPage.state, kogPage.ui, the constants and newRun(): what the page knows (this file)
 *   store.js         kogPage.store: the form and the run in sessionStorage, and their restore after a reload
 *   conversation.js  kogPage.conversation: the earlier turns (Follow up, New chat)
 *   view.js          kogPage.view: the status line, the output pane, the counters, the workers and models
 *   settings.js      kogPage.settings: the sampling fields follow the model's recommendation, unless set
 *   connection.js    kogPage.connection: the socket, its reconnects
 *   send.js          kogPage.send: the generate frame, Stop
 *   receive.js       kogPage.receive: the frames that arrive, a run from its job id to its end
 *   playground.js    the wiring: the elements, the events, the keys, Copy
 *
 * Only the wiring runs anything at load (htmx.createWebSocket, then DOMContentLoaded); the other scripts
 * define functions, which call each other's through kogPage once the page runs, so that a script may use
 * one loaded after it.
 *
 * Every mutable thing more than one script reads or writes lives in kogPage.state (below); a script's own
 * timers stay in it. kogPage.ui holds the page's elements by role, filled once on DOMContentLoaded (its
 * `status` is the status line, #state).
 */
(function () {
  "use strict";

  const ACTIVE = new Set(["sending", "queued", "streaming", "stopping", "reconnecting"]);
  const ENDED = new Set(["done", "stopped", "cancelled", "error"]);
  const UNREACHABLE_AFTER = 3; // failed reconnects (~1.75 s) before the page calls the server unreachable

  function newRun() {
    return {
      phase: "idle", jobId: null, lastId: "0-0", note: "", model: "", maxTokens: null,
      chat: false, prompt: "", system: "", suffix: null, context: "", stopRequested: false, restored: false,
      pending: [], text: "", n: 0, t: 0, tFirst: null, queue: null, queueOverdueAt: null,
      steps: 0, draftN: 0, draftAccepted: 0, // model steps after the first token; drafted and kept tokens
      startedAt: 0, endedAt: null, stats: null, outcome: "", outcomeNote: "",
      shown: false, // its output has the pane (from its prefill on)
      replaying: false, // a finished run brought back by a reload, replayed without announcing it
      resuming: false, // a resume was sent after a reconnect; no frame has come back yet
      frozenAt: null, // when the connection dropped: the clock stops there until it is back
    };
  }

  const state = {
    socket: null, // the ws extension's socket wrapper: send() queues while disconnected
    connection: "connecting", // connecting | open | closed
    run: newRun(), // the run the page shows
    // the run whose answer stays on screen while the next one has not produced yet (null once it has)
    lastRun: null,
    // a generate frame on its way: {frame, at, sent, stopRequested}, until its job id comes back; one
    // asked for while disconnected waits here (sent: false) for the connection
    request: null,
    models: {}, // name -> {chat, max_context, sampling_defaults}, from the latest workers frame
    chosen: new Set(), // the sampling fields the person set (settings.js): the model leaves them alone
    conversation: [], // the earlier turns the next prompt follows up on: [{prompt, answer}], oldest first
    countdownTimer: null, // a rate limit's "try again in N s", counting down
    retry: { timer: null, count: 0, takenTimer: null }, // the next reconnect, the failed tries since the last open
    turnedAway: "", // why the server closed this tab's sockets (too many open pages), until one is taken
    focusHeir: null, // the button that takes the focus once it is enabled (view.passFocus)
  };

  window.kogPage = { state, ui: {}, ACTIVE, ENDED, UNREACHABLE_AFTER, newRun };
})();

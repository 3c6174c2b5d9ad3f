/*
 * The socket, and when to reconnect it. htmx's ws extension reconnects only after some close codes, on a
 * jittered backoff that grows to 64 s, with a timer nothing can cut short. The page keeps that schedule
 * itself: its sockets report every close to htmx as a normal one (so htmx schedules nothing), and
 * scheduleReconnect() retries within a few seconds, at once when the network comes back, the tab is
 * shown, or Retry is clicked.
 *
 * Reconnects: every stream frame has an entry id; the page applies each id once and in order
 * (kogPage.receive), and after a reconnect asks for the entries after the last one it applied (onOpen).
 *
 * Writes kogPage.state.socket, .connection and .retry.
 * Exposes kogPage.connection:
 *   createSocket(url)   htmx.createWebSocket: a socket whose closes htmx takes for normal ones
 *   reconnectNow()      reconnects at once when the socket is closed (Retry, online, the tab shown)
 *   turnedAway(why)     the server closes this socket (too many open pages): retry slowly, say why, and keep
 *                       a request sent on it for a socket the server takes
 *   taken()             the server took this socket (its first frame): a request that waited goes out
 *   onOpen(event), onClose(event)   the htmx:wsOpen and htmx:wsClose handlers
 *   setConnection(state)            connecting | open | closed, as the page shows it
 */
(function () {
  "use strict";

  const page = window.kogPage;
  const state = page.state;
  const ui = page.ui;

  const RETRY_MS = [250, 500, 1000, 2000, 3000]; // reconnect delays after each failed try; the last repeats
  const TAKEN_AFTER_MS = 2000; // a socket the server has not turned away by then is one it took

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
    state.connection = "connecting";
    if (ui.retry) ui.retry.hidden = true; // htmx may open the first socket before the wiring finds the elements
    return ws;
  }

  function scheduleReconnect() {
    const retry = state.retry;
    clearTimeout(retry.timer);
    retry.timer = setTimeout(reconnectNow, RETRY_MS[Math.min(retry.count, RETRY_MS.length - 1)]);
    retry.count += 1;
  }

  // The server closes a socket over its per-address cap (too_many_sockets): this tab retries at the slowest
  // pace, not at once, until another tab of the address closes. The server drops what this socket sent, so a
  // request sent on it waits, and goes out on a socket the server takes.
  function turnedAway(why) {
    state.turnedAway = why;
    state.retry.count = Math.max(state.retry.count, RETRY_MS.length - 1);
    if (state.request && state.request.sent) {
      if (state.request.stopRequested) {
        state.request = null; // stopped before the server could take it: it is simply not sent
        return page.view.setPhase("cancelled", "not sent");
      }
      state.request.sent = false;
      page.view.setPhase("sending", page.send.waitingNote());
    }
  }

  function taken() {
    clearTimeout(state.retry.takenTimer);
    state.turnedAway = "";
    if (state.request && !state.request.sent && state.connection === "open") page.send.sendWaitingRequest();
  }

  function reconnectNow() {
    clearTimeout(state.retry.timer);
    state.retry.timer = null;
    if (state.connection !== "closed" || !state.socket) return; // one socket at a time
    state.socket.reconnect();
  }

  function onOpen(event) {
    state.socket = event.detail.socketWrapper;
    clearTimeout(state.retry.timer);
    state.retry.count = 0;
    setConnection("open");
    if (state.request) {
      // one that waited for the connection goes out now (on a tab the server turned away, once it takes
      // this socket); one that went out before the drop never got its job id back: nothing to resume
      if (!state.request.sent) return state.turnedAway ? awaitTaken() : page.send.sendWaitingRequest();
      state.request = null;
      return page.receive.refuse("the connection dropped before the job started; please try again");
    }
    const run = state.run;
    if (!run.jobId || !(page.ACTIVE.has(run.phase) || run.replaying)) return;
    state.socket.send(JSON.stringify({ type: "resume", job_id: run.jobId, after: run.lastId }));
    // "resumed" is said once the server answers with the run's next frame (receive.onMessage), not before: it
    // may no longer have the run (a restart)
    run.resuming = !run.restored;
    if (run.stopRequested) {
      state.socket.send(JSON.stringify({ type: "stop" }));
      page.view.setPhase("stopping");
    } else if (run.resuming) {
      page.view.setPhase("reconnecting", "resuming the run…");
    }
  }

  // The server turns a socket away at once (its first frame); one that was not turned away within a while
  // was taken, even if its first frame (the workers' status) is slow to come.
  function awaitTaken() {
    clearTimeout(state.retry.takenTimer);
    const socket = state.socket;
    state.retry.takenTimer = setTimeout(() => {
      if (state.turnedAway && state.socket === socket && state.connection === "open") taken();
    }, TAKEN_AFTER_MS);
  }

  function onClose(event) {
    state.socket = event.detail.socketWrapper;
    setConnection("closed");
    scheduleReconnect();
    showConnectionLost(state.retry.count > page.UNREACHABLE_AFTER);
  }

  // While the socket is down (and its retries go on in the background): the run's clock stops, since the
  // page cannot tell how the run goes, what arrived can be copied, and the words say what happens next.
  function showConnectionLost(unreachable) {
    const away = state.turnedAway;
    let words = unreachable ? "server unreachable · retrying" : "connection lost · reconnecting";
    if (away) words = "too many open pages · retrying";
    page.view.setText(ui.workerText, words);
    const lost = away ? `turned away: ${away}` : unreachable ? "the server is unreachable" : "connection lost";
    if (state.request && !state.request.sent) return page.view.setPhase("sending", page.send.waitingNote());
    if (state.request) return page.view.setPhase("reconnecting", lost); // sent, no job id back: onOpen says so
    const run = state.run;
    if (!run.jobId || !page.ACTIVE.has(run.phase)) return;
    if (run.frozenAt === null) run.frozenAt = performance.now();
    if (run.shown) ui.copy.hidden = !run.text;
    if (run.stopRequested) page.view.setPhase("stopping", `${lost} · stops once reconnected`);
    else if (!run.restored) {
      page.view.setPhase("reconnecting", unreachable && !away ? `${lost} · still trying` : lost);
    }
  }

  function setConnection(connection) {
    state.connection = connection;
    ui.app.dataset.connected = connection === "open" ? "true" : "false";
    ui.retry.hidden = connection !== "closed";
    if (connection !== "open") {
      ui.workerStatus.dataset.up = "false";
      if (connection === "connecting") page.view.setText(ui.workerText, "connecting…");
      page.view.setText(ui.workerBusy, "");
    }
  }

  page.connection = { createSocket, reconnectNow, turnedAway, taken, onOpen, onClose, setConnection };
})();

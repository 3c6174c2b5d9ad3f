/*
 * Conversations: "Follow up" moves a chat run's prompt and answer into the earlier turns, which go with
 * the next prompt as its history (the server renders them through the model's chat template). The earlier
 * turns are shown above the output, each as text (kogHighlight), and kept in kogPage.state.conversation.
 *
 * Exposes kogPage.conversation:
 *   setConversation(turns)   the earlier turns, from a reload or a share page (invalid ones dropped), shown
 *                            (in code completion: said to be left out, as the next request leaves them)
 *   showFollowUp()           shows Follow up when the run on screen can be followed up on
 *   followUp()               Follow up: the run's prompt and answer become the latest earlier turn
 *   newChat()                New chat: the next prompt starts afresh
 */
(function () {
  "use strict";

  const page = window.kogPage;
  const state = page.state;
  const ui = page.ui;

  function setConversation(turns) {
    const valid = (turn) => turn && typeof turn.prompt === "string" && typeof turn.answer === "string";
    state.conversation = Array.isArray(turns) ? turns.filter(valid) : [];
    renderConversation();
  }

  // The earlier turns above the output, each as text; the prompt's label says the next one follows up.
  function renderConversation() {
    const items = [];
    for (const turn of state.conversation) {
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
    const n = state.conversation.length;
    const turns = `${n} earlier turn${n === 1 ? "" : "s"}`;
    const fim = ui.fim.checked; // a code completion reads only the code around the cursor, not the turns
    ui.conversation.hidden = !n || fim;
    ui.conversationNote.hidden = !n;
    // once shown: a hidden list has no height to scroll (a reload, the first Follow up)
    ui.conversationTurns.scrollTop = ui.conversationTurns.scrollHeight; // the latest turn in view
    page.view.setText(ui.conversationSummary, `Earlier turns · ${n}`);
    page.view.setText(ui.conversationCount, fim ? `code completion leaves out ${turns}` : `follows up on ${turns}`);
    page.settings.showPromptKind();
    showFollowUp();
  }

  // A chat run that ended with an answer can be followed up on (still after a refused request, which
  // leaves it on screen).
  function showFollowUp() {
    const run = state.run;
    const answered = run.outcome === "done" || run.outcome === "stopped";
    const room = !page.receive.filledContext(run.stats); // a follow-up on a full context could only be refused
    ui.followUp.hidden = !(answered && room && run.chat && run.text && !state.request && !page.ACTIVE.has(run.phase));
  }

  function followUp() {
    if (ui.followUp.hidden) return;
    const typedSince = ui.prompt.value !== state.run.prompt; // the next question, already typed: it stays
    setConversation([...state.conversation, { prompt: state.run.prompt, answer: state.run.text }]);
    state.run = Object.assign(page.newRun(), { shown: true }); // the emptied pane is the next prompt's
    page.view.clearOutput();
    page.view.showContext();
    page.view.setPhase("idle");
    page.view.renderCounters(performance.now());
    if (!typedSince) ui.prompt.value = "";
    ui.prompt.focus();
    page.store.persist();
  }

  function newChat() {
    if (page.ACTIVE.has(state.run.phase) || state.request) return; // the running answer is built on these turns
    setConversation([]);
    page.view.clearPromptError();
    if (state.run.phase === "error") page.view.setPhase("idle"); // what went wrong was the conversation's length
    ui.prompt.focus();
    page.store.persist();
  }

  page.conversation = { setConversation, showFollowUp, followUp, newChat };
})();

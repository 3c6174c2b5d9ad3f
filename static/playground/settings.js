/*
 * The form's sampling settings follow the model: a model whose generation_config.json recommends a
 * temperature, a top-p or a max_new_tokens (the worker says so in its heartbeat: the workers frame's
 * sampling_defaults) gets those in the fields the person has not set, and the page's own defaults come
 * back for a model that recommends nothing. What the person typed, what a reload restored of it and what a
 * share link's "Try it yourself" brought are theirs, and stay.
 *
 * Owns: which fields the person chose (state.chosen, saved with the form by store.js).
 * Exposes kogPage.settings:
 *   choose(field)    the person set this field (temperature, top_p, max_tokens): the model leaves it alone;
 *                    true when it was the model's until then
 *   followModel()    the unchosen fields to the selected model's recommendation, else the page's default;
 *                    the prompt's placeholder and hint to the model's kind (base: code; chat: a request)
 *   showPromptKind() the prompt's placeholder and hint alone (a conversation began or ended)
 */
(function () {
  "use strict";

  const page = window.kogPage;
  const state = page.state;
  const ui = page.ui;

  // field -> [its input (by role in kogPage.ui), the key of sampling_defaults]
  const FIELDS = { temperature: ["temperature", "temperature"], top_p: ["topP", "top_p"],
    max_tokens: ["maxTokens", "max_new_tokens"] };
  const LABELS = { temperature: "temperature", top_p: "top-p", max_tokens: "max tokens" };

  // true when the field was the model's until now
  function choose(field) {
    if (!FIELDS[field] || state.chosen.has(field)) return false;
    state.chosen.add(field);
    return true;
  }

  function followModel() {
    const name = ui.model.value;
    const recommended = (state.models[name] || {}).sampling_defaults || {};
    const followed = [];
    for (const [field, [role, key]] of Object.entries(FIELDS)) {
      if (state.chosen.has(field)) continue;
      const input = ui[role];
      let value = recommended[key];
      if (typeof value !== "number" || !Number.isFinite(value)) {
        input.value = input.defaultValue; // the page's own (the template's value)
        continue;
      }
      if (field === "max_tokens") value = Math.min(value, Number(ui.form.dataset.maxNewTokens));
      input.value = String(value);
      followed.push(`${LABELS[field]} ${value}`);
    }
    showPromptKind(name);
    ui.samplingHint.hidden = !followed.length;
    const said = followed.join(", ");
    page.view.setText(ui.samplingHint, followed.length
      ? `${said[0].toUpperCase()}${said.slice(1)}: what ${name} recommends (its generation_config.json).` : "");
    page.view.updateTokenLimit();
  }

  // A base model continues code: the placeholder is a function's start and a line under the prompt says
  // so; a chat model's placeholder is a request. A follow-up's says what the model does with the earlier turns.
  function showPromptKind(name = ui.model.value) {
    const base = !!(state.models[name] || {}).base;
    const prompt = ui.prompt;
    prompt.dataset.placeholder = base ? prompt.dataset.codePlaceholder : prompt.dataset.chatPlaceholder;
    const followingUp = state.conversation.length && !ui.fim.checked; // code completion leaves the turns out
    const followUpHint = base
      ? "More code: the model continues after the earlier turns."
      : "Ask a follow-up: the model reads the earlier turns.";
    prompt.placeholder = followingUp ? followUpHint : prompt.dataset.placeholder;
    ui.baseHint.hidden = !base;
  }

  page.settings = { choose, followModel, showPromptKind };
})();

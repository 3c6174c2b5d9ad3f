/*
 * Copying text, on the playground and the share page.
 *
 *   kogClipboard.copy(text)            resolves true once the text is on the clipboard
 *   kogClipboard.flash(button, label)  shows label on the button for a moment, then its own again, and has
 *                                      screen readers say it
 *   <button data-copy-from="ID">       copies that element's text and says "Copied"
 *   <button data-copy-code-from="ID">  copies the code of that element's fenced blocks (kogHighlight.fencedCode)
 *
 * The Clipboard API needs a secure context (https, or localhost); a playground served over plain
 * http on a LAN address still copies through a selected, off-screen textarea.
 */
(function () {
  "use strict";

  const FLASH_MS = 1800;

  function copyThroughSelection(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.className = "offscreen";
    area.setAttribute("readonly", "");
    document.body.append(area);
    area.select();
    let copied = false;
    try {
      copied = document.execCommand("copy");
    } catch (err) {
      copied = false;
    }
    area.remove();
    return copied;
  }

  function copy(text) {
    if (navigator.clipboard && window.isSecureContext) {
      return navigator.clipboard.writeText(text).then(() => true, () => copyThroughSelection(text));
    }
    return Promise.resolve(copyThroughSelection(text));
  }

  // A button's new label is not announced by screen readers; one polite status region says it for every
  // button. It is made with the page, off-screen: a region added at the moment it speaks is often missed
  // (screen readers watch the regions that were there before). Emptied first, the same word twice is heard twice.
  let announcer = null;
  function makeAnnouncer() {
    announcer = document.createElement("div");
    announcer.id = "copy-status";
    announcer.className = "offscreen";
    announcer.setAttribute("role", "status");
    document.body.append(announcer);
  }

  function announce(text) {
    if (!announcer) makeAnnouncer(); // a copy before the page finished loading
    announcer.textContent = "";
    setTimeout(() => (announcer.textContent = text), 50);
  }

  function flash(button, label) {
    if (!button.dataset.label) button.dataset.label = button.textContent;
    button.textContent = label;
    announce(label);
    clearTimeout(button.flashTimer);
    button.flashTimer = setTimeout(() => (button.textContent = button.dataset.label), FLASH_MS);
  }

  window.kogClipboard = { copy, flash };

  document.addEventListener("DOMContentLoaded", () => announcer || makeAnnouncer());

  document.addEventListener("click", (event) => {
    const button = event.target.closest && event.target.closest("[data-copy-from], [data-copy-code-from]");
    const source = button && document.getElementById(button.dataset.copyFrom || button.dataset.copyCodeFrom);
    if (!source) return;
    const text = button.dataset.copyFrom ? source.textContent : window.kogHighlight.fencedCode(source.textContent);
    copy(text).then((ok) => flash(button, ok ? "Copied" : "Press Ctrl+C"));
  });
})();

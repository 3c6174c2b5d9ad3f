/*
 * Syntax highlighting of model output, built as DOM nodes: the text only ever enters the page as
 * text nodes, never as HTML, so nothing the model writes can become markup or script.
 *
 * highlight.js parses the code into a token tree (result._emitter.rootNode in 11.x: strings and
 * {scope, children} nodes); we walk that tree instead of taking its HTML string. Fenced blocks
 * (```lang ... ```) are highlighted in their language and the prose around them stays plain; an
 * output without fences is treated as code. The element's textContent stays exactly the text.
 *
 *   kogHighlight.render(element, text)
 *   <code data-highlight>...</code>   is highlighted on load (the share page)
 */
(function () {
  "use strict";

  const FENCE = /^```[ \t]*([\w+#.-]*)[^\n]*\n([\s\S]*?)^```[ \t]*$/gm;
  const AUTO_LANGUAGES = [
    "python", "javascript", "typescript", "c", "cpp", "csharp", "rust", "go", "java", "kotlin",
    "swift", "bash", "shell", "sql", "json", "yaml", "xml", "css", "markdown", "ruby", "php", "lua",
  ];
  const MAX_CHARS = 200000; // beyond this, highlighting costs more than it helps
  const SNIFF_CHARS = 2000; // auto-detection tries every language: on a prefix only (~20 ms, not ~1 s)

  // highlight.js's scope names -> its CSS classes: "title.function" -> "hljs-title function_"
  function cssClasses(scope) {
    if (scope.startsWith("language:")) return "language-" + scope.slice("language:".length);
    const [head, ...tail] = scope.split(".");
    return ["hljs-" + head, ...tail.map((part, i) => part + "_".repeat(i + 1))].join(" ");
  }

  function build(node, parent) {
    if (typeof node === "string") {
      parent.append(node); // a string argument becomes a text node
      return;
    }
    let target = parent;
    if (node.scope) {
      target = document.createElement("span");
      target.className = cssClasses(node.scope);
      parent.append(target);
    }
    for (const child of node.children || []) build(child, target);
  }

  function appendCode(parent, code, language) {
    const hljs = window.hljs;
    let tree = null;
    if (hljs && code) {
      try {
        if (!language || !hljs.getLanguage(language)) {
          language = hljs.highlightAuto(code.slice(0, SNIFF_CHARS), AUTO_LANGUAGES).language;
        }
        if (language) {
          const result = hljs.highlight(code, { language, ignoreIllegals: true });
          tree = result._emitter && result._emitter.rootNode;
        }
      } catch (err) {
        tree = null;
      }
    }
    if (tree) build(tree, parent);
    else parent.append(code);
  }

  function appendMuted(parent, text) {
    const span = document.createElement("span");
    span.className = "fence";
    span.textContent = text;
    parent.append(span);
  }

  function render(element, text) {
    const fragment = document.createDocumentFragment();
    if (text.length > MAX_CHARS) {
      fragment.append(text);
    } else {
      let at = 0;
      let fenced = false;
      for (const match of text.matchAll(FENCE)) {
        fenced = true;
        fragment.append(text.slice(at, match.index));
        const opening = match[0].slice(0, match[0].indexOf("\n") + 1);
        appendMuted(fragment, opening);
        appendCode(fragment, match[2], match[1].toLowerCase());
        appendMuted(fragment, match[0].slice(opening.length + match[2].length));
        at = match.index + match[0].length;
      }
      if (fenced) fragment.append(text.slice(at));
      else appendCode(fragment, text, null);
    }
    element.replaceChildren(fragment);
  }

  window.kogHighlight = { render };

  document.addEventListener("DOMContentLoaded", function () {
    for (const element of document.querySelectorAll("[data-highlight]")) {
      render(element, element.textContent);
    }
    // highlight.js compiles each grammar on first use (~200 ms for all of them): do it while idle,
    // not in the frame that shows a finished answer.
    const idle = window.requestIdleCallback || ((fn) => setTimeout(fn, 500));
    idle(() => window.hljs && window.hljs.highlightAuto("x = 1\n", AUTO_LANGUAGES));
  });
})();

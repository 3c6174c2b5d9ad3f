/*
 * Syntax highlighting of model output, built as DOM nodes: the text only ever enters the page as
 * text nodes, never as HTML, so nothing the model writes can become markup or script.
 *
 * highlight.js parses the code into a token tree (result._emitter.rootNode in 11.x: strings and
 * {scope, children} nodes); we walk that tree instead of taking its HTML string. Fenced blocks
 * (```lang ... ```) are highlighted in their language and the prose around them stays plain; an
 * output without fences is treated as code. The element's textContent stays exactly the text.
 *
 * Text-direction controls (U+202A-202E, U+2066-2069) are shown, not obeyed: each sits in a span of its
 * own that confines it (CSS isolate) and names it. Obeyed, one reorders the rest of its line, so that
 * code reads other than it runs ("Trojan Source"); the text itself, and so what Copy takes, is unchanged.
 *
 *   kogHighlight.render(element, text, {context, contextElement})
 *       context: the text the model continued (its prompt), read with the output to tell the
 *       language and, when contextElement is given, highlighted with it and shown there
 *   kogHighlight.promptContext({chat, prompt, system, text})   the text a completion continues
 *   kogHighlight.appendText(element, text)   appends text as text nodes, direction controls shown
 *   kogHighlight.fencedCode(text)   the code of the text's fenced blocks, joined by blank lines ("" if none)
 *   <button data-copy-code-from="ID">   shown on load when that element's text has fenced code (the share page)
 *   <code data-highlight data-chat="true|false" data-prompt="ID">   highlighted on load (the share page)
 *   <code data-highlight-turn>   a model's earlier answer, highlighted on load (the share page)
 *   <pre class="prompt-box">   its direction controls shown on load (the share page)
 */
(function () {
  "use strict";

  // Fence lines as CommonMark has them: up to 3 spaces, then 3+ backticks or tildes. An opening one may carry
  // an info string (its first word is the language; a backtick fence's holds no backtick, or a line starting
  // with inline ```code``` would open a block); a closing one carries nothing.
  const OPENING_FENCE = /^ {0,3}(?:(`{3,})[ \t]*([^`\s]*)[^`]*|(~{3,})[ \t]*(\S*).*)$/;
  const CLOSING_FENCE = /^ {0,3}(`{3,}|~{3,})[ \t]*$/;
  // Without a fence the language is guessed; CSS is left out because its grammar matches almost any
  // `a.b = c` line, so it wins on plain Python, and nobody asks a code model for unfenced CSS.
  const AUTO_LANGUAGES = [
    "python", "javascript", "typescript", "c", "cpp", "csharp", "rust", "go", "java", "kotlin",
    "swift", "bash", "shell", "sql", "json", "yaml", "xml", "markdown", "ruby", "php", "lua",
  ];
  // Beyond this the text stays plain: highlighting runs in one go when a run ends, and took 94 ms at
  // 8,000 characters and 264 ms at 70,000 (chromium on a 2-core box), ~1 s near 200,000: a frozen page.
  const MAX_CHARS = 60000;
  const SNIFF_CHARS = 2000; // auto-detection tries every language: on a prefix only (~20 ms, not ~1 s)
  // The models served here are code models, most of them Python ones (the default is trained on the
  // standard library), and a few lines of Python read as Ruby or Kotlin as easily: Python wins unless
  // another language is clearly a better fit.
  const PREFERRED = "python";
  const PREFERRED_MARGIN = 2;
  // A chat template for a base code model (the default's `pycomment`) passes a prompt that already is
  // code through as it is, and the model continues it: such an answer is runnable only after its prompt.
  const CODE_PROMPT = /^\s*(def |async def |class |import |from |@|#)/;
  const DIRECTION_CONTROLS = /([\u202a-\u202e\u2066-\u2069])/;

  // Text, as text nodes (never markup), with each direction control in a span that confines it and
  // that the stylesheet labels with its code point.
  function appendText(parent, text) {
    const parts = text.split(DIRECTION_CONTROLS); // the captured controls sit at the odd indexes
    parts.forEach((part, i) => {
      if (i % 2 === 0) {
        if (part) parent.append(part); // a string argument becomes a text node
        return;
      }
      const control = document.createElement("span");
      control.className = "bidi-control";
      control.dataset.codepoint = "U+" + part.codePointAt(0).toString(16).toUpperCase();
      control.title = `A text-direction control (${control.dataset.codepoint}), shown instead of obeyed`;
      control.textContent = part;
      parent.append(control);
    });
  }

  // highlight.js's scope names -> its CSS classes: "title.function" -> "hljs-title function_"
  function cssClasses(scope) {
    if (scope.startsWith("language:")) return "language-" + scope.slice("language:".length);
    const [head, ...tail] = scope.split(".");
    return ["hljs-" + head, ...tail.map((part, i) => part + "_".repeat(i + 1))].join(" ");
  }

  function build(node, parent) {
    if (typeof node === "string") {
      appendText(parent, node);
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

  function detectLanguage(hljs, sample) {
    const best = hljs.highlightAuto(sample, AUTO_LANGUAGES);
    if (!best.language || best.language === PREFERRED) return best.language || PREFERRED;
    const preferred = hljs.highlight(sample, { language: PREFERRED, ignoreIllegals: true });
    return best.relevance > PREFERRED_MARGIN * preferred.relevance ? best.language : PREFERRED;
  }

  // Appends code to parent as highlighted nodes; returns the language used ("" for plain text).
  function appendCode(parent, code, language, sniffPrefix) {
    const hljs = window.hljs;
    let tree = null;
    if (hljs && code) {
      try {
        if (!language || !hljs.getLanguage(language)) {
          const sample = ((sniffPrefix || "").slice(-SNIFF_CHARS / 2) + code).slice(0, SNIFF_CHARS);
          language = detectLanguage(hljs, sample);
        }
        const result = hljs.highlight(code, { language, ignoreIllegals: true });
        tree = result._emitter && result._emitter.rootNode;
      } catch (err) {
        tree = null;
      }
    }
    if (tree) build(tree, parent);
    else appendText(parent, code);
    return tree ? language : "";
  }

  function appendMuted(parent, text) {
    const span = document.createElement("span");
    span.className = "fence";
    appendText(span, text);
    parent.append(span);
  }

  // Moves the first `offset` characters of container, with the spans around them (split where they
  // straddle the cut), into a fragment: a string can open in the prompt and close in the answer.
  function cutBefore(container, offset) {
    const walker = document.createTreeWalker(container, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    range.setStart(container, 0);
    range.setEnd(container, container.childNodes.length);
    let seen = 0;
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (seen + node.length >= offset) {
        range.setEnd(node, offset - seen);
        break;
      }
      seen += node.length;
    }
    return range.extractContents();
  }

  // The fenced code blocks of a text, in order: offsets of the block (its opening line's start, its end),
  // of its code, and its language. A block is closed by a line of the same character, at least as long and
  // with nothing after it, or by the end of the text (a run stopped in the middle of a block).
  function fencedBlocks(text) {
    const blocks = [];
    let open = null;
    for (let start = 0; start < text.length; ) {
      const newline = text.indexOf("\n", start);
      const end = newline < 0 ? text.length : newline + 1; // the line with its "\n"
      const line = text.slice(start, end).replace(/\r?\n$/, "");
      if (!open) {
        const fence = OPENING_FENCE.exec(line);
        if (fence) {
          const marker = fence[1] || fence[3];
          open = { start, codeStart: end, marker, language: (fence[2] ?? fence[4]).toLowerCase() };
        }
      } else {
        const fence = CLOSING_FENCE.exec(line);
        if (fence && fence[1][0] === open.marker[0] && fence[1].length >= open.marker.length) {
          blocks.push({ ...open, codeEnd: start, end });
          open = null;
        }
      }
      start = end;
    }
    if (open) blocks.push({ ...open, codeEnd: text.length, end: text.length });
    return blocks;
  }

  // The code of an answer's fenced blocks, without the prose around them or the fences: "" when it has none.
  function fencedCode(text) {
    const eol = text.includes("\r\n") ? "\r\n" : "\n"; // the blank line between blocks, in the text's own endings
    return fencedBlocks(text).map((b) => text.slice(b.codeStart, b.codeEnd)).join(eol);
  }

  function renderFenced(fragment, text, blocks) {
    let at = 0;
    let language = "";
    for (const block of blocks) {
      appendText(fragment, text.slice(at, block.start));
      appendMuted(fragment, text.slice(block.start, block.codeStart));
      language = appendCode(fragment, text.slice(block.codeStart, block.codeEnd), block.language) || language;
      appendMuted(fragment, text.slice(block.codeEnd, block.end));
      at = block.end;
    }
    appendText(fragment, text.slice(at));
    return language;
  }

  function render(element, text, options) {
    const context = (options && options.context) || "";
    const contextElement = options && options.contextElement;
    let language = "";
    let shownContext = null; // set when the context is highlighted together with the answer
    const fragment = document.createElement("span");
    const blocks = text.length + context.length > MAX_CHARS ? null : fencedBlocks(text);
    if (!blocks) {
      appendText(fragment, text);
    } else if (blocks.length) {
      language = renderFenced(fragment, text, blocks);
    } else if (contextElement && context) {
      // prompt and answer are one piece of code: highlight them together, then show them apart
      language = appendCode(fragment, context + text, null);
      shownContext = cutBefore(fragment, context.length);
    } else {
      language = appendCode(fragment, text, null, context);
    }
    if (contextElement) {
      contextElement.replaceChildren();
      if (shownContext) contextElement.append(shownContext);
      else appendText(contextElement, context);
    }
    element.replaceChildren(...fragment.childNodes);
    element.dataset.language = language;
    return language;
  }

  function promptContext({ chat, prompt, system, text }) {
    if (!prompt) return "";
    if (!chat) return system ? `${system}\n\n${prompt}` : prompt; // what playground/jobs.py sends
    if (!CODE_PROMPT.test(prompt) || text.includes("```")) return "";
    return prompt.endsWith("\n") ? prompt : prompt + "\n"; // the template ends the prompt's line
  }

  window.kogHighlight = { render, promptContext, appendText, fencedCode };

  document.addEventListener("DOMContentLoaded", function () {
    for (const element of document.querySelectorAll("[data-highlight]")) {
      const text = element.textContent;
      const promptElement = document.getElementById(element.dataset.prompt || "");
      const prompt = promptElement ? promptElement.textContent : "";
      const chat = element.dataset.chat === "true";
      const context = promptContext({ chat, prompt, system: "", text });
      render(element, text, { context, contextElement: document.getElementById("output-context") });
      // code (a completion, or an answer that continues its code prompt) keeps its lines on a phone (the stylesheet)
      if (element.parentElement) element.parentElement.dataset.code = String(!chat || !!context);
    }
    for (const button of document.querySelectorAll("[data-copy-code-from]")) {
      const source = document.getElementById(button.dataset.copyCodeFrom);
      button.hidden = !(source && fencedCode(source.textContent));
    }
    for (const element of document.querySelectorAll("code[data-highlight-turn]")) {
      render(element, element.textContent); // a model's earlier answer in a shared conversation
    }
    for (const element of document.querySelectorAll(".prompt-box:not(.answer-box)")) {
      const text = element.textContent;
      element.replaceChildren();
      appendText(element, text);
    }
    // highlight.js compiles each grammar on first use (~200 ms for all of them): do it while idle,
    // not in the frame that shows a finished answer.
    const idle = window.requestIdleCallback || ((fn) => setTimeout(fn, 500));
    idle(() => window.hljs && window.hljs.highlightAuto("x = 1\n", AUTO_LANGUAGES));
  });
})();

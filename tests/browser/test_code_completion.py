"""The page's code-completion mode in Debian's chromium: the code before and after the cursor in, the middle the
model writes streamed between them, everything text (markup in the code or the output is shown, never run), and
the share page showing the same three parts. The worker serves a tiny checkpoint with FIM tokens."""

from __future__ import annotations

import json

import pytest

from common.code_blocks import cursor_block_indent
from tests.support.fim_checkpoint import fim_stack, greedy_middle
from tests.support.page import open_playground

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

# (the tiny random model writes a long middle after this prefix, 400 tokens, rather than stopping at once)
PREFIX = 'def render(user):\n    html = "<img src=x onerror=alert(1)>" + user\n    x = '
SUFFIX = "\n\n</pre><script>window.pwned = 1</script>\nprint(render('<b>me</b>'))\n"
MAX_TOKENS = 400  # long enough to be seen streaming (several render frames)


@pytest.fixture(scope="module")
def coder(redis_server, tmp_path_factory):
    with fim_stack(redis_server, tmp_path_factory.mktemp("coder")) as served:
        yield served.web, served.checkpoint


def expected_middle(checkpoint) -> str:
    from inference.engine import Engine

    # the page asks the middle to stay in the cursor's block (common/code_blocks.py)
    engine = Engine.load(str(checkpoint), device="cpu")
    return greedy_middle(engine, PREFIX, SUFFIX, MAX_TOKENS, n_indent=cursor_block_indent(PREFIX))[1].text


def test_code_completion_streams_the_middle_between_the_code_and_shares_it(coder, page):
    web, checkpoint = coder
    middle = expected_middle(checkpoint)
    assert len(middle) > 100
    open_playground(page, web.url, model="coder")
    assert page.locator("#suffix-field").is_hidden()
    page.check("#fim")
    assert page.locator("#suffix-field").is_visible()
    assert page.text_content("#prompt-label") == "Code before the cursor"
    page.fill("#prompt", PREFIX)
    page.fill("#suffix", SUFFIX)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    # every text #output shows while the run streams, with the code after the cursor at that moment
    page.evaluate("""() => {
        window.outputs = [];
        const output = document.getElementById("output");
        new MutationObserver(() => window.outputs.push(
            [output.textContent, document.getElementById("output-suffix").textContent])
        ).observe(output, {subtree: true, childList: true, characterData: true});
    }""")
    page.click("#generate")
    page.wait_for_selector("#output[data-stream-check=ok]", timeout=60_000)

    assert page.text_content("#output-context") == PREFIX
    assert page.text_content("#output") == middle
    assert page.text_content("#output-suffix") == SUFFIX
    # the three in order, one block of code: before the cursor, the middle, after it
    assert page.text_content("#output-box") == PREFIX + middle + SUFFIX
    outputs = page.evaluate("window.outputs")
    partial = [text for text, _ in outputs if text and text != middle]
    assert partial and all(middle.startswith(text) for text in partial)  # it grew in place as it streamed
    assert all(suffix == SUFFIX for text, suffix in outputs if text)  # the code after it stayed below
    assert page.locator("#output-box img, #output-box script, #output-box b").count() == 0
    assert page.evaluate("window.pwned") is None
    page.click("#copy")  # Copy takes the three as shown: code that runs as pasted
    page.wait_for_selector("#copy:text('Copied')")
    assert page.evaluate("navigator.clipboard.readText()") == PREFIX + middle + SUFFIX

    share = page.get_attribute("#share", "href")
    page.goto(web.url + share)
    assert page.text_content("#share-prompt").strip("\n") == PREFIX.strip("\n")
    assert page.text_content("#share-suffix").strip("\n") == SUFFIX.strip("\n")
    assert page.text_content("#output") == middle and page.text_content("#output-suffix") == SUFFIX
    assert page.locator("#output-box img, #output-box script, #output-box b").count() == 0

    page.click("#try-it")  # the shared completion comes back as one: both pieces of code, the mode on
    page.wait_for_selector("#suffix-field", state="visible")
    assert page.is_checked("#fim") and page.text_content("#prompt-label") == "Code before the cursor"
    assert page.input_value("#prompt") == PREFIX and page.input_value("#suffix") == SUFFIX
    assert page.evaluate("window.pwned") is None


def test_a_model_without_fim_tokens_is_refused_beside_the_code(coder, page):
    web, _ = coder
    open_playground(page, web.url, model="plain")
    page.check("#fim")
    page.fill("#prompt", "def f(")
    page.fill("#suffix", "):\n    pass\n")
    page.click("#generate")
    page.wait_for_selector("#state[data-state=error]", timeout=15_000)
    assert "plain has no fill-in-the-middle tokens" in page.text_content("body")


def test_a_cursor_at_the_files_start_completes_and_earlier_turns_are_left_out_saying_so(coder, page):
    web, checkpoint = coder
    from inference.engine import Engine

    engine = Engine.load(str(checkpoint), device="cpu")
    middle = greedy_middle(engine, "", SUFFIX, 40, n_indent=cursor_block_indent(""))[1].text
    open_playground(page, web.url, model="coder")
    sent = []
    page.on("websocket", lambda socket: socket.on("framesent", lambda frame: sent.append(frame)))
    page.reload()  # the socket opened after the listener: its frames are seen
    page.wait_for_selector('#app[data-connected="true"]')
    page.evaluate("kogPage.conversation.setConversation([{prompt: 'Say hi.', answer: 'hi'}])")
    assert page.text_content("#conversation-count") == "follows up on 1 earlier turn"
    page.check("#fim")
    assert page.text_content("#conversation-count") == "code completion leaves out 1 earlier turn"
    assert page.locator("#conversation").is_hidden()
    # a checkbox of its own size, its label on one line
    box, label = page.locator("#fim").bounding_box(), page.locator(".fim-toggle").bounding_box()
    assert box["width"] < 24 and label["height"] < 2 * box["height"] + 8
    page.fill("#prompt", "")  # nothing before the cursor
    page.fill("#suffix", SUFFIX)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "40")
    page.click("#generate")
    page.wait_for_selector("#output[data-stream-check=ok]", timeout=60_000)
    assert page.text_content("#output") == middle
    generate = [json.loads(f) for f in sent if isinstance(f, str) and '"generate"' in f]
    assert generate and "history" not in generate[-1] and generate[-1]["suffix"] == SUFFIX

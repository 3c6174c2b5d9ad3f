"""The share page /g/<id>: its link preview, caching and robots policy, its ids and URLs, the settings it
shows; and, in Debian's chromium, what a person sees of a run's texts (newlines, long prompts, no output).

The browser tests read rows written straight into the database of a daphne of their own: a share page
needs no worker, and so any run can be shown exactly (a chat stopped before its output, an API client's
stop strings, a long system prompt).
"""

from __future__ import annotations

import html
import json
import re
import sqlite3
import time
from datetime import UTC, datetime

import pytest

from playground.models import Generation
from tests.support import WebServer
from tests.support.page import new_page

XSS = '<img src=x onerror=alert(1)> & "quoted"'
# what an API client's run stores: every setting, most at the value that changes nothing
API_PARAMS = {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0,
              "seed": None, "stop": []}  # fmt: skip


def make_generation(**fields) -> Generation:
    defaults = {"job_id": f"job-{time.monotonic_ns()}", "model": "coder", "prompt": "p", "output": "o",
                "finish_reason": "stop"}  # fmt: skip
    return Generation.objects.create(**{**defaults, **fields})


def tag_attribute(page: str, tag: str, key: str, value: str) -> str:
    """The content="..." of <meta key="value" content="...">, unescaped."""
    found = re.search(rf'<{tag} {key}="{value}" content="([^"]*)">', page)
    assert found, f"no <{tag} {key}={value!r}>"
    return html.unescape(found.group(1))


def shown_params(page: str) -> dict[str, str]:
    dl = re.search(r'<dl class="final-stats params" id="params">(.*?)</dl>', page, re.S).group(1)
    return {html.unescape(k): html.unescape(v) for k, v in re.findall(r"<dt>(.*?)</dt><dd>(.*?)</dd>", dl)}


# ---- HTTP: the Django test client ----------------------------------------------------------------------


@pytest.mark.django_db
def test_the_share_page_has_a_title_and_link_preview_and_may_be_cached_but_not_indexed(client):
    first_line = f"def quicksort(xs):  # {XSS} " + "sorted " * 20
    output = "    if len(xs) <= 1:\n        return xs\n" + "x" * 500
    row = make_generation(prompt=f"\n\n{first_line}\n    pass\n", output=output, model="qwen-coder")
    response = client.get(f"/g/{row.id}?utm_source=x")  # a link as shared, tracking and all
    page = response.content.decode()

    title = html.unescape(re.search(r"<title>(.*?)</title>", page, re.S).group(1))
    # the first line that says anything, its spaces collapsed, cut at 60 characters; then the model
    assert (
        title == 'def quicksort(xs): # <img src=x onerror=alert(1)> & "quoted… · qwen-coder · Kog playground'
    )
    description = tag_attribute(page, "meta", "name", "description")
    assert description.startswith("qwen-coder: if len(xs) <= 1: return xs xxx") and description.endswith("…")
    assert len(description) < 260
    assert tag_attribute(page, "meta", "property", "og:title") == title.removesuffix(" · Kog playground")
    assert tag_attribute(page, "meta", "property", "og:description") == description
    assert tag_attribute(page, "meta", "property", "og:url") == f"http://testserver/g/{row.id}"
    assert tag_attribute(page, "meta", "name", "twitter:card") == "summary"  # a card, not a bare link
    assert XSS not in page  # escaped everywhere, the <head> included
    assert tag_attribute(page, "meta", "name", "robots") == "noindex"
    assert response["X-Robots-Tag"] == "noindex"
    assert response["Cache-Control"] == "public, max-age=300"  # a takedown reaches caches within 5 minutes

    missing = client.get("/g/NoSuchRun123")
    assert missing.status_code == 404 and "public" not in missing.get("Cache-Control", "")


@pytest.mark.django_db
def test_a_title_reads_the_prompts_first_line_without_direction_controls_and_a_run_without_output(client):
    row = make_generation(prompt="x = '\u202eabc'\nmore", output="", finish_reason="cancelled")
    page = client.get(f"/g/{row.id}").content.decode()
    title = html.unescape(re.search(r"<title>(.*?)</title>", page).group(1))
    assert title == "x = ' abc' · coder · Kog playground"
    assert tag_attribute(page, "meta", "name", "description") == "coder: (no output)"


@pytest.mark.django_db
def test_new_ids_old_ids_and_a_link_with_a_slash_added(client):
    new = make_generation()
    assert re.fullmatch(r"[A-Za-z0-9]{12}", new.id)
    old = make_generation(id="AbC-dEf_12_-")  # a base64url id of before: still served
    for row in (new, old):
        assert client.get(f"/g/{row.id}").status_code == 200
        response = client.get(f"/g/{row.id}/")
        assert (response.status_code, response["Location"]) == (301, f"/g/{row.id}")
    assert client.get("/g/NoSuchRun123/", follow=True).status_code == 404


@pytest.mark.django_db
def test_settings_at_their_neutral_value_are_left_out_and_stop_strings_are_shown_escaped(client):
    plain = make_generation(params=API_PARAMS)
    page = client.get(f"/g/{plain.id}").content.decode()
    assert shown_params(page) == {"Temperature": "1.0", "Max tokens": "64"}  # no Top-k 0, no penalty 1.0
    assert 'id="left-out"' not in page and "all but" not in page

    stops = ["\n\n", "</s>", "a\u202eb"]
    row = make_generation(params={**API_PARAMS, "seed": 7, "top_k": 40, "stop": stops})
    page = client.get(f"/g/{row.id}").content.decode()
    params = shown_params(page)
    assert params["Top-k"] == "40" and params["Seed"] == "7"
    assert (
        params["Stop"] == '"\\n\\n" "</s>" "a\\u202eb"'
    )  # as a string literal spells them; the control named
    assert "</s>" not in page and "\u202e" not in page
    # Try it yourself brings what the playground has fields for, and says what it leaves out
    note = re.search(r'<p class="muted" id="left-out">(.*?)</p>', page).group(1)
    assert note == (
        "Try it yourself brings every setting but the seed, top-k and the stop strings: "
        "the playground has no field for them."
    )
    try_it = html.unescape(re.search(r'<a class="pill" id="try-it" [^>]*title="([^"]*)"', page).group(1))
    assert "all but the seed, top-k and the stop strings" in try_it

    penalty = make_generation(params={"temperature": 0.2, "repetition_penalty": 1.3})
    page = client.get(f"/g/{penalty.id}").content.decode()
    assert shown_params(page) == {"Temperature": "0.2", "Repetition penalty": "1.3"}
    assert "every setting but the repetition penalty: the playground has no field for it." in page


# ---- what a person sees: chromium --------------------------------------------------------------------

COLUMNS = ("id", "job_id", "model", "prompt", "system_prompt", "messages", "params", "output", "finish_reason",
           "source", "created", "prompt_tokens", "completion_tokens", "total_ms")  # fmt: skip


def insert(server: WebServer, **fields) -> str:
    """A generation row in the daphne's own database; returns its share path."""
    row = {"id": f"t{time.monotonic_ns() % 10**11}", "job_id": f"job-{time.monotonic_ns()}", "model": "coder",
           "prompt": "p", "system_prompt": "", "messages": None, "params": {}, "output": "o",
           "finish_reason": "stop", "source": "web", "prompt_tokens": 3, "completion_tokens": 3, "total_ms": 9.0,
           "created": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f"), **fields}  # fmt: skip
    for key in ("messages", "params"):
        row[key] = None if row[key] is None else json.dumps(row[key])
    path = server.env["DATABASE_URL"].removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        db.execute(
            f"INSERT INTO playground_generation ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
            [row[c] for c in COLUMNS],
        )
    return f"{server.url}/g/{row['id']}"


@pytest.fixture(scope="module")
def server(redis_server, tmp_path_factory):
    web = WebServer(redis_server, tmp_path_factory.mktemp("share"))  # no worker: a share page needs none
    yield web
    web.stop()


PHONE = {
    "viewport": {"width": 390, "height": 844},
    "device_scale_factor": 3,
    "is_mobile": True,
    "has_touch": True,
}


@pytest.mark.browser
def test_the_first_newlines_of_a_prompt_a_system_prompt_and_a_turn_are_kept(server, page):
    prompt = "\n\ndef f():\n    pass\n"
    messages = [
        {"role": "system", "content": "\nbe brief"},
        {"role": "user", "content": "\n\nfirst"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": prompt},
    ]
    page.goto(insert(server, prompt=prompt, system_prompt="\nbe brief", messages=messages, output="x = 1\n"))
    assert page.text_content("#share-prompt") == prompt
    assert page.text_content("#share-system-prompt") == "\nbe brief"
    assert page.text_content("#share-turns .turn pre:not(.answer-box)") == "\n\nfirst"
    assert page.errors == []


@pytest.mark.browser
def test_a_completion_continues_its_prompts_line_and_an_answer_opening_with_a_newline_breaks_it_once(
    server, page
):
    for prompt, output in [("total = add(1, 2", ") + 3\nprint(total)\n"), ("\n\nx = (1", "\n     + 2)\n")]:
        page.goto(insert(server, prompt=prompt, output=output))
        # the text as laid out: the dimmed prompt, then the answer, with no line break between them
        assert page.evaluate("document.getElementById('output-box').innerText") == prompt + output
        tops = page.evaluate("""() => {
            const last = [...document.getElementById('output-context').getClientRects()].at(-1);
            const first = document.getElementById('output').getClientRects()[0];
            return [last.top, first.top];
        }""")
        if not output.startswith("\n"):
            assert tops[0] == tops[1], tops  # the answer starts on the prompt's last line
    assert page.errors == []


@pytest.mark.browser
def test_on_a_phone_long_prompts_scroll_in_their_own_boxes_and_the_output_stays_near_the_top(server, browser):
    long_text = "".join(f"prompt line {i:03d}\n" for i in range(300))
    url = insert(
        server, prompt=long_text, system_prompt=long_text.replace("prompt", "system"), output="done\n"
    )
    phone = new_page(browser, **PHONE)
    try:
        phone.goto(url)
        for box in ("#share-system-prompt", "#share-prompt"):
            height = phone.locator(box).bounding_box()["height"]
            assert 100 < height < 240, (box, height)  # ~14 lines, not 300
            assert phone.get_attribute(box, "aria-label")
        assert phone.locator("#output-box").bounding_box()["y"] < 2 * PHONE["viewport"]["height"]
        # the boxes are reached by Tab and scroll by keyboard
        phone.focus("#try-it")
        phone.keyboard.press("Tab")
        assert phone.evaluate("document.activeElement.id") == "share-system-prompt"
        phone.keyboard.press("Tab")
        assert phone.evaluate("document.activeElement.id") == "share-prompt"
        phone.keyboard.press("PageDown")
        phone.wait_for_function("() => document.getElementById('share-prompt').scrollTop > 0")
        assert phone.text_content("#share-prompt") == long_text  # all of it, scrolled to
        assert phone.errors == []
    finally:
        phone.context.close()


PLACEHOLDERS = """() => [...document.querySelectorAll('*')]
    .map((el) => getComputedStyle(el, '::before').content)
    .filter((content) => content.includes('Output streams here'))"""


@pytest.mark.browser
def test_a_chat_stopped_before_any_output_says_so_not_the_playgrounds_placeholder(server, page):
    messages = [{"role": "user", "content": "write a parser"}]
    page.goto(insert(server, prompt="write a parser", messages=messages, output="", finish_reason="cancelled",
                     completion_tokens=0))  # fmt: skip
    assert page.evaluate(PLACEHOLDERS) == []
    assert page.is_visible("text=(no output)")
    assert "stopped before any output" in page.text_content(".share-head")
    assert page.errors == []

    page.goto(server.url)  # the playground's empty box still says what it is for
    assert page.evaluate(PLACEHOLDERS) == ['"Output streams here."']


@pytest.mark.django_db
def test_a_chats_template_variables_are_stored_and_shown_as_sent(client):
    from common.protocol import JobSpec
    from playground.store import row_fields

    spec = JobSpec("coder", messages=[{"role": "user", "content": "hi"}], chat=True, params=API_PARAMS,
                   template_kwargs={"enable_thinking": False, "note": "a\u202eb <i>"})  # fmt: skip
    row = make_generation(**{**row_fields(spec, {"text": "o", "finish_reason": "stop"}), "job_id": spec.id})
    page = client.get(f"/g/{row.id}").content.decode()
    assert (
        shown_params(page)["Chat template variables"] == '{"enable_thinking": false, "note": "a\\u202eb <i>"}'
    )
    assert "<i>" not in page and "\u202e" not in page  # escaped, the direction control named
    note = re.search(r'<p class="muted" id="left-out">(.*?)</p>', page).group(1)
    assert "the chat template variables" in note
    assert (
        "chat_template_kwargs"
        not in row_fields(JobSpec("coder", prompt="p", params=API_PARAMS), {})["params"]
    )

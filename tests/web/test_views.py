"""Pages: the playground, share links, the admin list, the health check; and the page served by daphne."""

from __future__ import annotations

import re
import urllib.request

import pytest

from playground.models import Generation

pytestmark = pytest.mark.django_db

XSS = '<img src=x onerror=alert(1)><script>alert("pwned")</script>'


@pytest.fixture(autouse=True)
def web_settings(settings, redis_url):
    settings.REDIS_URL = redis_url
    return settings


def make_generation(**fields) -> Generation:
    defaults = {"job_id": "job-1", "model": "tiny", "prompt": "p", "output": "o", "finish_reason": "length"}
    return Generation.objects.create(**{**defaults, **fields})


def test_page_has_every_control_and_no_inline_script(client):
    html = client.get("/").content.decode()
    for element_id in ("prompt", "model", "generate", "stop", "output", "tok-s", "ttft", "tokens", "queue",
                       "system-prompt", "temperature", "top-p", "max-tokens", "worker-status", "elapsed"):  # fmt: skip
        assert f'id="{element_id}"' in html, element_id
    assert 'ws-connect="/ws/generate/"' in html
    scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S)
    assert scripts and all(body.strip() == "" for body in scripts)  # every script comes from a file
    assert all("src=" in tag for tag in re.findall(r"<script\b[^>]*>", html))
    assert not re.search(r"\son[a-z]+\s*=", html)  # no inline event handlers
    assert "no worker up" in html
    assert "{#" not in html and "#}" not in html  # a template comment over two lines is printed, not dropped


def test_page_lists_the_models_of_live_workers(client, redis_url):
    import redis

    from common.protocol import WorkerChannel

    channel = WorkerChannel(
        redis.Redis.from_url(redis_url, decode_responses=True), "w1", ["tiny", "standin:5"]
    )
    channel.heartbeat({"device": "cpu", "job": None})
    html = client.get("/").content.decode()
    assert '<option value="tiny">tiny</option>' in html and '<option value="standin:5">' in html
    assert "1 worker up · cpu" in html


def test_share_link_shows_prompt_output_and_stats_escaped(client):
    row = make_generation(
        prompt="say <b>hi</b>", output=XSS, prompt_tokens=7, completion_tokens=3, prefill_ms=12.5, ttft_ms=20.0,
        decode_tok_s=321.0, total_ms=40.0, bandwidth_gbs=2400.0, peak_pct=50.0,
    )  # fmt: skip
    response = client.get(f"/g/{row.id}")
    html = response.content.decode()
    assert response.status_code == 200
    assert "{#" not in html and "#}" not in html
    assert "<img src=x" not in html and '<script>alert("pwned")' not in html
    assert "&lt;img src=x onerror=alert(1)&gt;&lt;script&gt;" in html
    assert "say &lt;b&gt;hi&lt;/b&gt;" in html
    for shown in ("321.0 tok/s", "12.5 ms", "20.0 ms", "2,400 GB/s (50% of peak)"):
        assert shown in html
    assert client.get("/g/doesnotexist").status_code == 404


@pytest.mark.parametrize(
    "fields, label",
    [
        ({"finish_reason": "stop"}, "end of answer"),
        ({"finish_reason": "length", "completion_tokens": 256}, "reached max tokens"),  # the default 256
        (
            {"finish_reason": "length", "completion_tokens": 40, "params": {"max_new_tokens": 40}},
            "reached max tokens",
        ),
        (
            {"finish_reason": "length", "completion_tokens": 39, "params": {"max_new_tokens": 40}},
            "context full",
        ),
        ({"finish_reason": "cancelled", "output": "def f("}, "stopped · partial output kept"),
        ({"finish_reason": "cancelled", "output": ""}, "stopped before any output"),
    ],
)
def test_share_page_says_why_the_run_ended_in_the_playgrounds_words(client, fields, label):
    html = client.get(f"/g/{make_generation(**fields).id}").content.decode()
    assert f"UTC · {label}</span>" in html and "finish:" not in html


def test_admin_lists_generations_to_staff_only(client, django_user_model):
    row = make_generation()
    url = "/admin/playground/generation/"
    response = client.get(url)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    client.force_login(django_user_model.objects.create_superuser("admin", "a@example.com", "pw"))
    page = client.get(url).content.decode()
    assert row.id in page and "tiny" in page


def test_the_probes_are_routed_and_the_page_says_when_redis_is_down(client, settings):
    # (what /healthz, /readyz and /metrics answer is tested in test_health.py and test_metrics.py)
    assert client.get("/healthz").json() == {"ok": True}
    assert client.get("/readyz").status_code == 503  # no worker is up
    assert b"kog_queue_depth" in client.get("/metrics").content
    from common.redis_server import free_port

    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    assert client.get("/healthz").status_code == 200  # alive all the same
    assert "job queue unreachable" in client.get("/").content.decode()


def test_daphne_serves_page_and_static_files_with_debug_off(start_web):
    server = start_web()
    with urllib.request.urlopen(server.url + "/") as response:
        html = response.read().decode()
    for path in re.findall(r'(?:src|href)="(/static/[^"]+)"', html):
        with urllib.request.urlopen(server.url + path) as response:
            assert response.status == 200 and len(response.read()) > 0, path
    assert "/static/vendor/htmx/htmx.min.js" in html and "/static/vendor/htmx-ext-ws/ws.min.js" in html

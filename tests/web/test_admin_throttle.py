"""The admin on a live daphne: where PLAYGROUND_ADMIN_PATH puts it, and its login throttled per address."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def add_admin(web, password: str) -> None:
    env = {**web.env, "DJANGO_SUPERUSER_PASSWORD": password}
    subprocess.run([sys.executable, "manage.py", "createsuperuser", "--noinput", "--username", "boss",
                    "--email", "boss@example.com"], cwd=ROOT, env=env, check=True, capture_output=True)  # fmt: skip


def log_in(client: httpx.Client, login_url: str, password: str) -> httpx.Response:
    form = client.get(login_url)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    fields = {"csrfmiddlewaretoken": token, "username": "boss", "password": password}
    return client.post(login_url, data=fields, headers={"Referer": login_url})


def test_the_admin_lives_where_configured_and_the_sixth_wrong_password_in_a_minute_is_throttled(start_web):
    web = start_web({"PLAYGROUND_ADMIN_PATH": "/backstage/"})
    add_admin(web, "right-horse-battery")
    login = f"{web.url}/backstage/login/"
    with httpx.Client(timeout=30) as client:
        assert client.get(f"{web.url}/admin/login/").status_code == 404  # not at the usual place
        for _ in range(5):
            wrong = log_in(client, login, "wrong")
            assert wrong.status_code == 200 and "correct username and password" in wrong.text
        throttled = log_in(client, login, "wrong")
        assert throttled.status_code == 429 and 1 <= int(throttled.headers["Retry-After"]) <= 60
        assert "Too many wrong passwords" in throttled.text
        # the right password too, until the minute is over: a guesser learns nothing from it
        assert log_in(client, login, "right-horse-battery").status_code == 429
    # another address is not held back by this one's guesses
    with httpx.Client(timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.2")) as client:
        welcome = log_in(client, login, "right-horse-battery")
        assert welcome.status_code == 302  # logged in

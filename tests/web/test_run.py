"""`python -m playground.run` (what `make run` calls) as a person runs it in a terminal, up to Ctrl-C."""

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from common.redis_server import free_port
from inference.synth import synth
from tests.support.launcher import alive, children, ctrl_c, launched, read_until, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_ctrl_c_stops_the_worker_before_its_redis_and_leaves_nothing_running(tmp_path):
    with launched(tmp_path) as (launcher, port):
        lines: list[str] = []
        read_until(launcher, "Playground: http://", lines)
        assert launcher.poll() is None, "".join(lines)
        started = children(launcher.pid)  # redis-server, daphne and the worker
        assert len(started) == 3, "".join(lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as page:
            assert page.status == 200
        rest = ctrl_c(launcher)
    assert launcher.returncode == 0, rest
    assert [pid for pid in started if alive(pid)] == []
    # the worker retires its heartbeat on the way out: its Redis must still be up then
    assert "redis unavailable" not in rest and "heartbeat failed" not in rest, rest


def test_a_model_given_on_the_command_line_is_what_the_web_offers_and_a_stalled_worker_restarts(tmp_path):
    stall = {"KOG_STALL_TIMEOUT_S": "1", "KOG_STALL_EXIT_S": "1"}
    # a token every 20 s: it stalls
    with launched(tmp_path, "--model", "standin:0.05", env=stall) as (launcher, port):
        url = f"http://127.0.0.1:{port}"
        lines: list[str] = []
        read_until(launcher, "Playground: http://", lines)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
            served = [m["id"] for m in json.load(reply)["data"]]
        assert served == ["standin:0.05"]  # not the default beside it
        worker = workers(launcher)
        body = json.dumps({"model": "standin:0.05", "prompt": "abc", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as stalled:
            urllib.request.urlopen(request, timeout=60)
        assert stalled.value.code == 503 and json.load(stalled.value)["error"]["code"] == "stalled"
        read_until(launcher, "starting it again", lines)
        assert launcher.poll() is None  # the playground stays up
        restarted = []
        for _ in range(50):  # the line comes just before the new worker starts
            restarted = workers(launcher)
            if restarted:
                break
            time.sleep(0.1)
        assert len(restarted) == 1 and restarted != worker
        rest = ctrl_c(launcher)
    assert launcher.returncode == 0, "".join(lines) + rest


def test_a_redis_url_that_answers_nothing_ends_the_launch_in_one_line(tmp_path):
    with launched(tmp_path, env={"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}) as (launcher, _):
        output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert output.strip().startswith("cannot reach Redis at REDIS_URL=redis://127.0.0.1:"), output
    assert "Traceback" not in output and output.strip().count("\n") == 0, output


def test_relative_models_are_the_callers_folders_by_the_names_they_give(tmp_path):
    # The worker and daphne run in the repository: `./my-ft` must be the caller's folder, not one there.
    here = tmp_path / "checkpoints"
    synth("tiny-llama", here / "my-ft", seed=0)
    env = {"MODELS": "./my-ft, alias=./my-ft"}
    with launched(tmp_path, env=env, cwd=here) as (launcher, port):
        lines: list[str] = []
        read_until(launcher, "Playground: http://", lines)
        # the page is up while the worker still loads (it lists a loading worker's downloads): wait for it to serve
        deadline = time.monotonic() + 90
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as reply:
                served = {m["id"]: m["workers"] for m in json.load(reply)["data"]}
            if served == {"my-ft": 1, "alias": 1} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert served == {"my-ft": 1, "alias": 1}, "".join(lines)
        rest = ctrl_c(launcher)
    assert launcher.returncode == 0, "".join(lines) + rest


def test_two_models_of_one_name_end_the_launch_in_one_line_naming_both(tmp_path):
    for run in ("a", "b"):
        (tmp_path / run / "checkpoint-500").mkdir(parents=True)
    args = ["--model", "./a/checkpoint-500", "--model", "./b/checkpoint-500"]
    with launched(tmp_path, *args, cwd=tmp_path) as (launcher, _):
        output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert output.strip() == (
        f"'{tmp_path}/a/checkpoint-500' and '{tmp_path}/b/checkpoint-500' would both be served as "
        f"'checkpoint-500': give one another name with name=path (e.g. checkpoint-500-2={tmp_path}/b/checkpoint-500),"
        " or rename a folder"
    ), output


def test_relative_entries_are_made_absolute_and_the_rest_left_alone(tmp_path, monkeypatch):
    from playground.run import absolute_entries

    (tmp_path / "my-ft").mkdir()
    monkeypatch.chdir(tmp_path)
    entries = ["./my-ft", "my-ft", "ft=my-ft", "tiny-llama", "standin:5", "~/x", "/abs/y", "./not-here"]
    assert absolute_entries(entries) == [
        f"{tmp_path}/my-ft", f"{tmp_path}/my-ft", f"ft={tmp_path}/my-ft", "tiny-llama", "standin:5", "~/x",
        "/abs/y", "./not-here",
    ]  # fmt: skip


def test_it_serves_as_production_with_no_debug_page_and_the_enforced_policy(tmp_path):
    # a fresh machine: no secret key and no DJANGO_DEBUG in the environment (the launcher makes a key in var/)
    env = {"DJANGO_SECRET_KEY": "", "DJANGO_DEBUG": ""}
    with launched(tmp_path, "--no-worker", env=env) as (launcher, port):
        lines: list[str] = []
        read_until(launcher, "Playground: http://", lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as page:
            assert "default-src 'self'" in page.headers["Content-Security-Policy"]
            assert page.headers["Content-Security-Policy-Report-Only"] is None
        foreign = urllib.request.Request(f"http://127.0.0.1:{port}/", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(foreign, timeout=30)
        body = refused.value.read().decode()
        assert refused.value.code == 400 and "Bad Request" in body, body
        for secret_word in ("DisallowedHost", "SECRET_KEY", "settings", "Traceback", "ALLOWED_HOSTS"):
            assert secret_word not in body
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/no/such/page", timeout=30)
        assert missing.value.code == 404 and "URLconf" not in missing.value.read().decode()
        rest = ctrl_c(launcher)
    assert launcher.returncode == 0, "".join(lines) + rest
    # the refused Host in the log: one line naming it, no traceback (scanners send such requests all day)
    assert "Invalid HTTP_HOST header: 'evil.example'" in rest and "Traceback" not in rest, rest


def test_debug_pages_are_refused_off_loopback(tmp_path):
    with launched(tmp_path, "--host", "0.0.0.0", "--no-worker", env={"DJANGO_DEBUG": "1"}) as (launcher, _):
        output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert output.strip().startswith("DJANGO_DEBUG is on: its error pages show the settings"), output


def test_a_port_already_served_ends_the_launch_in_one_line_before_anything_starts(tmp_path):
    with socket.socket() as other:  # an earlier playground, still running
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with launched(tmp_path, "--port", str(port), "--no-worker") as (launcher, _):
            output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert output.strip() == (
        f"cannot serve on 127.0.0.1:{port}: Address already in use (another playground still running?); stop it, "
        "or choose another port: --port N (make run RUN_ARGS='--port N')"
    ), output  # and no redis-server started: it said nothing of one


def test_a_model_that_cannot_load_ends_the_launch_instead_of_restarting_its_worker(tmp_path):
    (tmp_path / "not-a-checkpoint").mkdir()
    with launched(tmp_path, "--model", str(tmp_path / "not-a-checkpoint")) as (launcher, _):
        started = set()
        for _ in range(100):  # every child seen before they end
            started |= set(children(launcher.pid))
            if launcher.poll() is not None:
                break
            time.sleep(0.1)
        output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode not in (0, None)
    assert "cannot load model" in output and "Traceback" not in output, output
    assert "starting it again in" not in output and "restarted" not in output, output
    assert [pid for pid in started if alive(pid)] == []


def test_a_web_setting_it_cannot_use_ends_the_launch_in_one_line(tmp_path):
    with launched(tmp_path, "--no-worker", env={"PLAYGROUND_MAX_QUEUE": "abc"}) as (launcher, _):
        output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 2
    assert output.strip().splitlines()[-1] == (
        "PLAYGROUND_MAX_QUEUE: must be a whole number of jobs, 0 or more (0: no bound), got 'abc'"
    ), output
    assert "Traceback" not in output, output


def test_served_to_other_machines_it_answers_to_this_machines_names(tmp_path):
    from playground.run import machine_names

    with launched(tmp_path, "--host", "0.0.0.0", "--no-worker", env={"DJANGO_ALLOWED_HOSTS": ""}) as (
        launcher,
        port,
    ):
        lines: list[str] = []
        read_until(launcher, "It answers to: ", lines)
        for name in machine_names():  # what another machine's browser sends as Host
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/healthz", headers={"Host": f"{name}:{port}"}
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert reply.status == 200, name
        rest = ctrl_c(launcher)
    assert launcher.returncode == 0, "".join(lines) + rest

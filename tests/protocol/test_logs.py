"""Structured logs (common/logs.py): JSON lines that carry the job id wherever the job's code runs."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading

import pytest

from common.logs import JsonFormatter, PlainFormatter, configure_logging, job_context, logging_config


@pytest.fixture
def captured():
    """A logger writing through the JSON formatter into a buffer; yields (logger, lines())."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    logger.removeHandler(handler)


def test_a_record_inside_a_job_context_carries_the_job_id_and_outside_it_does_not(captured):
    log, lines = captured
    log.info("before")
    with job_context("job-1"):
        log.info("working on %s", "it", extra={"model": "tiny"})
        with job_context("job-2"):
            log.warning("nested")
        log.info("back")
    log.info("after")
    out = lines()
    assert [e.get("job_id") for e in out] == [None, "job-1", "job-2", "job-1", None]
    assert out[1]["msg"] == "working on it" and out[1]["model"] == "tiny" and out[1]["level"] == "INFO"
    assert (
        out[2]["level"] == "WARNING" and out[0]["logger"] == "test.logs" and out[0]["ts"].endswith("+00:00")
    )


async def test_asyncio_tasks_keep_their_own_job_id(captured):
    log, lines = captured

    async def follow(job_id: str) -> None:
        with job_context(job_id):
            for _ in range(3):
                log.info("tick")
                await asyncio.sleep(0)  # the two tasks interleave here

    await asyncio.gather(follow("a"), follow("b"))
    assert sorted(e["job_id"] for e in lines()) == ["a", "a", "a", "b", "b", "b"]


def test_a_thread_without_the_context_names_the_job_explicitly(captured):
    log, lines = captured
    with job_context("main-job"):
        thread = threading.Thread(target=lambda: log.error("stall", extra={"job_id": "watched"}))
        thread.start()
        thread.join()
        thread = threading.Thread(target=lambda: log.info("no job here"))
        thread.start()
        thread.join()
    assert [e.get("job_id") for e in lines()] == ["watched", None]


def test_exceptions_and_odd_values_stay_one_json_line(captured):
    log, lines = captured
    try:
        raise ValueError("bad <thing>\nsecond line")
    except ValueError:
        log.exception("failed", extra={"obj": object(), "text": "é"})
    (entry,) = lines()
    assert "ValueError: bad <thing>" in entry["exc"] and entry["text"] == "é" and "object" in entry["obj"]


def test_plain_format_for_a_terminal_and_a_clear_error_for_an_unknown_one():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (), None)
    with job_context("j9"):
        assert PlainFormatter().format(record).endswith("INFO x hello [job j9]")
    assert PlainFormatter().format(record).endswith("INFO x hello")
    with pytest.raises(ValueError, match="LOG_FORMAT: must be json or plain, got 'xml'"):
        logging_config(fmt="xml")


def test_configure_logging_installs_the_formatter_on_the_root_logger(monkeypatch):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        monkeypatch.setenv("LOG_FORMAT", "json")
        configure_logging(level="WARNING")
        assert root.level == logging.WARNING
        assert isinstance(root.handlers[-1].formatter, JsonFormatter)
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])

"""Structured logs for the worker and the web process: one JSON object per line, with the job id.

    LOG_FORMAT=json (default) | plain        LOG_LEVEL=INFO (default) | DEBUG | WARNING ...

Code that works on a job runs inside `job_context(job_id)`; every record logged there (including
from asyncio tasks started inside it, which copy the context) carries "job_id", so one grep
follows a job from the websocket through the queue to the worker. A record can also name its job
explicitly: `log.info("...", extra={"job_id": job_id})` (a watchdog thread has no context).
Torch-free and Django-free: the web process and the worker both import it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

job_id_var: ContextVar[str | None] = ContextVar("job_id", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


@contextmanager
def job_context(job_id: str) -> Iterator[None]:
    token = job_id_var.set(job_id)
    try:
        yield
    finally:
        job_id_var.reset(token)


def record_job_id(record: logging.LogRecord) -> str | None:
    return getattr(record, "job_id", None) or job_id_var.get()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        job_id = record_job_id(record)
        if job_id:
            entry["job_id"] = job_id
        for key, value in vars(record).items():
            if key not in _STANDARD and key != "job_id" and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """For a terminal: the usual line, with [job <id>] when there is one."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        job_id = record_job_id(record)
        return f"{line} [job {job_id}]" if job_id else line


class WithoutTraceback(logging.Filter):
    """For expected refusals that Django logs with their exception (a request for a Host the site does not answer
    to: scanners, a mistyped name): the message says it all, the traceback would bury the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def formatter_class(fmt: str | None = None) -> type[logging.Formatter]:
    fmt = (fmt or os.environ.get("LOG_FORMAT", "json")).strip().lower()
    if fmt not in ("json", "plain"):
        raise ValueError(f"LOG_FORMAT: must be json or plain, got {fmt!r}")
    return JsonFormatter if fmt == "json" else PlainFormatter


def logging_config(level: str | None = None, fmt: str | None = None) -> dict:
    """A `logging.config.dictConfig` dict (Django's LOGGING setting takes it as is)."""
    cls = formatter_class(fmt)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"()": f"{cls.__module__}.{cls.__qualname__}"}},
        "filters": {"without_traceback": {"()": f"{__name__}.WithoutTraceback"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "default"}},
        "loggers": {"django.security.DisallowedHost": {"filters": ["without_traceback"]}},
        "root": {"handlers": ["console"], "level": level or os.environ.get("LOG_LEVEL", "INFO")},
    }


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    import logging.config

    logging.config.dictConfig(logging_config(level, fmt))

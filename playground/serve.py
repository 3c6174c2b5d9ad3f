"""The web process: daphne serving playground.asgi, its websocket message limit following the prompt limit.

    python -m playground.serve [daphne's options, e.g. -b 0.0.0.0 -p 8000]

daphne (autobahn) drops a websocket's connection, without even a close frame, on any message over its own
limit, 1 MiB unless told otherwise: with PLAYGROUND_MAX_PROMPT_CHARS raised past ~246,000 characters, a prompt the playground accepts
would cut the page's connection instead of reaching the consumer. Here daphne takes messages (and frames) up
to the consumer's PLAYGROUND_MAX_FRAME_BYTES and a little more (never less than its own default), and the
consumer answers anything larger than its limit with its clear `frame_too_large` error.
"""

from __future__ import annotations

import os
import sys

APPLICATION = "playground.asgi:application"
DAPHNE_DEFAULT_MESSAGE_BYTES = 1024 * 1024
# Statuses the playground answers that twisted (under daphne) has no reason phrase for: without one the
# status line reads "429 Unknown Status" in curl -i, proxies' logs and clients that print it.
MISSING_REASON_PHRASES = {429: b"Too Many Requests"}


def add_reason_phrases() -> None:
    from twisted.web import http

    for status, phrase in MISSING_REASON_PHRASES.items():
        http.RESPONSES.setdefault(status, phrase)


def daphne_args(argv: list[str], max_frame_bytes: int) -> list[str]:
    """daphne's command line: the caller's options, the message and frame limits (each unless given), then the
    application. A browser sends a message as one frame, so both limits are the same."""
    # headroom past the consumer's limit, so that an oversized frame still gets its error frame
    limit = str(max(DAPHNE_DEFAULT_MESSAGE_BYTES, max_frame_bytes + 64 * 1024))
    args = list(argv)
    for option in ("--websocket-max-message-size", "--websocket-max-frame-size"):
        if not any(a.split("=")[0] == option for a in args):
            args += [option, limit]
    return [*args, APPLICATION]


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "playground.settings")
    from daphne.cli import CommandLineInterface
    from django.conf import settings

    from playground.startup import settings_or_exit

    settings_or_exit()
    add_reason_phrases()
    CommandLineInterface().run(daphne_args(sys.argv[1:] if argv is None else argv,
                                           settings.PLAYGROUND_MAX_FRAME_BYTES))  # fmt: skip


if __name__ == "__main__":
    main()

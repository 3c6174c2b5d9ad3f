"""Request bodies over DATA_UPLOAD_MAX_MEMORY_SIZE are refused as they arrive, not once they are held.

daphne (on Twisted) takes in a whole request body and then queues all of it in memory for the
application before Django reads a byte of it: a 1 GB POST, to any URL and before any API key is
looked at, cost the web process 1 GB (and a body sent chunked, without a Content-Length, was not even
refused by Django). daphne's request class is swapped here, when daphne imports playground.asgi, for
one that counts the body's bytes as they come and answers 413 as soon as they pass the limit (at
once when the Content-Length announces more), then closes the connection.
"""

from __future__ import annotations

import json
import logging

from daphne import http_protocol
from django.conf import settings

from playground.api.errors import body_too_large

log = logging.getLogger(__name__)

TOO_LARGE = json.dumps(body_too_large().body).encode()  # the API's 413, in OpenAI's shape


def refusal() -> bytes:
    """A whole HTTP response, written straight to the socket: the request never reaches Django."""
    head = (
        "HTTP/1.1 413 Content Too Large\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(TOO_LARGE)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + TOO_LARGE


class BodyCappedRequest(http_protocol.WebRequest):
    received = 0
    refused = False

    def gotLength(self, length):
        super().gotLength(length)
        if length is not None and self.over_limit(length):
            # no "100 Continue" after the refusal: the client must not start sending
            self.requestHeaders.removeHeader(b"expect")
            self.refuse()

    def handleContentChunk(self, data):
        if self.refused:  # what was already read from the socket when the refusal went out
            return
        self.received += len(data)
        if self.over_limit(self.received):
            return self.refuse()
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        if not self.refused:
            super().requestReceived(command, path, version)

    @staticmethod
    def over_limit(size: int) -> bool:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return limit is not None and size > limit

    def refuse(self) -> None:
        self.refused = True
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        log.warning("refused a request body over %d bytes from %s", limit, self.getClientAddress())
        self.content.close()
        self.channel.transport.write(refusal())
        self.channel.loseConnection()  # stops reading: the rest of the body is never taken in


def install() -> None:
    """daphne's HTTP factory picks its request class up from this name for each new connection."""
    http_protocol.WebRequest = BodyCappedRequest

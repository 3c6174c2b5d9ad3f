"""Static file URLs that change when the file does: /static/playground/playground.js?v=<content hash>.

The files are served straight from static/ (asgi.py), with a Last-Modified header and no
collectstatic step, so nothing renames them when they change. A browser that cached playground.js
under a heuristic lifetime would then run last version's script against this version's page (ids and
frames that no longer match) until the cache expires. With the hash in the URL a new page asks for the
new file, and an unchanged file keeps its URL and its cached copy.

cache_control() says so to browsers and proxies: a URL whose version is the file's current hash never
changes (a year, immutable: a page load asks nothing again); any other URL of a file (no version, an old
one) is revalidated on each use (Last-Modified, then a 304).
"""

from __future__ import annotations

import functools
import hashlib
import os

from django.contrib.staticfiles import finders
from django.contrib.staticfiles.storage import StaticFilesStorage


@functools.lru_cache(maxsize=256)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    # keyed by mtime and size too, so that an edited file (runserver, DEBUG) gets a new version at once
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def content_version(path: str) -> str:
    """The first 12 hex digits of the file's SHA-256."""
    stat = os.stat(path)
    return _digest(path, stat.st_mtime_ns, stat.st_size)


IMMUTABLE = "public, max-age=31536000, immutable"
REVALIDATE = "no-cache"


def cache_control(name: str, version: str | None) -> str:
    """The Cache-Control header for static file `name` asked for with ?v=`version`."""
    path = finders.find(name) if version else None
    if isinstance(path, str) and version == content_version(path):
        return IMMUTABLE
    return REVALIDATE


class VersionedStaticStorage(StaticFilesStorage):
    def url(self, name: str) -> str:
        url = super().url(name)
        path = finders.find(name)
        if not isinstance(path, str):  # not found (or several): the plain URL, as Django gives it
            return url
        return f"{url}?v={content_version(path)}"

"""Static URLs carry a hash of their file (playground/static_versions.py): a changed script gets a new URL."""

from __future__ import annotations

import hashlib
import os
import re
import urllib.error
import urllib.request

from django.templatetags.static import static

from playground.static_versions import IMMUTABLE, REVALIDATE, content_version
from tests.support import ROOT

SCRIPT = ROOT / "static" / "playground" / "playground.js"


def test_a_static_url_names_the_hash_of_the_file_it_serves():
    expected = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()[:12]
    assert static("playground/playground.js") == f"/static/playground/playground.js?v={expected}"
    assert static("no/such/file.js") == "/static/no/such/file.js"  # nothing to hash: Django's own URL


def test_an_edited_file_gets_a_new_version_and_an_unchanged_one_keeps_its_own(tmp_path):
    path = tmp_path / "app.js"
    path.write_text("console.log(1);\n")
    first = content_version(str(path))
    assert content_version(str(path)) == first
    path.write_text("console.log(22);\n")  # another size: a new key even within the clock's resolution
    os.utime(path, ns=(1, os.stat(path).st_mtime_ns + 1))
    assert content_version(str(path)) != first


def test_the_page_asks_for_versioned_files_that_daphne_serves(start_web):
    web = start_web()
    with urllib.request.urlopen(web.url + "/", timeout=10) as response:
        page = response.read().decode()
    urls = re.findall(r'(?:src|href)="(/static/[^"]+)"', page)
    assert any("playground/playground.js" in url for url in urls)
    for url in urls:
        name, _, version = url.removeprefix("/static/").partition("?v=")
        local = ROOT / "static" / name
        assert version == hashlib.sha256(local.read_bytes()).hexdigest()[:12], url
        with urllib.request.urlopen(web.url + url, timeout=10) as served:
            assert served.status == 200 and served.read() == local.read_bytes()
            # this URL's bytes never change: browsers keep them without asking again
            assert served.headers["Cache-Control"] == IMMUTABLE, url
            assert served.headers["X-Content-Type-Options"] == "nosniff"


def test_any_other_url_of_a_file_is_revalidated_and_files_carry_their_security_headers(start_web):
    web = start_web()
    old = "/static/playground/playground.js?v=000000000000"  # a page of last version's asks for this
    for url in ("/static/playground/playground.js", old):
        with urllib.request.urlopen(web.url + url, timeout=10) as served:
            assert served.read() == SCRIPT.read_bytes()
            assert served.headers["Cache-Control"] == REVALIDATE, url
            last_modified = served.headers["Last-Modified"]
    # revalidation: the unchanged file is a 304 with no body
    request = urllib.request.Request(web.url + old, headers={"If-Modified-Since": last_modified})
    try:
        urllib.request.urlopen(request, timeout=10)
        raise AssertionError("an unchanged file was sent again")
    except urllib.error.HTTPError as not_modified:
        assert not_modified.code == 304 and not_modified.headers["Cache-Control"] == REVALIDATE
    # a file opened as a document (the SVG icon in a tab) runs sandboxed, and nothing is sniffed into a script
    with urllib.request.urlopen(web.url + "/static/playground/favicon.svg", timeout=10) as served:
        policy = served.headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "sandbox" in policy.split("; ")
        assert served.headers["X-Content-Type-Options"] == "nosniff"
        assert served.headers["Cross-Origin-Resource-Policy"] == "same-origin"

"""Static URLs carry a hash of their file (playground/static_versions.py): a changed script gets a new URL."""

from __future__ import annotations

import hashlib
import os
import re
import urllib.request

from django.templatetags.static import static

from playground.static_versions import content_version
from tests.conftest import ROOT

SCRIPT = ROOT / "playground" / "static" / "playground" / "playground.js"


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
        local = ROOT / "playground" / "static" / name
        assert version == hashlib.sha256(local.read_bytes()).hexdigest()[:12], url
        with urllib.request.urlopen(web.url + url, timeout=10) as served:
            assert served.status == 200 and served.read() == local.read_bytes()

"""A local HTTP endpoint that answers as the Hugging Face Hub does for model repositories, for huggingface_hub
pointed at it through HF_ENDPOINT: nothing is fetched from the network in tests.

Repos are folders of files served at one fixed commit: GET /api/models/<repo>/revision/<rev> (the repo's info),
GET /api/models/<repo>/tree/<rev> (its files), HEAD and GET /<repo>/resolve/<rev>/<file> (a file, with Range).
A gated repo answers 403 GatedRepo without a bearer token, an unknown one 404 RepoNotFound, as the Hub does.
`slow_files` are sent in small pieces with a pause between them (a download the test can watch), and
`cut_once` files stop half-way the first time they are asked for (a download to resume)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>[^/?]+)")
TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/?]+)")
RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>[^?]+)")


class HubServer:
    def __init__(self, repos: dict[str, Path], gated: frozenset[str] = frozenset(), slow_files: float = 0.0):
        self.repos, self.gated, self.slow_s = repos, gated, slow_files
        self.cut_once: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                server.answer(self, head=True)

            def do_GET(self):
                server.answer(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def answer(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        path = handler.path.split("?")[0]
        self.requests.append((handler.command, path, handler.headers.get("Range")))
        for pattern in (INFO, TREE, RESOLVE):
            found = pattern.fullmatch(path)
            if found:
                break
        else:
            return self.error(handler, 404, "EntryNotFound")
        repo = found["repo"]
        if repo not in self.repos:
            return self.error(handler, 404, "RepoNotFound")
        if repo in self.gated and not handler.headers.get("Authorization", "").startswith("Bearer "):
            return self.error(handler, 403, "GatedRepo")
        if found["rev"] not in ("main", COMMIT):
            return self.error(handler, 404, "RevisionNotFound")
        files = self.files(repo)
        if pattern is INFO:
            siblings = [{"rfilename": name} for name in files]
            return self.json(handler, {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings})
        if pattern is TREE:
            entries = [
                {"type": "file", "path": name, "size": p.stat().st_size, "oid": _oid(p)}
                for name, p in files.items()
            ]
            return self.json(handler, entries)
        name = found["file"]
        if name not in files:
            return self.error(handler, 404, "EntryNotFound")
        self.send_file(handler, name, files[name], head)

    def send_file(self, handler, name: str, path: Path, head: bool) -> None:
        data = path.read_bytes()
        start = 0
        ranged = handler.headers.get("Range")
        if ranged and (m := re.fullmatch(r"bytes=(\d+)-", ranged)):
            start = int(m[1])
        body = data[start:]
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("ETag", f'"{_oid(path)}"')
        handler.send_header("Content-Length", str(len(body)))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if head:
            return
        cut = name in self.cut_once and not start
        if cut:
            self.cut_once.discard(name)
            body = body[: len(body) // 2]
        piece = 64 * 1024
        for i in range(0, len(body), piece):
            handler.wfile.write(body[i : i + piece])
            if self.slow_s and name.endswith(".safetensors"):
                time.sleep(self.slow_s)
        if cut:
            handler.close_connection = True

    def json(self, handler, payload) -> None:
        raw = json.dumps(payload).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(raw)))
        handler.end_headers()
        handler.wfile.write(raw)

    def error(self, handler, status: int, code: str) -> None:
        raw = json.dumps({"error": code}).encode()
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(raw)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(raw)


def _oid(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()

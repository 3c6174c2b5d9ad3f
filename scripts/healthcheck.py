"""Container healthchecks (docker-compose.yml): `python scripts/healthcheck.py web|worker`; exit 0 when healthy.

web:    GET /healthz answers 200 (daphne serves; /readyz checks the rest), asked with a Host header that
        DJANGO_ALLOWED_HOSTS accepts.
worker: the file in KOG_HEALTH_FILE, which the worker touches at each heartbeat, is fresh.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request

STALE_AFTER_S = 10


def web(port: str = os.environ.get("PORT", "8000")) -> bool:
    hosts = [h.strip() for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost").split(",") if h.strip()]
    host = next((h.lstrip(".") for h in hosts if h != "*"), "localhost")
    request = urllib.request.Request(f"http://127.0.0.1:{port}/healthz", headers={"Host": host})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def worker(path: str = os.environ.get("KOG_HEALTH_FILE", "/tmp/kog-worker-alive")) -> bool:
    try:
        return time.time() - os.path.getmtime(path) < STALE_AFTER_S
    except OSError:
        return False


if __name__ == "__main__":
    checks = {"web": web, "worker": worker}
    if len(sys.argv) != 2 or sys.argv[1] not in checks:
        sys.exit("usage: python scripts/healthcheck.py web|worker")
    sys.exit(0 if checks[sys.argv[1]]() else 1)

"""The web process never imports torch: its image installs none (Dockerfile's web stage), and a page or an API
call must not wait on loading it. A fresh interpreter imports what daphne and `make run` load, as they do."""

import json
import os
import subprocess
import sys

from tests.support import ROOT

# What daphne serves (the ASGI app, with Django set up), the URL map with its API views, and the launcher
# behind `make run`; then the page's and the API's request code, which the URL map loads on first request.
WEB_IMPORTS = """
import json, os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "playground.settings")
import django
django.setup()
import playground.asgi, playground.urls, playground.api.views, playground.run
import playground.api.params, playground.consumers, playground.views
print(json.dumps(sorted(sys.modules)))
"""


def test_the_web_side_imports_no_torch(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "MODELS"))}
    env |= {
        "DJANGO_SETTINGS_MODULE": "playground.settings",
        "DJANGO_SECRET_KEY": "a-key-for-this-test",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
    }
    done = subprocess.run(
        [sys.executable, "-c", WEB_IMPORTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    modules = set(json.loads(done.stdout.splitlines()[-1]))
    assert "playground.api.views" in modules and "common.protocol" in modules  # it did import the web side
    loaded_from_inference = sorted(m for m in modules if m.split(".")[0] == "inference")
    for heavy in ("torch", "triton"):
        assert heavy not in modules, (
            f"{heavy} was imported; inference modules loaded: {loaded_from_inference}"
        )

"""The web settings read before a web command does anything: a value the settings cannot use ends the command
with one line naming the variable (exit status 2), not the traceback of the settings module's import."""

from __future__ import annotations

import sys


def settings_or_exit() -> None:
    import django
    from django.core.exceptions import ImproperlyConfigured

    try:
        django.setup()  # imports playground/settings.py, then the apps' ready() (the rate limits' variables)
    except (ImproperlyConfigured, ValueError) as exc:  # ValueError: common/logs.py's LOG_FORMAT
        print(exc, file=sys.stderr)
        sys.exit(2)

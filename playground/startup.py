"""The web settings read before a web command does anything: a value the settings cannot use ends the command
with one line naming the variable (exit status 2), not the traceback of the settings module's import."""

from __future__ import annotations

import sys


def settings_or_exit() -> None:
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    try:
        settings.INSTALLED_APPS  # noqa: B018 - the first access imports playground/settings.py
    except (ImproperlyConfigured, ValueError) as exc:  # ValueError: common/logs.py's LOG_FORMAT
        print(exc, file=sys.stderr)
        sys.exit(2)

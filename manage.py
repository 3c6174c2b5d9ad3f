#!/usr/bin/env python
"""Django's command-line utility for the playground."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "playground.settings")
    from django.core.management import execute_from_command_line

    from playground.startup import settings_or_exit

    settings_or_exit()

    execute_from_command_line(sys.argv)

"""Numbers from the environment, checked once at a process's start: the one parser the worker, the engine,
the fast runner and the web process share, so that every bad value fails the same way, naming its variable.
"""

from __future__ import annotations

import math
import os


class EnvError(ValueError):
    """A setting in the environment that cannot be used; the message names the variable and what it takes."""


def env_number(
    name: str,
    default: float,
    expects: str,
    integer: bool = False,
    minimum: float = 0,
    above: bool = False,
    maximum: float = math.inf,
) -> float:
    """The number in environment variable `name` (unset or blank: `default`); EnvError names the variable,
    what it takes (`expects`) and what it holds when that is no finite number in [`minimum`, `maximum`]
    (`above`: greater than `minimum`). The one parser of numbers from the environment: the worker's, the
    engine's, the fast runner's and the web's settings (playground/settings.py wraps it for Django)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if (
        value is None
        or not math.isfinite(value)
        or not minimum <= value <= maximum
        or (above and value == minimum)
    ):
        raise EnvError(f"{name}: must be {expects}, got {raw!r}")
    return value

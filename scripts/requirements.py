"""The requirements of one or more install roles, read from pyproject.toml, one a line:

    python scripts/requirements.py web            # the base dependencies and the `web` extra
    python scripts/requirements.py worker gpu

The Dockerfile installs them before it copies the code, so that a code change rebuilds no dependency layer;
the list itself lives in pyproject.toml only.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(roles: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    unknown = [role for role in roles if role not in extras]
    if unknown:
        raise SystemExit(f"unknown role {', '.join(unknown)}; pyproject.toml has {', '.join(extras)}")
    return project["dependencies"] + [line for role in roles for line in extras[role]]


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))

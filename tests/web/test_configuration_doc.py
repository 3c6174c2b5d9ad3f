"""docs/configuration.md lists every environment variable the product reads, in its tables' first column."""

import re

from tests.support import ROOT

DOC = ROOT / "docs" / "configuration.md"
# The product's own variables, wherever their name is spelt in its code, and any other variable it reads
PRODUCT_NAME = re.compile(r'"((?:KOG|PLAYGROUND|DJANGO)_[A-Z0-9_]+)"')
ENVIRON_READ = re.compile(r'(?:environ\.get|environ\.setdefault|environ\[|getenv)\(?\s*"([A-Z][A-Z0-9_]+)"')
COMPOSE_VARIABLE = re.compile(r"\$\{([A-Z][A-Z0-9_]*)")
SOURCES = ("common", "playground", "inference", "kernels", "scripts/healthcheck.py", "manage.py")
NOT_VARIABLES = {"PLAYGROUND_LIMITS"}  # a Django setting that tests and deployments set in code


def variables_read() -> set[str]:
    names: set[str] = set()
    for source in SOURCES:
        path = ROOT / source
        for file in [path] if path.is_file() else path.rglob("*.py"):
            text = file.read_text()
            names |= set(PRODUCT_NAME.findall(text)) | set(ENVIRON_READ.findall(text))
    names |= set(COMPOSE_VARIABLE.findall((ROOT / "docker-compose.yml").read_text()))
    return names - NOT_VARIABLES


def documented() -> set[str]:
    rows = re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", DOC.read_text(), flags=re.MULTILINE)
    return set(rows)


def test_every_variable_the_product_reads_has_a_row():
    found = variables_read()
    assert {
        "REDIS_URL",
        "MODELS",
        "KOG_MAX_CONTEXT",
        "PLAYGROUND_MAX_QUEUE",
        "REDIS_PASSWORD",
        "KOG_PDL",
    } <= found
    missing = sorted(found - documented())
    assert not missing, f"docs/configuration.md has no row for {missing}"

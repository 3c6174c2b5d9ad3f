"""Settings, all from the environment: safe for production by default, `DJANGO_DEBUG=1` for development.

DJANGO_SECRET_KEY       required to serve when DEBUG is off (`make run` makes one, kept in var/secret_key)
DJANGO_DEBUG            1/true to enable debug pages (default off)
DJANGO_ALLOWED_HOSTS    comma-separated host names (default 127.0.0.1,localhost)
DJANGO_CSRF_TRUSTED_ORIGINS  comma-separated origins, e.g. https://play.example.com, trusted beyond the request's own
                             host and port (the admin's forms and the websocket: a proxy that rewrites Host)
DJANGO_BEHIND_HTTPS_PROXY    1 when a TLS-terminating proxy sets X-Forwarded-Proto: secure cookies, HSTS,
                             and plain-HTTP requests redirected to HTTPS
DJANGO_HSTS_SECONDS     Strict-Transport-Security max-age behind TLS (default 31536000; 0: no header)
DATABASE_URL            sqlite:///path or postgres://user:pass@host/db (default var/db.sqlite3)
REDIS_URL               the job queue: redis://host:port/db, redis://:password@host:port/db
                        with a password (default redis://127.0.0.1:6379/0)
MODELS                  the models to offer, as the workers' MODELS (comma-separated; empty: the shipped default)
PLAYGROUND_MAX_QUEUE    jobs that may wait per model before new ones are refused (default 32; 0: no bound)
PLAYGROUND_MAX_NEW_TOKENS   the largest max_tokens the page may ask for (default 8192; larger is clamped)
PLAYGROUND_MAX_PROMPT_CHARS the longest prompt, in characters (default 100000)
PLAYGROUND_MAX_FRAME_BYTES  the largest websocket frame the page may send (default: room for the longest
                        prompt at 4 UTF-8 bytes a character, plus 64 KiB for the rest of the frame)
PLAYGROUND_MAX_JOBS_PER_VISITOR  generations one visitor (address or API key) may have queued or running at
                        once (default 2; 0: no cap); the queue serves visitors in turn
PLAYGROUND_MAX_SOCKETS_PER_IP    page websockets one address may hold open at once (default 8; 0: no cap)
PLAYGROUND_ADMIN_PATH, PLAYGROUND_ADMIN_LOGINS_PER_MIN: see playground/admin_throttle.py
PLAYGROUND_REDIS_CONNECTIONS  pooled Redis connections per web process (default 500; each socket
                        following a job holds one while it waits for events)
PLAYGROUND_RETENTION_DAYS   saved generations older than this many days are deleted (default 30; 0 keeps them
                        all): a web process prunes at most once an hour, after saving one
Rate limits (PLAYGROUND_IP_*, PLAYGROUND_KEY_*, PLAYGROUND_TRUSTED_PROXIES): see playground/limits.py.
A value that is not what its variable takes stops the process at its start (settings, or the app's ready() for
the rate limits) with one line naming the variable, rather than failing requests once it serves.
LOG_FORMAT, LOG_LEVEL   json (default) or plain log lines; see common/logs.py
PLAYGROUND_READY_TIMEOUT_S, PLAYGROUND_READY_CACHE_S, PLAYGROUND_METRICS_TOKEN: see health.py, metrics.py
PLAYGROUND_API_CORS_ORIGINS: see playground/api/cors.py
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from redis.connection import parse_url

from common.env import EnvError
from common.env import env_number as config_env_number
from common.logs import logging_config
from common.names import ModelNameError, configured_models, served_names
from common.redis_server import redacted_url, url_problem

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool = False) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def env_number(
    name: str, default, kind: type = int, low: float = 0, above: bool = False, unit: str = "", note: str = ""
):
    """The variable `name` as an int (or a float: kind=float), `default` when unset or empty. A value that is no
    such number, or below `low` (at `low` too with `above`), stops the process here, at its start, with one
    line naming the variable and what it takes, instead of a bare int() error or a failure at the first request."""
    what = ("a whole number" if kind is int else "a number") + (f" of {unit}" if unit else "")
    bound = f"greater than {low:g}" if above else f"{low:g} or more"
    expects = f"{what}, {bound}{f' ({note})' if note else ''}"
    try:
        value = config_env_number(name, default, expects, integer=kind is int, minimum=low, above=above)
    except EnvError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    return value if value is default else kind(value)


def admin_path(value: str) -> str:
    """PLAYGROUND_ADMIN_PATH as a URL pattern's prefix: `backstage`, `/backstage/` -> `backstage/`."""
    path = value.strip().strip("/")
    if not path or any(part in ("", ".", "..") for part in path.split("/")) or "?" in path or "#" in path:
        raise ImproperlyConfigured(f"PLAYGROUND_ADMIN_PATH: must be a path such as backstage/, got {value!r}")
    return path + "/"


def redis_url() -> str:
    """REDIS_URL (default redis://127.0.0.1:6379/0), checked as redis-py reads it for the job queue:
    `127.0.0.1:6379` without its scheme would otherwise pass here and fail every request."""
    url = os.environ.get("REDIS_URL", "").strip() or "redis://127.0.0.1:6379/0"
    try:
        parse_url(url)
    except ValueError as exc:
        # never a password in the log: not in the URL shown, nor in redis-py's reason
        raise ImproperlyConfigured(
            "REDIS_URL must look like redis://host:port/db (redis://:password@host:port/db with a password, "
            f"rediss:// for TLS, unix:///path/to/redis.sock), got {redacted_url(url)!r}: {url_problem(url, exc)}"
        ) from None
    return url


DEBUG = env_bool("DJANGO_DEBUG")
# Serving (playground/asgi.py) refuses to start without DJANGO_SECRET_KEY when DEBUG is off; a
# management command (migrate, apikey) needs no stable key and gets a throwaway one.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "") or (
    "dev-only-insecure-key" if DEBUG else secrets.token_urlsafe(50)
)

ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS")
if env_bool("DJANGO_BEHIND_HTTPS_PROXY"):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]  # probes come over plain HTTP
    SECURE_HSTS_SECONDS = env_number("DJANGO_HSTS_SECONDS", 31536000, unit="seconds")
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS")
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = CSRF_COOKIE_SAMESITE = "Lax"

INSTALLED_APPS = [
    "daphne",  # first: its runserver serves the websocket routes too
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "playground",
    "playground.api",
]

MIDDLEWARE = [
    "playground.admin_throttle.AdminLoginThrottle",  # wrong admin passwords a minute per address (Redis)
    "playground.host_check.ApiHostCheckMiddleware",  # JSON, not HTML, for an API call to a foreign Host
    "playground.api.cors.ApiCorsMiddleware",  # /v1/ from the web apps PLAYGROUND_API_CORS_ORIGINS names
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "playground.security.SecurityHeadersMiddleware",  # Content-Security-Policy, Permissions-Policy
]

ROOT_URLCONF = "playground.urls"
ASGI_APPLICATION = "playground.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # the site's pages live at the top of the checkout, beside the code; APP_DIRS finds the admin's own
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DEFAULT_SQLITE = BASE_DIR / "var" / "db.sqlite3"
if "DATABASE_URL" not in os.environ:
    DEFAULT_SQLITE.parent.mkdir(exist_ok=True)
# conn_max_age=0: Django's async views and consumers run ORM calls in a thread pool, where
# persistent connections would outlive their requests.
DATABASES = {"default": dj_database_url.config(default=f"sqlite:///{DEFAULT_SQLITE}", conn_max_age=0)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# No CHANNEL_LAYERS: jobs travel through their own Redis streams (common/protocol.py), not a channel layer.
REDIS_URL = redis_url()

# The names the workers serve MODELS under (the shipped default when MODELS is empty, as for the worker):
# the models the page and the API offer, and /readyz checks, even while no worker is up.
try:  # refused here as a worker refuses them: an empty name or path, two entries of one name
    PLAYGROUND_MODELS = list(served_names(configured_models()))
except ModelNameError as exc:
    raise ImproperlyConfigured(f"MODELS: {exc}") from None
PLAYGROUND_MAX_QUEUE = env_number("PLAYGROUND_MAX_QUEUE", 32, unit="jobs", note="0: no bound")
PLAYGROUND_MAX_NEW_TOKENS = env_number("PLAYGROUND_MAX_NEW_TOKENS", 8192, low=1, unit="tokens")
PLAYGROUND_MAX_PROMPT_CHARS = env_number("PLAYGROUND_MAX_PROMPT_CHARS", 100000, low=1, unit="characters")
PLAYGROUND_MAX_FRAME_BYTES = env_number(
    "PLAYGROUND_MAX_FRAME_BYTES", 4 * PLAYGROUND_MAX_PROMPT_CHARS + 64 * 1024, low=1, unit="bytes"
)
PLAYGROUND_API_CORS_ORIGINS = env_list("PLAYGROUND_API_CORS_ORIGINS")  # see playground/api/cors.py
# A fair share per visitor (an address, or an API key): its jobs queued or running at once, and a page's
# sockets open at once per address (playground/consumers.py).
PLAYGROUND_MAX_JOBS_PER_VISITOR = env_number(
    "PLAYGROUND_MAX_JOBS_PER_VISITOR", 2, unit="jobs", note="0: no cap"
)
PLAYGROUND_MAX_SOCKETS_PER_IP = env_number(
    "PLAYGROUND_MAX_SOCKETS_PER_IP", 8, unit="sockets", note="0: no cap"
)
# The admin: where it lives, and how many wrong passwords an address may try a minute (playground/admin_throttle.py)
PLAYGROUND_ADMIN_PATH = admin_path(os.environ.get("PLAYGROUND_ADMIN_PATH", "admin/"))
PLAYGROUND_ADMIN_LOGINS_PER_MIN = env_number(
    "PLAYGROUND_ADMIN_LOGINS_PER_MIN", 5, unit="attempts", note="0: no throttle"
)
PLAYGROUND_REDIS_CONNECTIONS = env_number("PLAYGROUND_REDIS_CONNECTIONS", 500, low=1, unit="connections")


DEFAULT_RETENTION_DAYS = 30


def retention_days() -> int | None:
    """A whole number of days, 1 or more (DEFAULT_RETENTION_DAYS when unset), or None (0: keep every one)."""
    days = env_number(
        "PLAYGROUND_RETENTION_DAYS", DEFAULT_RETENTION_DAYS, unit="days", note="0 keeps them all"
    )
    return days or None


# Saved generations older than this many days are pruned (playground/store.py); None keeps them all: a public
# demo's database stays bounded by default.
PLAYGROUND_RETENTION_DAYS = retention_days()
# A playground.limits.LimitConfig, or None to read the PLAYGROUND_IP_* / _KEY_* variables.
PLAYGROUND_LIMITS = None
# Read by playground/health.py (/readyz) itself; checked here, so that a bad value stops the process at its
# start instead of failing every request once the URLs are first loaded.
PLAYGROUND_READY_TIMEOUT_S = env_number("PLAYGROUND_READY_TIMEOUT_S", 10.0, float, above=True, unit="seconds")
PLAYGROUND_READY_CACHE_S = env_number("PLAYGROUND_READY_CACHE_S", 5.0, float, unit="seconds")
# How long a socket following a job waits for a lost Redis to come back before giving up.
PLAYGROUND_REDIS_RETRY_S = env_number("PLAYGROUND_REDIS_RETRY_S", 15.0, float, unit="seconds")
PLAYGROUND_STATUS_INTERVAL_S = env_number(
    "PLAYGROUND_STATUS_INTERVAL_S", 1.0, float, above=True, unit="seconds"
)
# A page's job that no socket follows (the tab closed, or its web process died) is cancelled by its worker
# after this long unless a client resumes it (API jobs get no grace: see common/protocol.py, followers).
PLAYGROUND_ORPHAN_GRACE_S = env_number("PLAYGROUND_ORPHAN_GRACE_S", 15.0, float, unit="seconds")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# Served by Django's ASGIStaticFilesHandler (see asgi.py) straight from static/ (and the admin's app folder):
# daphne serves them with DEBUG off and no collectstatic step. STATIC_ROOT is for a CDN or proxy.
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "staticfiles"
# URLs with a hash of each file's content, so that a page never runs a cached older script
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "playground.static_versions.VersionedStaticStorage"},
}

SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"

LOGGING = logging_config()  # JSON lines carrying the job id (LOG_FORMAT=plain for a terminal)

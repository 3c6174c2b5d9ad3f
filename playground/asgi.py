"""The ASGI entry point that daphne serves: pages and static files over HTTP, generations over websockets.

python -m playground.serve -b 0.0.0.0 -p 8000   (daphne, its websocket limit set from the settings)
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "playground.settings")
# Django first: the imports below need the app registry ready.
django_asgi_app = get_asgi_application()

from django.conf import settings  # noqa: E402
from django.core.exceptions import ImproperlyConfigured  # noqa: E402

if not settings.DEBUG and not os.environ.get("DJANGO_SECRET_KEY"):
    # Sessions and CSRF tokens signed with a throwaway key would break at each restart, and a
    # guessable one would let anyone forge them: production names its own.
    raise ImproperlyConfigured("DJANGO_SECRET_KEY must be set to serve with DJANGO_DEBUG off")

from asgiref.sync import sync_to_async  # noqa: E402
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.exceptions import SuspiciousOperation  # noqa: E402
from django.core.handlers.exception import response_for_exception  # noqa: E402
from django.middleware.security import SecurityMiddleware  # noqa: E402

from playground import body_limit  # noqa: E402
from playground.routing import websocket_urlpatterns  # noqa: E402
from playground.security import STATIC_FILE_HEADERS  # noqa: E402
from playground.static_versions import cache_control  # noqa: E402
from playground.store import prune_soon  # noqa: E402
from playground.ws_origin import SameOriginValidator  # noqa: E402

# daphne imports this module before it listens: from then on it refuses oversized bodies as they arrive
body_limit.install()


class StaticFilesHandler(ASGIStaticFilesHandler):
    """Django's handler answers a missing file with a 404 but lets a path that climbs out of the static
    folders (/static/%2e%2e/...) raise: a 500 with a traceback in the log for every such probe. Django's
    views answer that exception with a 400 and a line in the django.security log; so does this.

    Its files also pass by the middleware that gives pages their security headers: they get theirs here,
    with a Cache-Control that lets a versioned URL be cached for good (static_versions.py)."""

    async def get_response_async(self, request):
        try:
            response = await super().get_response_async(request)
        except SuspiciousOperation as exc:
            return await sync_to_async(response_for_exception, thread_sensitive=False)(request, exc)
        # the pages' nosniff and referrer policy, from the same settings (SECURE_*)
        response = SecurityMiddleware(self.get_response_async).process_response(request, response)
        for header, value in STATIC_FILE_HEADERS.items():
            response.headers.setdefault(header, value)
        if response.status_code in (200, 304):
            name = self.file_path(request.path)
            response.headers["Cache-Control"] = cache_control(name, request.GET.get("v"))
        return response


class PruningWhileServing:
    """Every HTTP request lets the process prune old generations (store.prune_soon: at most hourly, in the
    background): the retention holds by itself whether runs are saved or not, a probe's /healthz enough."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        prune_soon()
        return await self.app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        # /static/ straight from static/ (and the admin's app folder), DEBUG off too: no collectstatic step
        "http": PruningWhileServing(StaticFilesHandler(django_asgi_app)),
        # only pages of the playground's own origin (host and port) or a trusted one open a socket
        "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)

"""The ASGI entry point that daphne serves: pages and static files over HTTP, generations over websockets.

daphne -b 0.0.0.0 -p 8000 playground.asgi:application
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

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from playground.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # /static/ straight from the app folders, with DEBUG off too: no collectstatic, no extra server
        "http": ASGIStaticFilesHandler(django_asgi_app),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)

from django.conf import settings
from django.contrib import admin
from django.urls import include, path

from playground import health, metrics, views
from playground.api import views as api_views

urlpatterns = [
    path("", views.index, name="index"),
    path("g/<slug:generation_id>", views.generation, name="generation"),
    path("g/<slug:generation_id>/", views.generation_with_slash),
    path("healthz", health.healthz, name="healthz"),  # alive: no dependency looked at
    path("readyz", health.readyz, name="readyz"),  # Redis, a worker per model, a one-token generation
    path(
        "health", health.health, name="health"
    ),  # llama.cpp's and vLLM's probe: Redis and a worker per model
    # llama.cpp's and vLLM's paths for these (also under /v1/)
    path("tokenize", api_views.tokenize),
    path("detokenize", api_views.detokenize),
    path("infill", api_views.infill),
    path("metrics", metrics.metrics_view, name="metrics"),
    path(settings.PLAYGROUND_ADMIN_PATH, admin.site.urls),  # admin/ unless configured elsewhere
    path("v1/", include("playground.api.urls")),
]

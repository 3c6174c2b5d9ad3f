from django.contrib import admin
from django.urls import include, path

from playground import views

urlpatterns = [
    path("", views.index, name="index"),
    path("g/<slug:generation_id>", views.generation, name="generation"),
    path("healthz", views.healthz, name="healthz"),
    path("admin/", admin.site.urls),
    path("v1/", include("playground.api.urls")),
]

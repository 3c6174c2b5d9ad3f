from django.urls import path, re_path

from playground.api import views

urlpatterns = [
    path("models", views.models, name="api-models"),
    path("models/<path:model>", views.model_detail, name="api-model"),
    path("completions", views.completions, name="api-completions"),
    path("chat/completions", views.chat_completions, name="api-chat-completions"),
    re_path(r"^(?P<path>.*)$", views.not_found),
]

from django.urls import path, re_path

from playground.api import views

urlpatterns = [
    path("models", views.models, name="api-models"),
    path("models/<path:model>", views.model_detail, name="api-model"),
    path("completions", views.completions, name="api-completions"),
    path("chat/completions", views.chat_completions, name="api-chat-completions"),
    # vLLM's and llama.cpp's extras, also at the site's root (playground/urls.py), where those servers have them
    path("tokenize", views.tokenize, name="api-tokenize"),
    path("detokenize", views.detokenize, name="api-detokenize"),
    path("infill", views.infill, name="api-infill"),
    re_path(r"^(?P<path>.*)$", views.not_found),
]

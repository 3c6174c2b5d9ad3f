from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "playground.api"
    label = "api"
    verbose_name = "OpenAI-compatible API"
    default_auto_field = "django.db.models.BigAutoField"

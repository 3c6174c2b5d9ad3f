from django.apps import AppConfig


class PlaygroundConfig(AppConfig):
    name = "playground"
    verbose_name = "Playground"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The rate limits' variables are read here, once, rather than at the first generation: a bad one
        # stops daphne (and manage.py) at its start with one line naming it (the other variables: settings.py).
        from playground.limits import check_environment

        check_environment()

"""python manage.py apikey create NAME | list | revoke NAME | delete NAME [--open-api]"""

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from playground.api.models import ApiKey


class Command(BaseCommand):
    help = "Manage the API keys of /v1/ (once any key exists, every API call needs one)."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True)
        create = actions.add_parser("create", help="make a key and print it (the only time it is shown)")
        create.add_argument("name")
        actions.add_parser("list", help="list keys: name, prefix, created, last used, revoked")
        revoke = actions.add_parser("revoke", help="revoke a key by name or prefix")
        revoke.add_argument("name")
        delete = actions.add_parser(
            "delete", help="delete a key by name or prefix (revoke keeps the API closed; prefer it)"
        )
        delete.add_argument("name")
        delete.add_argument(
            "--open-api", action="store_true",
            help="allow deleting the last key, which opens the API to anyone who can reach it",
        )  # fmt: skip

    def handle(self, *args, action, **options):
        getattr(self, action)(**options)

    def create(self, name, **_):
        if ApiKey.objects.filter(name=name).exists():
            raise CommandError(f"a key named {name!r} exists already")
        api_key = ApiKey(name=name)
        key = api_key.set_new_key()
        api_key.save()
        self.stdout.write(key)
        self.stderr.write(f"Key {name!r} created. Copy it now: only its hash is stored.")

    def list(self, **_):
        keys = ApiKey.objects.all()
        if not keys:
            self.stdout.write("no API keys: the API is open to anyone who can reach it")
        for k in keys:
            state = f"revoked {k.revoked:%Y-%m-%d %H:%M}" if k.revoked else "active"
            used = f"{k.last_used:%Y-%m-%d %H:%M}" if k.last_used else "never"
            self.stdout.write(
                f"{k.name}\t{k.prefix}…\tcreated {k.created:%Y-%m-%d %H:%M}\tused {used}\t{state}"
            )

    def find(self, name) -> ApiKey:
        api_key = ApiKey.objects.filter(name=name).first() or ApiKey.objects.filter(prefix=name).first()
        if api_key is None:
            raise CommandError(f"no key named {name!r} (see `manage.py apikey list`)")
        return api_key

    def revoke(self, name, **_):
        api_key = self.find(name)
        if api_key.revoked:
            raise CommandError(f"key {name!r} was revoked already")
        api_key.revoked = timezone.now()
        api_key.save(update_fields=["revoked"])
        self.stdout.write(f"revoked {api_key}")

    def delete(self, name, open_api=False, **_):
        api_key = self.find(name)
        # no key row at all, revoked ones included, is what leaves the API open
        last = not ApiKey.objects.exclude(pk=api_key.pk).exists()
        if last and not open_api:
            raise CommandError(
                f"{api_key} is the last key: deleting it opens the API to anyone who can reach it. "
                "Revoke it instead (`manage.py apikey revoke`), or pass --open-api to delete it and open the API."
            )
        api_key.delete()
        self.stdout.write(f"deleted {api_key}")
        if last:
            self.stderr.write("No API key is left: the API is now open to anyone who can reach it.")

"""python manage.py apikey create NAME | list | revoke NAME"""

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

    def revoke(self, name, **_):
        api_key = ApiKey.objects.filter(name=name).first() or ApiKey.objects.filter(prefix=name).first()
        if api_key is None:
            raise CommandError(f"no key named {name!r} (see `manage.py apikey list`)")
        if api_key.revoked:
            raise CommandError(f"key {name!r} was revoked already")
        api_key.revoked = timezone.now()
        api_key.save(update_fields=["revoked"])
        self.stdout.write(f"revoked {api_key}")

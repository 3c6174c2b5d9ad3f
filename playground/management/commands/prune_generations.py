"""python manage.py prune_generations --older-than-days N [--all] [--dry-run]"""

from django.core.management.base import BaseCommand, CommandError

from playground.store import prune_generations


class Command(BaseCommand):
    help = (
        "Delete saved generations older than N days; their share links then answer 404. "
        "PLAYGROUND_RETENTION_DAYS makes the web process do it by itself, hourly."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--older-than-days", type=int, required=True, metavar="N",
            help="delete the generations saved more than N days ago (0, with --all: every one saved until now)",
        )  # fmt: skip
        parser.add_argument("--all", action="store_true", help="let N be 0: delete every saved generation")
        parser.add_argument("--dry-run", action="store_true", help="count them, delete nothing")

    def handle(self, *args, older_than_days, dry_run, all, **options):
        if older_than_days < 0:
            raise CommandError(f"--older-than-days must be 0 or more, got {older_than_days}")
        if older_than_days == 0 and not (
            all or dry_run
        ):  # PLAYGROUND_RETENTION_DAYS=0 keeps them all: not a slip here
            raise CommandError("--older-than-days 0 deletes every saved generation; add --all to mean it")
        count = prune_generations(older_than_days, dry_run=dry_run)
        if dry_run:
            self.stdout.write(f"{count} generation(s) older than {older_than_days} days would be deleted")
        else:
            self.stdout.write(f"deleted {count} generation(s) older than {older_than_days} days")

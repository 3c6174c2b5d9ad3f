from django.contrib import admin, messages
from django.utils import timezone

from playground.api.models import ApiKey


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are made here and revoked with the action; never deleted (with no key row left the API is open)
    nor un-revoked by hand (`revoked` is the action's to set). `manage.py apikey delete` deletes one."""

    list_display = ("name", "prefix", "created", "last_used", "revoked")
    list_filter = ("revoked",)
    search_fields = ("name", "prefix")
    actions = ["revoke"]

    def get_fields(self, request, obj=None):
        return ("name",) if obj is None else ("name", "prefix", "created", "last_used", "revoked")

    def get_readonly_fields(self, request, obj=None):
        return () if obj is None else ("prefix", "created", "last_used", "revoked")

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # deleting the last key would open the API to anyone: revoke instead

    def save_model(self, request, obj, form, change):
        if not change:
            key = obj.set_new_key()
            messages.warning(
                request, f"The new key for {obj.name!r} is {key} — copy it now, it is not shown again."
            )
        super().save_model(request, obj, form, change)

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset):
        count = queryset.filter(revoked__isnull=True).update(revoked=timezone.now())
        self.message_user(request, f"{count} key(s) revoked.")

from django.contrib import admin

from playground.models import Generation


@admin.register(Generation)
class GenerationAdmin(admin.ModelAdmin):
    list_display = ["id", "created", "model", "source", "finish_reason", "completion_tokens", "decode_tok_s"]
    list_filter = ["source", "finish_reason", "model"]
    search_fields = ["id", "job_id", "prompt", "output"]
    date_hierarchy = "created"
    readonly_fields = [field.name for field in Generation._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False  # rows come from finished generations only

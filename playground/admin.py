"""The saved generations, for looking at and taking down: read-only (view and delete), never edited.

The texts are a stranger's: shown escaped, in monospace <pre> boxes of capped height, and with Unicode's
text-direction controls shown as their code points instead of obeyed (as the share page shows them), so
that a line reads in the order it runs.
"""

from __future__ import annotations

import json
import re

from django.contrib import admin
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator

from playground.models import Generation
from playground.views import BIDI_CONTROLS

SPLIT_BIDI = re.compile(f"({BIDI_CONTROLS.pattern})")  # the controls kept, at the odd indexes
CONTROL = (
    '<span class="bidi-control" title="A text-direction control ({0}), shown instead of obeyed">{0}</span>'
)


def shown(text: str) -> SafeString:
    """Text as HTML: escaped, each direction control replaced by its code point (U+202E), marked."""
    return mark_safe(
        "".join(
            format_html(CONTROL, f"U+{ord(part):04X}") if i % 2 else escape(part)
            for i, part in enumerate(SPLIT_BIDI.split(text))
        )
    )


def text_box(text: str) -> SafeString:
    # a newline after <pre>: the HTML parser drops the first one there, so a text's own first newline stays
    return (
        format_html('<pre class="kog-text" dir="ltr" tabindex="0">\n{}</pre>', shown(text)) if text else "–"
    )


def json_box(value) -> SafeString:
    return text_box(json.dumps(value, indent=2, ensure_ascii=False)) if value else "–"


@admin.register(Generation)
class GenerationAdmin(admin.ModelAdmin):
    list_display = ["id", "created", "model", "prompt_excerpt", "source", "finish_reason",
                    "completion_tokens", "decode_rate"]  # fmt: skip
    list_filter = ["source", "finish_reason", "model"]
    search_fields = ["id", "job_id", "prompt", "output"]
    date_hierarchy = "created"
    fieldsets = [
        (None, {"fields": ["id", "job_id", "created", "model", "source", "finish_reason"]}),
        ("Texts", {"fields": ["system_prompt_text", "prompt_text", "output_text", "messages_text"]}),
        ("Settings", {"fields": ["params_text"]}),
        ("Speed", {"fields": ["prompt_tokens", "completion_tokens", "prefill_ms", "ttft_ms", "decode_rate",
                              "total_ms", "bandwidth_gbs", "peak_pct"]}),
    ]  # fmt: skip
    readonly_fields = [name for _, options in fieldsets for name in options["fields"]]

    class Media:
        css = {"all": ["playground/admin.css"]}

    def has_add_permission(self, request) -> bool:
        return False  # rows come from finished generations only

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # a record of what ran: looked at, or deleted (a takedown), never edited

    @admin.display(description="prompt")
    def prompt_excerpt(self, obj: Generation) -> SafeString:
        first = next((line for line in obj.prompt.splitlines() if line.strip()), "")
        return shown(Truncator(first.strip()).chars(60))

    @admin.display(description="decode", ordering="decode_tok_s")
    def decode_rate(self, obj: Generation) -> str:
        return f"{obj.decode_tok_s:,.1f} tok/s" if obj.decode_tok_s else "–"

    @admin.display(description="system prompt")
    def system_prompt_text(self, obj: Generation) -> SafeString:
        return text_box(obj.system_prompt)

    @admin.display(description="prompt")
    def prompt_text(self, obj: Generation) -> SafeString:
        return text_box(obj.prompt)

    @admin.display(description="output")
    def output_text(self, obj: Generation) -> SafeString:
        return text_box(obj.output)

    @admin.display(description="messages")
    def messages_text(self, obj: Generation) -> SafeString:
        return json_box(obj.messages)

    @admin.display(description="params")
    def params_text(self, obj: Generation) -> SafeString:
        return json_box(obj.params)

"""A finished generation, kept so that it can be shared at /g/<id>."""

from __future__ import annotations

import secrets
import string

from django.db import models
from django.urls import reverse

# Letters and digits only: a markdown autolinker or a chat app cuts a link before a trailing "_" or "-", which
# base64url ids could end in. 12 of 62 characters: 71.45 random bits.
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 12


def short_id() -> str:
    """A new share id (older rows keep their base64url ids: /g/<id> takes both)."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))


class Generation(models.Model):
    class Source(models.TextChoices):
        WEB = "web"
        API = "api"

    id = models.CharField(primary_key=True, max_length=16, default=short_id, editable=False)
    job_id = models.CharField(max_length=64, unique=True)
    model = models.CharField(max_length=200)
    prompt = models.TextField(blank=True)
    system_prompt = models.TextField(blank=True)
    messages = models.JSONField(null=True, blank=True)  # the whole conversation when the job was a chat
    params = models.JSONField(default=dict, blank=True)
    output = models.TextField(blank=True)
    finish_reason = models.CharField(max_length=16)  # stop | length | cancelled
    source = models.CharField(max_length=8, choices=Source.choices, default=Source.WEB)
    created = models.DateTimeField(auto_now_add=True, db_index=True)

    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    prefill_ms = models.FloatField(null=True, blank=True)
    ttft_ms = models.FloatField(null=True, blank=True)
    decode_tok_s = models.FloatField(null=True, blank=True)
    total_ms = models.FloatField(null=True, blank=True)
    bandwidth_gbs = models.FloatField(null=True, blank=True)  # effective weight+KV read rate; GPU runs only
    peak_pct = models.FloatField(null=True, blank=True)  # bandwidth_gbs as % of the device's peak

    class Meta:
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.id} ({self.model}, {self.completion_tokens} tokens)"

    def get_absolute_url(self) -> str:
        return reverse("generation", args=[self.id])

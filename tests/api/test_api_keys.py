"""API keys: the management command, hashing, and the bearer check against a real database."""

import hashlib

import pytest
from django.core.management import CommandError, call_command
from django.test import RequestFactory

from playground.api.auth import authenticate
from playground.api.errors import ApiError
from playground.api.models import ApiKey


def create_key(name: str, capsys) -> str:
    call_command("apikey", "create", name)
    return capsys.readouterr().out.strip()


@pytest.mark.django_db
def test_create_prints_the_key_once_and_stores_only_its_hash(capsys):
    key = create_key("ci", capsys)
    row = ApiKey.objects.get(name="ci")
    assert key.startswith("kog-") and len(key) > 40
    assert row.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert key.startswith(row.prefix) and len(row.prefix) < len(key) // 2
    assert key not in str(ApiKey.objects.values().get(name="ci"))

    call_command("apikey", "list")
    listing = capsys.readouterr().out
    assert "ci" in listing and row.prefix in listing and key not in listing and "active" in listing

    with pytest.raises(CommandError, match="exists already"):
        call_command("apikey", "create", "ci")


@pytest.mark.django_db
def test_revoke_by_name_or_prefix(capsys):
    create_key("a", capsys)
    create_key("b", capsys)
    call_command("apikey", "revoke", "a")
    call_command("apikey", "revoke", ApiKey.objects.get(name="b").prefix)
    assert all(k.revoked is not None for k in ApiKey.objects.all())
    with pytest.raises(CommandError, match="revoked already"):
        call_command("apikey", "revoke", "a")
    with pytest.raises(CommandError, match="no key named"):
        call_command("apikey", "revoke", "nobody")


def request_with(authorization: str | None):
    headers = {} if authorization is None else {"Authorization": authorization}
    return RequestFactory().post("/v1/completions", headers=headers)


async def status_of(authorization: str | None) -> int:
    try:
        await authenticate(request_with(authorization))
    except ApiError as error:
        assert error.body["error"]["code"] == "invalid_api_key"
        return error.status
    return 200


@pytest.mark.django_db(transaction=True)
async def test_open_until_the_first_key_then_only_active_keys_pass(capsys):
    assert await status_of(None) == 200  # no keys: the API is open

    key = ApiKey(name="ci")
    secret = key.set_new_key()
    await key.asave()
    assert await status_of(None) == 401
    assert await status_of("Bearer ") == 401
    assert await status_of(f"Basic {secret}") == 401
    assert await status_of("Bearer kog-wrong") == 401
    assert await status_of(f"Bearer {secret}") == 200
    await key.arefresh_from_db()
    assert key.last_used is not None

    key.revoked = key.last_used
    await key.asave()
    assert await status_of(f"Bearer {secret}") == 401  # revoked, and the API stays closed
    assert await status_of(None) == 401


@pytest.mark.django_db
def test_the_admin_makes_a_key_and_shows_it_once(admin_client):
    response = admin_client.post("/admin/api/apikey/add/", {"name": "editor"}, follow=True)
    shown = [str(m) for m in response.context["messages"]]
    row = ApiKey.objects.get(name="editor")
    key = next(word for message in shown for word in message.split() if word.startswith("kog-"))
    assert row.key_hash == hashlib.sha256(key.encode()).hexdigest() and key.startswith(row.prefix)

    admin_client.post("/admin/api/apikey/", {"action": "revoke", "_selected_action": [row.pk]})
    row.refresh_from_db()
    assert row.revoked is not None


@pytest.mark.django_db
def test_the_admin_revokes_keys_but_never_deletes_or_unrevokes_one(admin_client, client):
    """With no key row left the API is open: the admin may only revoke, and a revocation stays."""
    row = ApiKey(name="only")
    secret = row.set_new_key()
    row.save()
    change_url = f"/admin/api/apikey/{row.pk}/change/"
    assert admin_client.get(f"/admin/api/apikey/{row.pk}/delete/").status_code == 403
    assert admin_client.post(f"/admin/api/apikey/{row.pk}/delete/", {"post": "yes"}).status_code == 403
    # nor by the list's "delete selected" action, which is not offered
    listing = admin_client.get("/admin/api/apikey/").content.decode()
    assert 'value="delete_selected"' not in listing and 'value="revoke"' in listing
    admin_client.post(
        "/admin/api/apikey/", {"action": "delete_selected", "_selected_action": [row.pk], "post": "yes"}
    )
    assert ApiKey.objects.filter(pk=row.pk).exists()
    assert "deletelink" not in admin_client.get(change_url).content.decode()

    admin_client.post("/admin/api/apikey/", {"action": "revoke", "_selected_action": [row.pk]})
    row.refresh_from_db()
    revoked = row.revoked
    assert revoked is not None
    # the change form shows the revocation, and clearing it by hand does nothing
    response = admin_client.post(change_url, {"name": "renamed", "revoked_0": "", "revoked_1": ""})
    assert response.status_code == 302
    row.refresh_from_db()
    assert (row.name, row.revoked) == ("renamed", revoked)
    status = client.post("/v1/completions", {}, content_type="application/json",
                         headers={"authorization": f"Bearer {secret}"}).status_code  # fmt: skip
    assert status == 401  # still revoked, and the API still closed


@pytest.mark.django_db
def test_the_command_deletes_a_key_but_the_last_one_only_when_told_that_the_api_opens(capsys):
    create_key("a", capsys)
    create_key("b", capsys)
    call_command("apikey", "delete", "a")
    assert "deleted a" in capsys.readouterr().out
    assert list(ApiKey.objects.values_list("name", flat=True)) == ["b"]

    with pytest.raises(CommandError, match="last key: deleting it opens the API .* --open-api"):
        call_command("apikey", "delete", "b")
    assert ApiKey.objects.filter(name="b").exists()
    call_command("apikey", "revoke", "b")  # a revoked key counts too: the API stays closed
    with pytest.raises(CommandError, match="opens the API"):
        call_command("apikey", "delete", "b")

    call_command("apikey", "delete", "b", "--open-api")
    said = capsys.readouterr()
    assert "deleted b" in said.out and "the API is now open" in said.err
    assert not ApiKey.objects.exists()
    with pytest.raises(CommandError, match="no key named"):
        call_command("apikey", "delete", "nobody", "--open-api")

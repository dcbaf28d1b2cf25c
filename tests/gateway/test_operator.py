"""Operator surfaces of the gateway: the enrollment command and the admin screens."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse

from buzz_delivery.gateway import services
from buzz_delivery.gateway.models import Enrollment
from buzz_delivery.testing import random32

pytestmark = pytest.mark.django_db


def run(*args) -> dict:
    from io import StringIO

    out = StringIO()
    call_command("gateway_enrollment", *args, stdout=out)
    return json.loads(out.getvalue())


def test_the_command_enrolls_lists_and_revokes(community):
    key = random32().hex()
    assert run("enroll", "--community", str(community.id), "--agent", key, "--by", "ops")["created"] is True
    assert run("enroll", "--community", str(community.id), "--agent", key)["created"] is False
    assert run("list", "--community", str(community.id)) == {"community": str(community.id), "agents": [key]}
    assert run("revoke", "--community", str(community.id), "--agent", key) == {"revoked": 1}
    assert run("list", "--community", str(community.id))["agents"] == []


@pytest.mark.parametrize(
    "args",
    [
        ("enroll", "--community", "nope", "--agent", "ab" * 32),
        ("enroll", "--community", "018f0000-0000-7000-8000-000000000000", "--agent", "ab" * 32),
        ("revoke", "--community", "018f0000-0000-7000-8000-000000000000"),
    ],
)
def test_the_command_refuses_bad_arguments_with_exit_2_and_writes_nothing(args):
    with pytest.raises(CommandError) as info:
        call_command("gateway_enrollment", *args)
    assert info.value.returncode == 2
    assert Enrollment.objects.count() == 0


def test_the_admin_lists_enrollments_and_revokes_through_the_service(admin_client, community):
    key = random32()
    services.enroll(community.id, key, enrolled_by="ops")
    url = reverse("admin:buzz_gateway_enrollment_changelist")
    page = admin_client.get(url)
    assert page.status_code == 200 and key.hex() in page.content.decode()
    row = Enrollment.objects.get()
    response = admin_client.post(url, {"action": "revoke", "_selected_action": [str(row.pk)]}, follow=True)
    assert response.status_code == 200
    assert not services.is_enrolled(community.id, key)
    assert admin_client.get(reverse("admin:buzz_gateway_seenevent_changelist")).status_code == 200


def test_the_replay_store_list_links_to_no_page_that_cannot_open(admin_client):
    """A newcomer clicked a row of "Seen events" and got "seen event with ID b'\\xa7...' doesn't
    exist" and the admin index: the raw bytes key went into the link as a repr. Every link of
    the list must open; the row's event id and agent are on the list itself."""
    import html
    import re

    from django.utils import timezone

    from buzz_delivery.gateway.models import SeenEvent

    event_id, agent = random32(), random32()
    SeenEvent.objects.create(event_id=event_id, pubkey=agent, created_at=timezone.now())
    page = admin_client.get(reverse("admin:buzz_gateway_seenevent_changelist"))
    body = page.content.decode()
    assert page.status_code == 200
    for link in re.findall(r'href="(/admin/buzz_gateway/seenevent/[^"]+/)"', body):
        assert admin_client.get(html.unescape(link)).status_code == 200, link
    assert event_id.hex() in body and agent.hex() in body


def test_gateway_key_new_writes_a_0600_secret_and_prints_the_key_to_enroll(tmp_path, community):
    """A newcomer found the public key to enroll only through an undocumented attribute: the
    command makes the pair, writes the secret only its owner can read, prints the key and the
    commands that follow; the printed key is the one the gateway checks signatures against."""
    import stat
    from io import StringIO

    from buzz_delivery.gateway.client import read_key_file
    from buzz_delivery.gateway.nip98 import public_key_of

    path = tmp_path / "agent.key"
    out, err = StringIO(), StringIO()
    call_command("gateway_key", "new", "--out", str(path), "--community", str(community.id), stdout=out, stderr=err)

    public = out.getvalue().strip()
    assert len(public) == 64 and bytes.fromhex(public)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert public_key_of(read_key_file(str(path))).hex() == public
    assert f"gateway_enrollment enroll --community {community.id} --agent {public}" in err.getvalue()
    assert f"--key-file {path}" in err.getvalue()
    # Both remote workers: a newcomer with agent runs copied the only one printed (work), which
    # hands the key's deliveries to a delivery handler instead of accepting them into runs.
    assert "gateway.client work --url" in err.getvalue() and "gateway.client work-runs --url" in err.getvalue()
    shown = StringIO()
    call_command("gateway_key", "show", str(path), stdout=shown)
    assert shown.getvalue().strip() == public
    assert run("enroll", "--community", str(community.id), "--agent", public)["created"] is True


def test_gateway_key_new_refuses_to_overwrite_unless_forced(tmp_path):
    import stat
    from io import StringIO

    path = tmp_path / "agent.key"
    path.write_text("keep me\n")
    with pytest.raises(CommandError) as info:
        call_command("gateway_key", "new", "--out", str(path), stdout=StringIO(), stderr=StringIO())
    assert info.value.returncode == 1 and "--force" in str(info.value)
    assert path.read_text() == "keep me\n"

    out = StringIO()
    call_command("gateway_key", "new", "--out", str(path), "--force", stdout=out, stderr=StringIO())
    assert len(path.read_text().strip()) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["agent.key"]  # no temporary file left


def test_gateway_key_show_refuses_a_file_without_a_key(tmp_path):
    path = tmp_path / "not.key"
    path.write_text("hello\n")
    with pytest.raises(CommandError) as info:
        call_command("gateway_key", "show", str(path))
    assert info.value.returncode == 1

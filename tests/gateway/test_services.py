"""Gateway enrollments and the replay store (SPEC sections 14 and 15), on real PostgreSQL."""

from __future__ import annotations

import time

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from buzz_delivery.exceptions import CommunityNotWritable
from buzz_delivery.gateway import CATALOG, services
from buzz_delivery.gateway.models import Enrollment, SeenEvent
from buzz_delivery.gateway.replay import Admission
from buzz_delivery.testing import CommunityFactory, advance_to, random32

pytestmark = pytest.mark.django_db


def counts() -> tuple[int, int]:
    return Enrollment.objects.count(), SeenEvent.objects.count()


def test_enroll_is_idempotent_and_revoke_keeps_the_row_as_history(community):
    key = random32()
    first = services.enroll(community.id, key, enrolled_by="ops")
    assert first.created
    assert services.enroll(community.id, key) == services.Enrolled(first.enrollment_id, created=False)
    assert services.is_enrolled(community.id, key)
    assert services.revoke(community.id, key) == services.Revoked(1)
    assert services.revoke(community.id, key) == services.Revoked(0)
    assert not services.is_enrolled(community.id, key)
    again = services.enroll(community.id, key)
    assert again.created and again.enrollment_id != first.enrollment_id
    assert Enrollment.objects.filter(community=community).count() == 2
    row = Enrollment.objects.get(id=first.enrollment_id)
    assert row.revoked_at is not None and row.enrolled_by == "ops" and row.revoked_at >= row.enrolled_at


def test_enrolled_communities_lists_only_live_enrollments_in_active_communities():
    key, other = random32(), random32()
    a, b, c = CommunityFactory(), CommunityFactory(), CommunityFactory()
    for community in (a, b, c):
        services.enroll(community.id, key)
    services.enroll(a.id, other)
    services.revoke(b.id, key)
    advance_to(c, "quiescing")
    assert services.enrolled_communities(key) == [a.id]
    assert not services.is_enrolled(c.id, key)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: services.enroll("nope", random32()), "community_id"),
        (lambda c: services.enroll(c.id, b"short"), "agent_pubkey"),
        (lambda c: services.enroll(c.id, random32().hex()), "agent_pubkey"),
        (lambda c: services.enroll(c.id, random32(), enrolled_by="x" * 201), "enrolled_by"),
        (lambda c: services.enroll(c.id, random32(), enrolled_by=7), "enrolled_by"),
        (lambda c: services.enroll(c.id, random32(), enrolled_by="a\x00b"), "enrolled_by"),
        (lambda c: services.enroll("018f0000-0000-7000-8000-000000000000", random32()), "community_id"),
        (lambda c: services.revoke(c.id, b"x" * 31), "agent_pubkey"),
        (lambda c: services.is_enrolled(None, random32()), "community_id"),
        (lambda c: services.enrolled_communities(b""), "agent_pubkey"),
        (lambda c: services.record_event_id(b"x", random32(), 1, window_seconds=60), "event_id"),
        (lambda c: services.record_event_id(random32(), random32(), -1, window_seconds=60), "created_at"),
        (lambda c: services.record_event_id(random32(), random32(), 10**12, window_seconds=60), "created_at"),
        (lambda c: services.record_event_id(random32(), random32(), True, window_seconds=60), "created_at"),
        (lambda c: services.record_event_id(random32(), random32(), 1, window_seconds=0), "window_seconds"),
        (lambda c: services.prune_seen_events(keep_seconds=-1), "keep_seconds"),
        (lambda c: services.prune_seen_events(keep_seconds=60, batch_size=0), "batch_size"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_sql(community, call, field):
    before = counts()
    with pytest.raises(ValidationError) as info:
        call(community)
    assert field in info.value.message_dict
    assert counts() == before


def test_enrollment_in_a_fenced_community_is_refused_by_the_service_and_by_the_database(community):
    key = random32()
    services.enroll(community.id, key)
    advance_to(community, "quiescing")
    with pytest.raises(CommunityNotWritable):
        services.enroll(community.id, random32())
    with pytest.raises(CommunityNotWritable):
        services.revoke(community.id, key)
    with pytest.raises(DatabaseError, match="write fence"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO buzz_gateway_enrollment (id, community_id, agent_pubkey, enrolled_by)"
            " VALUES (gen_random_uuid(), %s, %s, '')",
            [community.id, random32()],
        )
    assert Enrollment.objects.filter(community=community).count() == 1


def test_the_database_holds_the_enrollment_keys_spec_15_asks_for():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'buzz_gateway_enrollment'::regclass AND contype = 'p'"
        )
        assert cursor.fetchone() == ("PRIMARY KEY (community_id, id)",)
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'enrollment_one_live_per_key'")
        assert "(community_id, agent_pubkey) WHERE (revoked_at IS NULL)" in cursor.fetchone()[0]
    assert CATALOG == ("buzz_gateway.Enrollment",)


def _enrolled_key(community, seconds_ago: int = 0) -> bytes:
    key = random32()
    services.enroll(community.id, key)
    # Column arithmetic through the IMMUTABLE helper: Citus refuses a STABLE operator
    # (timestamptz - interval) on a column in an UPDATE (docs/scale-out.md).
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE buzz_gateway_enrollment SET enrolled_at = buzz_delivery_plus_seconds(enrolled_at, -%s)"
            " WHERE community_id = %s AND agent_pubkey = %s",
            [seconds_ago, community.id, key],
        )
    return key


def test_an_event_id_is_admitted_once_and_only_within_the_window_of_the_database_clock(community):
    event_id, key, now = random32(), _enrolled_key(community, 600), int(time.time())
    assert services.record_event_id(event_id, key, now, window_seconds=60) is Admission.ADMITTED
    assert services.record_event_id(event_id, key, now, window_seconds=60) is Admission.REPLAYED
    assert services.record_event_id(random32(), key, now - 120, window_seconds=60) is Admission.STALE
    assert services.record_event_id(random32(), key, now + 120, window_seconds=60) is Admission.STALE
    assert SeenEvent.objects.count() == 1


def test_a_key_enrolled_nowhere_or_not_yet_when_it_signed_records_nothing(community):
    """Issue 27: any correctly signed request used to add a replay-store row (a disk filler for
    anyone who can make a key); and an event signed before the key's enrollment, never recorded,
    could have been replayed once it was enrolled."""
    now = int(time.time())
    assert services.record_event_id(random32(), random32(), now, window_seconds=60) is Admission.NOT_ENROLLED
    revoked = _enrolled_key(community, 600)
    services.revoke(community.id, revoked)
    assert services.record_event_id(random32(), revoked, now, window_seconds=60) is Admission.NOT_ENROLLED
    late = _enrolled_key(community)
    assert services.record_event_id(random32(), late, now - 30, window_seconds=60) is Admission.NOT_ENROLLED
    assert SeenEvent.objects.count() == 0
    # Signed now, after the enrollment: 'now' above may be a second before it on a loaded machine.
    signed = int(time.time())
    assert services.record_event_id(random32(), late, signed, window_seconds=60) is Admission.ADMITTED


def test_pruning_deletes_only_ids_older_than_the_window(capsys, community):
    key, now = _enrolled_key(community, 900), int(time.time())
    services.record_event_id(random32(), key, now, window_seconds=60)
    old = random32()
    services.record_event_id(old, key, now - 500, window_seconds=1000)
    call_command("prune_gateway_replays")
    assert '"deleted": 1' in capsys.readouterr().out
    assert not SeenEvent.objects.filter(event_id=old).exists()
    assert SeenEvent.objects.count() == 1
    with pytest.raises(Exception, match="shorter than the auth window"):
        call_command("prune_gateway_replays", "--older-than", "5")


def test_own_runs_if_enrolled_reads_the_enrollment_and_the_scope_of_a_run_batch_in_one_statement(community):
    from tests.agents_support import new_run

    key, other = random32(), random32()
    services.enroll(community.id, key)
    services.enroll(community.id, other)
    mine, theirs = new_run(community.id, key), new_run(community.id, other)
    elsewhere = CommunityFactory()
    missing = new_run(elsewhere.id, key)  # the key's run, but of a community it is not enrolled in
    with CaptureQueriesContext(connection) as queries:
        assert services.own_runs_if_enrolled(community.id, key, [mine, theirs, missing]) == {mine}
    assert len([q for q in queries if "buzz_agents_run" in q["sql"]]) == 1
    assert services.own_runs_if_enrolled(community.id, key, []) == set()
    assert services.own_runs_if_enrolled(elsewhere.id, key, [missing]) is None  # not enrolled there
    services.revoke(community.id, key)
    assert services.own_runs_if_enrolled(community.id, key, [mine]) is None
    for args, field in (
        ((None, other, [theirs]), "community_id"),
        ((community.id, b"x", [theirs]), "agent_pubkey"),
        ((community.id, other, ["nope"]), "run_ids"),
    ):
        with pytest.raises(ValidationError) as excinfo:
            services.own_runs_if_enrolled(*args)
        assert field in excinfo.value.message_dict

"""What a claim builds from its rows (issue 16's client-side fast path): the delivery model
instance and the lease, built without ``Model.__init__`` and without re-validating the
database's own values, and timestamps loaded by psycopg's loader instead of Django's. Each must
be indistinguishable from what the ORM builds for the same row."""

from __future__ import annotations

import datetime as dt
import io
import uuid
from collections.abc import Iterator

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.models.signals import post_init

from buzz_delivery import models, services
from buzz_delivery.services import db as services_db
from buzz_delivery.services import sql, tenancy
from buzz_delivery.testing import random32

pytestmark = pytest.mark.django_db


def commit(make_binding, n: int = 1) -> list:
    """``n`` deliveries to one target."""
    target = random32()
    bindings = [make_binding(target_pubkey=target) for _ in range(n)]
    first = bindings[0]
    event = models.Event.objects.get(community_id=first.community_id, event_id=first.message_event_id)
    return services.commit_deliveries(first.community_id, event, bindings)


def test_a_claimed_delivery_equals_the_orm_row_field_by_field(community, make_binding):
    commit(make_binding, 3)
    target = models.WorkflowAgentDelivery.objects.first().target_pubkey
    claims = services.claim_deliveries(community.id, target, limit=3)
    assert len(claims) == 3
    for claim in claims:
        built = claim.delivery
        stored = models.WorkflowAgentDelivery.objects.get(pk=built.pk)
        for name in sql.CLAIM_ATTNAMES:
            assert getattr(built, name) == getattr(stored, name), name
            assert type(getattr(built, name)) is type(getattr(stored, name)), name
        assert built._state.adding is False
        assert built._state.db == connection.alias
        assert built.get_deferred_fields() == set(sql.DEFERRED_FIELDS)
        # The deferred JSON fields load on first access, as with Model.from_db.
        assert built.history == stored.history and built.trigger_context == stored.trigger_context
        assert built.community == community  # a related row through its foreign key


def _instance_state(instance: models.WorkflowAgentDelivery) -> tuple[dict, dict]:
    """What an instance holds: its ``__dict__`` but the state, and the state's own ``__dict__``
    (descriptor defaults such as ``fields_cache`` and 6.1's ``fetch_mode`` appear once read, so
    they are read first)."""
    _ = instance._state.fields_cache
    _ = getattr(instance._state, "fetch_mode", None)
    values = {k: v for k, v in vars(instance).items() if k != "_state"}
    return values, dict(vars(instance._state))


def test_a_claimed_delivery_is_the_instance_model_from_db_builds_on_this_django(community, make_binding):
    """The fast path must build exactly what ``Model.from_db`` builds from the same row, on
    every Django the project supports (5.2, 6.0, 6.1: CI runs this module on 5.2 and 6.1)."""
    from buzz_delivery.services import leases

    assert leases.FAST_ROWS  # on a supported Django the claim takes the fast path
    commit(make_binding, 2)
    target = models.WorkflowAgentDelivery.objects.first().target_pubkey
    for claim in services.claim_deliveries(community.id, target, limit=2):
        built = claim.delivery
        row = tuple(getattr(built, name) for name in sql.CLAIM_ATTNAMES)
        reference = models.WorkflowAgentDelivery.from_db(connection.alias, sql.CLAIM_ATTNAMES, row)
        assert _instance_state(built) == _instance_state(reference)
        assert type(built._state) is type(reference._state)
        if hasattr(reference._state, "fetch_mode"):  # Django 6.1: the default mode, as from_db leaves it
            from django.db.models.fetch_modes import FETCH_ONE

            assert built._state.fetch_mode is reference._state.fetch_mode is FETCH_ONE
            assert built._state.peers == reference._state.peers == ()
        # A deferred field loads the same way on both (one query, the stored value).
        assert built.trigger_context == reference.trigger_context


def test_a_django_whose_from_db_takes_unknown_arguments_gets_from_db_itself(community, make_binding, monkeypatch):
    from buzz_delivery.services import leases

    monkeypatch.setattr(leases, "FAST_ROWS", False)
    built_by_from_db = []
    original = models.WorkflowAgentDelivery.from_db.__func__

    def spy(cls, db, field_names, values, **kwargs):
        built_by_from_db.append(values[list(field_names).index("id")])
        return original(cls, db, field_names, values, **kwargs)

    monkeypatch.setattr(models.WorkflowAgentDelivery, "from_db", classmethod(spy))
    commit(make_binding)
    target = models.WorkflowAgentDelivery.objects.first().target_pubkey
    built_by_from_db.clear()
    claim = services.claim_delivery(community.id, target)
    assert built_by_from_db == [claim.delivery.pk]


def test_timestamps_of_a_claim_are_utc_aware_and_equal_to_the_orm_values(community, make_binding):
    (delivery_id,) = commit(make_binding)
    target = models.WorkflowAgentDelivery.objects.get(pk=delivery_id).target_pubkey
    claim = services.claim_delivery(community.id, target)
    stored = models.WorkflowAgentDelivery.objects.get(pk=delivery_id)
    for name in ("created_at", "claimed_at", "lease_until"):
        value = getattr(claim.delivery, name)
        assert value.tzinfo is dt.UTC, name
        assert value == getattr(stored, name), name


def _loaders_seen(calls: list[type], cursors: list[type] | None = None) -> object:
    """An execute wrapper recording the timestamptz loader of each statement's psycopg cursor
    (and, with ``cursors``, the cursor's class)."""

    def wrapper(execute, sql, params, many, context):
        raw = context["cursor"].cursor
        calls.append(raw.adapters.get_loader(services_db._TIMESTAMPTZ, services_db._TEXT))
        if cursors is not None:
            cursors.append(type(raw))
        return execute(sql, params, many, context)

    return wrapper


@pytest.fixture(params=["enforced", "not enforced"])
def enforcement(request) -> Iterator[str]:
    """Row-level security on (the services bind on the client, the context in front) or off
    (the hot statements go to the server-bound cursor of ``services.db``)."""
    if request.param == "enforced":
        yield request.param
        return
    call_command("tenant_isolation", "disable", stdout=io.StringIO())
    tenancy.forget()
    try:
        yield request.param
    finally:
        with connection.cursor() as cursor:  # fire the deferred key checks the test queued
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        call_command("tenant_isolation", "enable", stdout=io.StringIO())
        tenancy.forget()


def test_claim_and_settle_statements_load_timestamps_with_psycopgs_loader_and_the_orm_keeps_djangos(
    enforcement, community, make_binding
):  # enforcement first: it alters tables, which rows written in the transaction would prevent
    (delivery_id,) = commit(make_binding)
    target = models.WorkflowAgentDelivery.objects.get(pk=delivery_id).target_pubkey
    connection.ensure_connection()
    django_loader = connection.connection.adapters.get_loader(services_db._TIMESTAMPTZ, services_db._TEXT)
    assert django_loader is not services_db._PSYCOPG_TIMESTAMPTZ_LOADER  # else this test shows nothing
    services_calls: list[type] = []
    cursors: list[type] = []
    with connection.execute_wrapper(_loaders_seen(services_calls, cursors)):
        claim = services.claim_delivery(community.id, target)
        services.finish_delivery(claim.lease, "finished")
    assert services_calls and all(loader is services_db._PSYCOPG_TIMESTAMPTZ_LOADER for loader in services_calls)
    server_bound = [c is services_db._UnpreparedCursor for c in cursors]
    assert server_bound == [enforcement == "not enforced"] * 2  # each path of fetch_all, as the fixture says
    # The ORM's statements on the same connection keep Django's loader.
    orm_calls: list[type] = []
    with connection.execute_wrapper(_loaders_seen(orm_calls)):
        models.WorkflowAgentDelivery.objects.get(pk=delivery_id)
    assert orm_calls == [django_loader]


def test_a_session_in_another_time_zone_keeps_djangos_loader():
    with connection.cursor() as django_cursor:
        django_cursor.execute("SET TIME ZONE 'Europe/Paris'")
        try:
            cursor = connection.connection.cursor()
            services_db._load_timestamps_in_c(cursor)
            assert cursor.adapters.get_loader(services_db._TIMESTAMPTZ, services_db._TEXT) is not (
                services_db._PSYCOPG_TIMESTAMPTZ_LOADER
            )
        finally:
            django_cursor.execute("SET TIME ZONE 'UTC'")


def test_post_init_receivers_still_hear_of_claimed_deliveries(community, make_binding):
    commit(make_binding, 2)
    heard = []

    def receiver(sender, instance, **kwargs):
        heard.append(instance.pk)

    post_init.connect(receiver, sender=models.WorkflowAgentDelivery)
    try:
        target = models.WorkflowAgentDelivery.objects.first().target_pubkey
        heard.clear()
        claims = services.claim_deliveries(community.id, target, limit=2)
    finally:
        post_init.disconnect(receiver, sender=models.WorkflowAgentDelivery)
    assert heard == [c.delivery.pk for c in claims] and len(heard) == 2


def test_a_lease_from_a_claim_equals_one_built_and_validated_from_its_fields(community, make_binding):
    (delivery_id,) = commit(make_binding)
    target = models.WorkflowAgentDelivery.objects.get(pk=delivery_id).target_pubkey
    lease = services.claim_delivery(community.id, target).lease
    rebuilt = services.Lease(
        community_id=str(lease.community_id),
        delivery_id=str(lease.delivery_id),
        target_pubkey=lease.target_pubkey,
        lease_generation=lease.lease_generation,
        lease_until=lease.lease_until,
    )
    assert rebuilt == lease and hash(rebuilt) == hash(lease)
    renewed = services.renew_delivery(lease)
    assert isinstance(renewed, services.Renewed)
    assert renewed.lease.lease_until.tzinfo is dt.UTC and renewed.lease.lease_until >= lease.lease_until


def test_with_use_tz_off_statements_keep_djangos_naive_timestamps(settings):
    settings.USE_TZ = False
    try:
        (value,) = services_db.fetch_all("SELECT timestamptz '2026-01-02 03:04:05+00' AS t", {})[0]
        assert value.tzinfo is None
    finally:
        settings.USE_TZ = True
    (value,) = services_db.fetch_all("SELECT timestamptz '2026-01-02 03:04:05+00' AS t", {})[0]
    assert value == dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC) and value.tzinfo is dt.UTC


def test_a_lease_from_the_database_is_converted_to_utc_or_refused_when_naive():
    import uuid
    from zoneinfo import ZoneInfo

    from django.core.exceptions import ValidationError

    paris = dt.datetime(2026, 1, 2, 4, 4, 5, tzinfo=ZoneInfo("Europe/Paris"))
    lease = services.Lease.from_database(uuid.uuid4(), uuid.uuid4(), bytes(32), 1, paris)
    assert lease.lease_until == paris and lease.lease_until.tzinfo is dt.UTC
    with pytest.raises(ValidationError, match=r"lease\.lease_until"):
        services.Lease.from_database(uuid.uuid4(), uuid.uuid4(), bytes(32), 1, dt.datetime(2026, 1, 2))


def test_load_snapshots_sets_what_the_orm_reads_and_leaves_a_missing_delivery_deferred(community, make_binding):
    """``load_snapshots`` (an async handler's claims) reads the snapshots with one statement of
    its own (ids as one ``uuid[]`` literal) and decodes them as the JSON fields do: each value is
    what the ORM loads for the row; a delivery that is not there keeps them deferred."""
    target = random32()
    bindings = [make_binding(target_pubkey=target) for _ in range(3)]
    event = models.Event.objects.get(community_id=community.id, event_id=bindings[0].message_event_id)
    trace = {"steps": [1, "two", None, {"nested": True}], "unicode": "é\u2603"}
    services.commit_deliveries(community.id, event, bindings, execution_trace=trace, trigger_context=["a", 1.5])
    claims = services.claim_deliveries(community.id, target, limit=3)
    assert len(claims) == 3
    deliveries = [claim.delivery for claim in claims]
    ghost = models.WorkflowAgentDelivery.from_db(
        connection.alias, sql.CLAIM_ATTNAMES, tuple(getattr(deliveries[0], name) for name in sql.CLAIM_ATTNAMES)
    )
    ghost.id = uuid.uuid4()
    services.load_snapshots(community.id, [*deliveries, ghost])
    for delivery in deliveries:
        stored = models.WorkflowAgentDelivery.objects.get(pk=delivery.pk)
        assert delivery.get_deferred_fields() == set(sql.DEFERRED_FIELDS) - set(sql.SNAPSHOT_FIELDS)
        for name in sql.SNAPSHOT_FIELDS:
            assert vars(delivery)[name] == getattr(stored, name), name
        assert vars(delivery)["execution_trace"] == trace
        assert vars(delivery)["trigger_context"] == ["a", 1.5]
    assert set(sql.SNAPSHOT_FIELDS) <= ghost.get_deferred_fields()

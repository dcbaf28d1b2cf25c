"""Who holds a delivery, and its history (issue 17): ``claimed_by`` recorded by the claim, and one
history entry per transition written by the transition's own statement, bounded, append-only
(a trigger), deleted with the row."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, transaction
from django.urls import reverse

from buzz_delivery import models, services
from buzz_delivery.testing import DeliveryFactory, Expr, backdate, frozen_db_clock, set_delivery_state
from buzz_delivery.triggers import HISTORY_SQLSTATE
from buzz_delivery.worker.runtime import holder_identity
from tests.conftest import backdate_lease
from tests.operator_support import backdate_finished, pending
from tests.test_admin import CHANGELIST, operator, run_action, viewer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db

HOLDER = "host-a:4242:worker"


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def history_of(delivery_id: uuid.UUID) -> list[dict]:
    """The row's history, read by raw SQL (no model cache in between)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT history::text FROM buzz_delivery_delivery WHERE id = %s", [delivery_id])
        return json.loads(cursor.fetchone()[0])


def at(entry: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(entry["at"])


def claim(delivery: models.WorkflowAgentDelivery, holder: str | None = HOLDER) -> services.Lease:
    won = services.claim_delivery(delivery.community_id, bytes(delivery.target_pubkey), holder=holder)
    assert won is not None
    return won.lease


def raw(sql: str, params: list) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


# --- holder ------------------------------------------------------------------------------


def test_the_claim_records_its_holder_and_history_entry_in_its_one_statement(community, django_assert_num_queries):
    delivery = pending(community)
    with transaction.atomic(), frozen_db_clock():
        now = db_now()
        with django_assert_num_queries(1):
            won = services.claim_delivery(community.id, bytes(delivery.target_pubkey), holder=HOLDER)
        assert won is not None
        assert won.delivery.claimed_by == HOLDER
        assert won.delivery.renewals == 0
        (entry,) = history_of(delivery.id)
    assert entry == {
        "event": "claim",
        "status": "claimed",
        "generation": 1,
        "actor": HOLDER,
        "at": entry["at"],
        "attempt": 1,
    }
    assert at(entry) == now  # the database clock, not Python's


def test_claim_deliveries_records_the_holder_on_every_row(community, make_binding):
    first = pending(community)
    second = DeliveryFactory(binding=make_binding(target_pubkey=bytes(first.target_pubkey)))
    claims = services.claim_deliveries(community.id, bytes(first.target_pubkey), limit=10, holder="gw")
    assert {c.delivery.id for c in claims} == {first.id, second.id}
    for row in models.WorkflowAgentDelivery.objects.filter(id__in=[first.id, second.id]):
        assert row.claimed_by == "gw"
        assert [e["actor"] for e in row.history] == ["gw"]


def test_a_claim_without_holder_records_none(community):
    delivery = pending(community)
    claim(delivery, holder=None)
    delivery.refresh_from_db()
    assert delivery.claimed_by is None
    assert history_of(delivery.id)[0]["actor"] is None


@pytest.mark.parametrize(
    "holder, message",
    [
        (42, "must be a str or None"),
        (b"host", "must be a str or None"),
        ("h" * 201, "at most 200 characters"),
        ("nul\x00inside", "NUL"),
    ],
)
@pytest.mark.parametrize("batch", [False, True])
def test_a_bad_holder_is_refused_by_name_and_nothing_is_written(
    community, holder, message, batch, django_assert_num_queries
):
    delivery = pending(community)
    with django_assert_num_queries(0), pytest.raises(ValidationError) as caught:
        if batch:
            services.claim_deliveries(community.id, bytes(delivery.target_pubkey), limit=5, holder=holder)
        else:
            services.claim_delivery(community.id, bytes(delivery.target_pubkey), holder=holder)
    assert list(caught.value.message_dict) == ["holder"]
    assert message.lower() in caught.value.message_dict["holder"][0].lower()
    delivery.refresh_from_db()
    assert (delivery.status, delivery.lease_generation, delivery.claimed_by, delivery.history) == (
        "pending",
        0,
        None,
        [],
    )


def test_a_holder_of_exactly_200_characters_is_accepted(community):
    delivery = pending(community)
    claim(delivery, holder="h" * 200)
    delivery.refresh_from_db()
    assert delivery.claimed_by == "h" * 200


def test_the_database_refuses_a_holder_over_200_characters(community):
    delivery = pending(community)
    with pytest.raises(DatabaseError), transaction.atomic():
        raw(
            "UPDATE buzz_delivery_delivery_record SET claimed_by = repeat('h', 201)"
            " WHERE community_id = %s AND id = %s",
            [community.id, delivery.id],
        )


def test_the_worker_holder_is_host_pid_name_within_200_characters():
    import os
    import socket

    assert holder_identity("drain") == f"{socket.gethostname()}:{os.getpid()}:drain"
    assert len(holder_identity("n" * 500)) == 200


# --- history of each transition ---------------------------------------------------------


def test_renewals_are_counted_and_the_settle_reports_them_with_its_holder(community):
    delivery = pending(community)
    lease = claim(delivery)
    for _ in range(2):
        assert isinstance(services.renew_delivery(lease), services.Renewed)
    assert len(history_of(delivery.id)) == 1  # a renew counts; it appends nothing
    with transaction.atomic(), frozen_db_clock():
        now = db_now()
        assert services.finish_delivery(lease, "finished") == services.Settled("finished")
        _claim, settle = history_of(delivery.id)
    assert settle == {
        "event": "settle",
        "status": "finished",
        "generation": 1,
        "actor": HOLDER,
        "at": settle["at"],
        "renewals": 2,
    }
    assert at(settle) == now


def test_a_failed_settle_and_a_batch_settle_append_their_entries(community, make_binding):
    first = pending(community)
    second = DeliveryFactory(binding=make_binding(target_pubkey=bytes(first.target_pubkey)))
    claims = services.claim_deliveries(community.id, bytes(first.target_pubkey), limit=2, holder=HOLDER)
    outcomes = services.finish_deliveries([c.lease for c in claims], "failed", failure_code="boom")
    assert all(o == services.Settled("failed") for o in outcomes)
    for delivery_id in (first.id, second.id):
        events = [(e["event"], e["status"], e["generation"], e["actor"]) for e in history_of(delivery_id)]
        assert events == [("claim", "claimed", 1, HOLDER), ("settle", "failed", 1, HOLDER)]


def test_a_lost_settle_appends_nothing(community):
    delivery = pending(community)
    lease = claim(delivery)
    backdate_lease(delivery.id)
    assert services.finish_delivery(lease, "finished") == services.LeaseLost()
    assert [e["event"] for e in history_of(delivery.id)] == ["claim"]


def test_retries_record_pending_then_exhausted(community):
    delivery = pending(community)  # MAX_ATTEMPTS defaults to 3
    assert delivery.max_attempts == 3
    for n in (1, 2, 3):
        services.finish_delivery(claim(delivery, holder=f"h{n}"), "retry", failure_message="try again")
        set_delivery_state((community.id, delivery.id), next_attempt_at=None)
    events = [(e["event"], e["status"], e["generation"], e["actor"]) for e in history_of(delivery.id)]
    assert events == [
        ("claim", "claimed", 1, "h1"),
        ("retry", "pending", 1, "h1"),
        ("claim", "claimed", 2, "h2"),
        ("retry", "pending", 2, "h2"),
        ("claim", "claimed", 3, "h3"),
        ("retry", "failed", 3, "h3"),
    ]


def test_the_reaper_records_lapsed_leases_and_expiries_at_its_database_time(community):
    lapsed = pending(community)
    claim(lapsed)
    backdate_lease(lapsed.id)
    overdue = pending(community)
    backdate((community.id, overdue.id), expires_at=60)
    before = db_now()
    assert services.reap().total == 2
    *_, reaped = history_of(lapsed.id)
    assert (reaped["event"], reaped["status"], reaped["generation"], reaped["actor"], reaped["renewals"]) == (
        "reap",
        "pending",
        2,
        "reaper",
        0,
    )
    (expired,) = history_of(overdue.id)
    assert (expired["event"], expired["status"], expired["generation"], expired["actor"]) == (
        "expire",
        "expired",
        1,
        "reaper",
    )
    assert at(reaped) >= before and at(expired) >= before


def test_operator_actions_record_their_actor(community):
    delivery = pending(community)
    claim(delivery)
    assert services.force_fail_delivery(community.id, delivery.id, actor="operator:alice").done
    assert services.requeue_delivery(community.id, delivery.id).done
    *_, forced, requeued = history_of(delivery.id)
    assert (forced["event"], forced["status"], forced["generation"], forced["actor"]) == (
        "force_fail",
        "failed",
        2,
        "operator:alice",
    )
    assert (requeued["event"], requeued["status"], requeued["generation"], requeued["actor"]) == (
        "requeue",
        "pending",
        3,
        "operator",
    )


def test_a_bad_operator_actor_is_refused_by_name(community):
    delivery = pending(community)
    with pytest.raises(ValidationError) as caught:
        services.requeue_delivery(community.id, delivery.id, actor="a" * 201)
    assert list(caught.value.message_dict) == ["actor"]


# --- append-only, bounded, pruned -------------------------------------------------------


def _refused(sql: str, params: list) -> None:
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        raw(sql, params)
    assert getattr(caught.value.__cause__, "sqlstate", None) == HISTORY_SQLSTATE, caught.value


def test_the_trigger_refuses_any_rewrite_of_past_entries(community):
    delivery = pending(community)
    services.finish_delivery(claim(delivery), "finished")
    where = " WHERE community_id = %s AND id = %s"
    ids = [community.id, delivery.id]
    # Edit a past entry's actor in place.
    _refused(
        "UPDATE buzz_delivery_delivery_record SET history = jsonb_set(history, '{0,actor}', '\"forged\"')" + where,
        ids,
    )
    # Drop the last entry, drop the first, empty it, replace it with one entry.
    _refused("UPDATE buzz_delivery_delivery_record SET history = history - (-1)" + where, ids)
    _refused("UPDATE buzz_delivery_delivery_record SET history = history - 0" + where, ids)
    _refused("UPDATE buzz_delivery_delivery_record SET history = '[]'" + where, ids)
    _refused('UPDATE buzz_delivery_delivery_record SET history = \'[{"event": "claim"}]\'' + where, ids)
    # Rewrite one and append one in the same statement; append two at once.
    _refused(
        'UPDATE buzz_delivery_delivery_record SET history = (history - 0) || \'[{"a": 1}, {"b": 2}]\'::jsonb' + where,
        ids,
    )
    _refused(
        'UPDATE buzz_delivery_delivery_record SET history = history || \'[{"a": 1}, {"b": 2}]\'::jsonb' + where, ids
    )
    # Dropping the oldest is the bound's privilege, not allowed below it.
    _refused(
        "UPDATE buzz_delivery_delivery_record"
        " SET history = (history - 0) || jsonb_build_array('{\"a\": 1}'::jsonb)" + where,
        ids,
    )
    assert [e["event"] for e in history_of(delivery.id)] == ["claim", "settle"]
    # An honest append of one entry passes (the services' form); so does an update not naming it.
    raw('UPDATE buzz_delivery_delivery_record SET history = history || \'[{"event": "note"}]\'' + where, ids)
    raw("UPDATE buzz_delivery_delivery_record SET failure_message = NULL" + where, ids)
    assert [e["event"] for e in history_of(delivery.id)] == ["claim", "settle", "note"]


def test_history_keeps_the_last_50_entries(community):
    delivery = pending(community)
    where = " WHERE community_id = %s AND id = %s"
    ids = [community.id, delivery.id]
    for i in range(60):
        set_delivery_state(
            (community.id, delivery.id),
            history=Expr("buzz_delivery_history_push(history, jsonb_build_object('n', %s))", [i]),
        )
    entries = history_of(delivery.id)
    assert [e["n"] for e in entries] == list(range(10, 60))
    # The services' transitions keep the bound too: the oldest goes, the newest is the claim.
    lease = claim(delivery)
    entries = history_of(delivery.id)
    assert len(entries) == 50 and entries[0]["n"] == 11 and entries[-1]["event"] == "claim"
    services.finish_delivery(lease, "finished")
    assert len(history_of(delivery.id)) == 50
    # Past the bound no statement can add: a CHECK refuses 51 entries however they are written.
    with pytest.raises(DatabaseError), transaction.atomic():
        raw(
            'UPDATE buzz_delivery_delivery_record SET history = history || \'[{"event": "extra"}]\'' + where,
            ids,
        )


def test_history_is_pruned_with_its_delivery(community):
    delivery = pending(community)
    services.finish_delivery(claim(delivery), "finished")
    assert len(history_of(delivery.id)) == 2
    backdate_finished(delivery.id, 7200)
    result = services.prune_deliveries({"finished": dt.timedelta(hours=1)})
    assert result.total == 1
    assert not models.WorkflowAgentDelivery.objects.filter(id=delivery.id).exists()
    # On the row itself: no other table holds a delivery's history (but its live queue row, which
    # the terminal deletes: issue 31, stage 2).
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM information_schema.columns WHERE column_name = 'history'"
            " AND table_name LIKE 'buzz_delivery%%' AND table_name NOT IN"
            " ('buzz_delivery_delivery', 'buzz_delivery_delivery_record', 'buzz_delivery_delivery_queue')"
        )
        assert cursor.fetchone()[0] == 0


# --- the admin ----------------------------------------------------------------------------


def test_the_admin_lists_the_holder_and_shows_the_history_on_the_detail_page(viewer, community):  # noqa: F811
    delivery = pending(community)
    lease = claim(delivery)
    services.renew_delivery(lease)
    services.finish_delivery(lease, "failed", failure_code="boom")
    page = viewer.get(reverse(CHANGELIST)).content.decode()
    assert "column-holder" in page
    assert HOLDER in page
    detail = viewer.get(reverse("admin:buzz_delivery_workflowagentdelivery_change", args=[delivery.id]))
    html = detail.content.decode()
    assert 'class="buzz-history"' in html
    table = html[html.index('class="buzz-history"') :]
    table = table[: table.index("</table>")]
    # Newest first: the settle, then the claim; each with its generation and actor.
    assert table.index("settle") < table.index("claim")
    assert table.count(HOLDER) == 2
    assert "<td>failed</td>" in table and "<td>1</td>" in table


def test_an_admin_action_records_the_operator_in_the_history(operator, community):  # noqa: F811
    delivery = pending(community)
    claim(delivery)
    run_action(operator, "force_fail_selected", delivery)
    *_, entry = history_of(delivery.id)
    assert (entry["event"], entry["actor"]) == ("force_fail", "operator:operator")


def _plan(statement: str, params: dict) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN VERBOSE " + statement, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_the_history_push_is_inlined_into_the_hot_statements(community):
    """An SQL function the planner cannot inline runs per row at tens of microseconds: the push
    must stay a plain expression in the claim and settle plans (migration 0008)."""
    from buzz_delivery.services import sql

    lease = {"community_id": community.id, "delivery_id": uuid.uuid4(), "target_pubkey": b"\x00" * 32}
    plans = [
        _plan(
            sql.claim_oldest_pending(by_id=False, by_binding=False),
            {**lease, "limit": 16, "lease_seconds": 30.0, "holder": "h"},
        ),
        _plan(
            sql.FINISH_IF_CURRENT_GENERATION,
            {**lease, "lease_generation": 1, "status": "finished", "failure_code": None, "failure_message": None},
        ),
        _plan(
            sql.FINISH_MANY_IF_CURRENT_GENERATION,
            {
                **lease,
                "delivery_ids": [uuid.uuid4()],
                "lease_generations": [1],
                "target_pubkeys": [b"\x00" * 32],
                "status": "finished",
                "failure_code": None,
                "failure_message": None,
            },
        ),
    ]
    for plan in plans:
        assert "jsonb_array_length" in plan, plan
        assert "buzz_delivery_history_push" not in plan, plan
        # Migration 0035: the bound is one array element removed, not a jsonpath slice per push.
        assert "jsonb_path_query_array" not in plan, plan


@pytest.mark.parametrize("actor", ["host-a:4242:worker", 'a "quoted" \\ back\\slash', "ünïcødé ✓\nline", None])
def test_the_immutable_history_object_is_the_object_jsonb_build_object_builds(actor):
    """Every lease statement builds its entry with ``sql.history_object`` (IMMUTABLE over the
    row's columns, as Citus requires, issue 30): the same JSON, key for key and type for type,
    as ``jsonb_build_object`` of the same values, for any text an actor may hold."""
    from buzz_delivery.services.sql import history_object

    fields = {
        "event": "'settle'",
        "status": "%(status)s::varchar",
        "generation": "%(generation)s::bigint",
        "actor": "%(actor)s::text",
        "at": "%(at)s::timestamptz",
        "renewals": "%(renewals)s::integer",
        "attempt": "%(attempt)s::integer + 1",
        "reason": "NULL::text",
    }
    plain = ", ".join(f"'{key}', {value}" for key, value in fields.items())
    params = {
        "status": "finished",
        "generation": 2**40,
        "actor": actor,
        "at": dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC),
        "renewals": 0,
        "attempt": 7,
    }
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT ({history_object(fields)})::text, jsonb_build_object({plain})::text", params)
        ours, theirs = cursor.fetchone()
    assert json.loads(ours) == json.loads(theirs)
    assert ours == theirs  # the same jsonb, printed the same
    assert json.loads(ours)["generation"] == 2**40 and json.loads(ours)["actor"] == actor


def test_the_push_keeps_what_the_jsonpath_slice_kept_at_every_length():
    """Migration 0035's push (remove the oldest when full) against 0008's slice of the last 50,
    for every history length a CHECK allows (0..50) and entries that are one element (an object,
    as every statement pushes, or a scalar; an array entry would append several: not a push)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT n, e, buzz_delivery_history_push(h, e), jsonb_path_query_array(h || e, '$[last - 49 to last]')
            FROM generate_series(0, 50) AS n,
                 LATERAL (SELECT coalesce(jsonb_agg(jsonb_build_object('n', i)), '[]'::jsonb) AS h
                          FROM generate_series(1, n) AS i) AS built,
                 unnest(ARRAY['{"event": "claim", "n": 0}'::jsonb, '"x"'::jsonb, 'null'::jsonb]) AS e
            """
        )
        rows = cursor.fetchall()
    assert len(rows) == 51 * 3
    for n, entry, pushed, sliced in rows:
        pushed, sliced = json.loads(pushed), json.loads(sliced)
        assert pushed == sliced, (n, entry)
        assert len(pushed) == min(n + 1, 50) and pushed[-1] == json.loads(entry), (n, entry)

"""Core migration 0037 on the rows a stage-1 database really holds (review of issue 31, stage 2):
every status, a community that is fenced, claimed rows holding slots, singleton holders, retried
and requeued rows, a history at its bound, and the slots main's transitions leave behind on a row
that is no longer claimed. The view must show every column as before, forward and back."""

from __future__ import annotations

import importlib
import threading
import time

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, connections

from buzz_delivery import scaleout
from buzz_delivery.models import DeliveryQueue, DeliveryRecord, WorkflowAgentDelivery
from buzz_delivery.testing import BindingFactory, CommunityFactory, DeliveryFactory, Expr, set_delivery_state
from tests.citus_support import CITUS_MODE

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("migrated_after")]

QUEUE = DeliveryQueue._meta.db_table
RECORD = DeliveryRecord._meta.db_table
VIEW = WorkflowAgentDelivery._meta.db_table

FIFTY = "(SELECT jsonb_agg(jsonb_build_object('event', 'claim', 'n', g)) FROM generate_series(1, 50) AS g)"
LEASE = {
    "status": "'claimed'",
    "lease_until": "now() + interval '1 hour'",
    "claimed_at": "now() - interval '1 minute'",
    "claimed_by": "'worker-7'",
}
# Each row as main's transitions leave it in the record (0036's schema).
ROWS: dict[str, dict[str, str]] = {
    "committed": {},
    "retried": {  # back to pending by a retry: main leaves the slot it held behind
        "lease_generation": "2",
        "attempt": "1",
        "next_attempt_at": "now() + interval '5 minutes'",
        "claimed_by": "'worker-1'",
        "renewals": "3",
        "history": '\'[{"event": "claim"}, {"event": "retry"}]\'',
        "slot_community": "4",
        "slot_target": "5",
    },
    "claimed": {
        **LEASE,
        "lease_generation": "1",
        "attempt": "1",
        "slot_community": "0",
        "slot_target": "1",
        "slot_workflow": "2",
        "expires_at": "now() + interval '1 day'",
        "history": '\'[{"event": "claim"}]\'',
    },
    "claimed-at-bound": {**LEASE, "lease_generation": "60", "attempt": "1", "history": FIFTY},
    "pending-at-bound": {"lease_generation": "61", "attempt": "1", "history": FIFTY, "priority": "5"},
    "singleton-holder": {"singleton_key": "'k1'"},
    "singleton-retried": {"singleton_key": "'k1'", "lease_generation": "1", "attempt": "1"},
    "singleton-claimed": {**LEASE, "singleton_key": "'k2'", "lease_generation": "1", "attempt": "1"},
    "requeued": {"requeues": "2", "lease_generation": "5", "history": '\'[{"event": "requeue"}]\''},
    "finished": {
        "status": "'finished'",
        "finished_at": "now()",
        "lease_generation": "1",
        "attempt": "1",
        "slot_workflow": "3",
    },
    "failed": {
        "status": "'failed'",
        "finished_at": "now()",
        "failure_code": "'boom'",
        "failure_message": "'it broke'",
        "lease_generation": "2",
        "attempt": "2",
        "max_attempts": "2",
    },
    "expired": {"status": "'expired'", "finished_at": "now()", "failure_code": "'ttl'", "expires_at": "now()"},
}


def _sql(statement: str, params: object = None) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def _clone(seed, step: str, columns: dict[str, str]) -> None:
    names = ", ".join(columns)
    values = ", ".join(columns.values())
    _sql(
        f"INSERT INTO {RECORD} (id, community_id, workflow_id, run_id, step_id, target_pubkey,"
        " definition_event_id, message_event_id, cause_kind, cause_webhook_invocation_id, created_at"
        f"{', ' if columns else ''}{names})"
        " SELECT gen_random_uuid(), community_id, workflow_id, run_id, %s, target_pubkey, definition_event_id,"
        " message_event_id, 'webhook', gen_random_uuid(), now() - interval '1 hour'"
        f"{', ' if columns else ''}{values} FROM {RECORD} WHERE community_id = %s AND id = %s",
        [step, seed.community_id, seed.id],
    )


def _view() -> dict[str, dict[str, object]]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {VIEW} ORDER BY community_id, step_id")
        names = [c.name for c in cursor.description]
        return {
            f"{row[names.index('community_id')]}/{row[names.index('step_id')]}": dict(zip(names, row, strict=True))
            for row in cursor.fetchall()
        }


def _differences(before, after) -> list[str]:
    assert before.keys() == after.keys()
    return [
        f"{key}.{column}: {value!r} -> {after[key][column]!r}"
        for key, row in before.items()
        for column, value in row.items()
        if after[key][column] != value
    ]


def _security(table: str) -> list[tuple]:
    return _sql(
        "SELECT relrowsecurity, relforcerowsecurity, relacl::text[], ARRAY(SELECT polname || ':' ||"
        " pg_get_expr(polqual, polrelid) || ':' || polroles::regrole[]::text FROM pg_policy"
        " WHERE polrelid = c.oid ORDER BY polname) FROM pg_class AS c WHERE c.oid = %s::regclass",
        [table],
    )


def _forward() -> None:
    call_command("migrate", verbosity=0)
    if CITUS_MODE:
        scaleout.distribute_tables()


def test_every_kind_of_row_shows_the_same_through_the_view_forward_back_and_forward(make_binding, community):
    fenced = CommunityFactory()
    seeds = [DeliveryFactory(binding=make_binding()), DeliveryFactory(binding=BindingFactory(run__community=fenced))]
    call_command("migrate", "buzz_delivery", "0036", verbosity=0)
    try:
        for seed in seeds:
            for step, columns in ROWS.items():
                _clone(seed, step, columns)
        for state in ("quiescing", "fenced"):
            _sql("UPDATE buzz_delivery_community SET deletion_state = %s WHERE id = %s", [state, fenced.id])
        record_before = _sql(f"SELECT * FROM {RECORD} ORDER BY id")
        before = _view()
    finally:
        _forward()

    after = _view()
    # The one difference: a live row that is not claimed holds no slot (the queue's slot keys are
    # not partial on the status); main left a retried row's slots behind.
    assert sorted(_differences(before, after)) == sorted(
        f"{c}/retried.{column}: {value} -> None"
        for c in (community.id, fenced.id)
        for column, value in (("slot_community", 4), ("slot_target", 5))
    )
    queue = dict(_sql(f"SELECT step_id, q.status FROM {QUEUE} q JOIN {RECORD} r USING (community_id, id)"))
    assert set(queue) == {s for s, c in ROWS.items() if c.get("status", "'pending'") in ("'pending'", "'claimed'")} | {
        seeds[0].step_id,
        seeds[1].step_id,
    }
    assert _sql(f"SELECT count(*), count(DISTINCT community_id) FROM {QUEUE} WHERE singleton_key IS NOT NULL") == [
        (2, 2)
    ]  # the holders that no claim touched, in both communities
    assert _sql(f"SELECT count(*) FROM {RECORD} WHERE status = 'claimed'") == [(0,)]
    assert _security(QUEUE) == _security(RECORD)  # its grants, policies and enforcement: the record's
    if CITUS_MODE:  # distributed by the community, colocated with its record (0037 on a cluster)
        placed = _sql(
            "SELECT column_to_column_name(logicalrelid, partkey), colocationid FROM pg_dist_partition"
            " WHERE logicalrelid IN (%s::regclass, %s::regclass)",
            [QUEUE, RECORD],
        )
        assert len(placed) == 2 and len(set(placed)) == 1 and placed[0][0] == "community_id", placed

    call_command("migrate", "buzz_delivery", "0036", verbosity=0)
    try:
        back = _view()
        assert sorted(_differences(before, back)) == sorted(_differences(before, after))
        record_back = _sql(f"SELECT * FROM {RECORD} ORDER BY id")
        assert len(record_back) == len(record_before)
    finally:
        _forward()
    assert _differences(after, _view()) == []


def _connect() -> psycopg.Connection:
    s = connection.settings_dict
    return psycopg.connect(
        host=s["HOST"] or None, port=s["PORT"] or None, user=s["USER"], password=s["PASSWORD"] or None,
        dbname=s["NAME"], autocommit=True,
    )  # fmt: skip


def _lock_waiters(relation: str) -> int:
    (row,) = _sql("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass(%s)", [relation])
    return row[0]


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.skipif(CITUS_MODE, reason="watches one PostgreSQL node's lock waits (pg_locks)")
def test_a_reader_of_the_view_during_the_migration_waits_for_it_and_neither_deadlocks(make_binding):
    """A reader locks the view, then the record. The migration, holding the record, re-creates the
    view: had it not locked the view first, the reader waiting for the record would hold what the
    migration needs (deadlock detected: the migration or the reader fails)."""
    DeliveryFactory(binding=make_binding())
    call_command("migrate", "buzz_delivery", "0036", verbosity=0)
    blocker, reader = _connect(), _connect()
    failures: list[BaseException] = []
    threads: list[threading.Thread] = []

    def run(work) -> threading.Thread:
        def target() -> None:
            try:
                work()
            except BaseException as exc:  # reported by the test, after the join
                failures.append(exc)
            finally:
                connections.close_all()

        thread = threading.Thread(target=target)
        thread.start()
        threads.append(thread)
        return thread

    try:
        # The migration is held up half-way (the community's trigger), the record already its.
        blocker.execute("BEGIN")
        blocker.execute("LOCK TABLE buzz_delivery_community IN ACCESS SHARE MODE")
        migration = run(lambda: call_command("migrate", "buzz_delivery", "0037", verbosity=0))
        _until(lambda: _lock_waiters("buzz_delivery_community") > 0, "the migration never reached the community")
        reading = run(lambda: reader.execute(f"SELECT count(*) FROM {VIEW}").fetchall())
        _until(lambda: _lock_waiters(RECORD) + _lock_waiters(VIEW) > 0, "the reader never waited for the migration")
        blocker.execute("ROLLBACK")
        migration.join(120)
        reading.join(120)
    finally:
        for conn in (blocker, reader):
            conn.close()
        for thread in threads:  # unblocked by the blocker's close if the test failed before its ROLLBACK
            thread.join(120)
        alive = [t for t in threads if t.is_alive()]
        migrated = _sql("SELECT to_regclass(%s)::text", [QUEUE])
        # Forward always, 0038 too: a database left at 0037 has the claim functions still writing
        # the record while the view reads the queue (every later claim test read generation 0).
        if not alive:
            _forward()
    assert not alive, "the migration or the reader never ended"
    assert not failures, failures
    assert migrated == [(QUEUE,)]


MIGRATION = importlib.import_module("buzz_delivery.migrations.0037_delivery_live_queue")
OWNER = "buzz_review_table_owner"


class _Editor:
    """What the move functions use of a schema editor: its connection and ``execute``."""

    connection = connection

    @staticmethod
    def execute(statement: str) -> None:
        _sql(statement)


def _as_forced_owner() -> None:
    """The tables owned by a role that is no superuser, enforcement on and forced (``tenant_isolation
    enable``), and the session that role: a migration run by the tables' owner, as the docs allow."""
    _sql("SET CONSTRAINTS ALL IMMEDIATE")  # no deferred key check pending on the tables altered
    _sql(f"CREATE ROLE {OWNER} NOSUPERUSER NOLOGIN")
    _sql(f"GRANT USAGE, CREATE ON SCHEMA public TO {OWNER}")
    for table in (RECORD, QUEUE):
        _sql(f"ALTER TABLE {table} OWNER TO {OWNER}")
        _sql(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY")
    _sql(f"SET LOCAL ROLE {OWNER}")


@pytest.mark.skipif(CITUS_MODE, reason="row-level security is not on Citus in this version (SPEC section 13)")
@pytest.mark.django_db(transaction=False)
def test_the_move_carries_every_live_row_under_forced_row_security(make_binding):
    delivery = DeliveryFactory(binding=make_binding())  # a record without its queue row, as 0036 left it
    _sql(f"DELETE FROM {QUEUE} WHERE community_id = %s AND id = %s", [delivery.community_id, delivery.id])
    _as_forced_owner()
    MIGRATION.move_live_rows(None, _Editor)
    _sql("RESET ROLE")
    assert _sql(
        f"SELECT status FROM {QUEUE} WHERE community_id = %s AND id = %s", [delivery.community_id, delivery.id]
    ) == [("pending",)]


@pytest.mark.skipif(CITUS_MODE, reason="row-level security is not on Citus in this version (SPEC section 13)")
@pytest.mark.django_db(transaction=False)
def test_the_move_back_carries_every_live_state_under_forced_row_security(make_binding):
    delivery = DeliveryFactory(binding=make_binding())
    key = (delivery.community_id, delivery.id)
    set_delivery_state(key, status="pending")
    set_delivery_state(
        key, status="claimed", lease_until=Expr("now() + interval '1 hour'"), claimed_at=Expr("now()"),
        attempt=1, lease_generation=1, claimed_by="w",
    )  # fmt: skip
    _as_forced_owner()
    MIGRATION.move_live_rows_back(None, _Editor)
    _sql("RESET ROLE")
    assert _sql(f"SELECT status, claimed_by FROM {RECORD} WHERE community_id = %s AND id = %s", list(key)) == [
        ("claimed", "w")
    ]

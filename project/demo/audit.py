"""The demo's audit triggers: record every status or generation change of the deliveries of
its own communities into :class:`~project.demo.models.StatusChange`, whoever makes it (the
workers, the reaper). Installed for the run and dropped afterwards, so they cost nothing outside
the demo. They only observe: they never change a delivery. A demo killed before it could drop
its triggers leaves them in place (named ``buzz_demo_audit_<run id hex>``; they still watch only
that run's communities): ``DROP TRIGGER ... ON buzz_delivery_delivery_record`` and ``... ON
buzz_delivery_delivery_queue`` remove them.

Where a change is written (issue 31, stage 2): a live delivery's state is its queue row, so a
claim, a retry back to pending and a reap back to pending are UPDATEs of the queue
(:data:`QUEUE`), seen there; a terminal deletes the queue row and moves the record
(:data:`TABLE`) from ``pending`` (a live record always says so) to its terminal status, with
the lease generation, holder, attempt and history the queue row held, plus the terminal's
history entry. The record's own old values are stale then (those of the commit or of the last
requeue), so the terminal's old status and generation are the queue row's last ones: the
history entry before the terminal's (every move of a live delivery appends one). A requeue
moves the record back to pending (and inserts a queue row: no UPDATE there), as before.

On a Citus cluster the triggers run on the shards: the audit tables are distributed by
``community_id`` with the community (:func:`distribute`), so each row is written in its
community's shard group, and the session's ``application_name`` there is Citus's own
(``citus_internal ...``): the report names the worker by the lease's ``holder`` instead.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from django.db import connection

TABLE = "buzz_delivery_delivery_record"  # the record (triggers attach to a table, not to the view)
QUEUE = "buzz_delivery_delivery_queue"  # the live state (issue 31, stage 2)


AUDIT_TABLES = ("buzz_demo_statuschange", "buzz_demo_statechange")


def distribute() -> None:
    """On a Citus cluster, distribute the audit tables by ``community_id``, colocated with the
    community (once): the audit triggers run on the shards, where they may write only their
    community's shard group (docs/scale-out.md). Nothing to do on PostgreSQL."""
    from buzz_delivery import isolation

    with connection.cursor() as cursor:
        if not isolation.is_citus(cursor):
            return
        cursor.execute(
            "SELECT logicalrelid::regclass::text FROM pg_dist_partition WHERE logicalrelid::regclass::text = ANY(%s)",
            [list(AUDIT_TABLES)],
        )
        done = {row[0] for row in cursor.fetchall()}
        for table in AUDIT_TABLES:
            if table not in done:
                cursor.execute(
                    "SELECT create_distributed_table(%s, 'community_id', colocate_with => 'buzz_delivery_community')",
                    [table],
                )


def _name(run_id: uuid.UUID) -> str:
    # One trigger and function per run, so two demos at once each keep their own record.
    return f"buzz_demo_audit_{uuid.UUID(str(run_id)).hex}"


_INSERT_CHANGE = """
INSERT INTO buzz_demo_statuschange (run_id, delivery_id, community_id, old_status, new_status, old_generation,
    new_generation, attempt, failure_code, application_name, holder, at)
VALUES ('{run}', NEW.id, NEW.community_id, was_status, NEW.status, was_generation, NEW.lease_generation,
    NEW.attempt, {failure_code}, left(current_setting('application_name'), 64), {holder}, clock_timestamp());
"""


def install(run_id: uuid.UUID, community_ids: Iterable[uuid.UUID]) -> None:
    """Create (or replace) the triggers for ``run_id`` on the record and the queue, watching
    ``community_ids`` only."""
    # DDL takes no bind parameters; uuid.UUID renders as hex and dashes only.
    ids = ",".join(str(uuid.UUID(str(c))) for c in community_ids)
    run = str(uuid.UUID(str(run_id)))
    name = _name(run_id)
    distribute()
    # The record: a terminal (pending -> finished/failed/expired; its old values from the queue
    # row's last history entry, the one before the terminal's) or a requeue (its own old values).
    record = _INSERT_CHANGE.format(
        run=run, failure_code="coalesce(NEW.failure_code, '')", holder="coalesce(NEW.claimed_by, '')"
    )
    # The queue: a claim, a retry, a reap back to pending (no failure code while live).
    queue = _INSERT_CHANGE.format(run=run, failure_code="''", holder="coalesce(NEW.claimed_by, OLD.claimed_by, '')")
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql
                SECURITY DEFINER SET search_path = pg_catalog, public AS $$
            DECLARE
                was_status text := OLD.status;
                was_generation bigint := OLD.lease_generation;
                previous jsonb;
            BEGIN
                IF NEW.community_id = ANY ('{{{ids}}}'::uuid[]) THEN
                    IF OLD.status = 'pending' AND NEW.status IN ('finished', 'failed', 'expired')
                       AND jsonb_array_length(NEW.history) >= 2 THEN
                        previous := NEW.history -> -2;
                        was_status := coalesce(previous ->> 'status', was_status);
                        was_generation := coalesce((previous ->> 'generation')::bigint, was_generation);
                    END IF;
                    {record}
                END IF;
                RETURN NULL;
            END $$
            """
        )
        cursor.execute(
            f"""
            CREATE OR REPLACE FUNCTION {name}_q() RETURNS trigger LANGUAGE plpgsql
                SECURITY DEFINER SET search_path = pg_catalog, public AS $$
            DECLARE
                was_status text := OLD.status;
                was_generation bigint := OLD.lease_generation;
            BEGIN
                IF NEW.community_id = ANY ('{{{ids}}}'::uuid[]) THEN
                    {queue}
                END IF;
                RETURN NULL;
            END $$
            """
        )
        # One statement per execute: Citus propagates DDL statement by statement.
        for table, function in ((TABLE, name), (QUEUE, f"{name}_q")):
            cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
            cursor.execute(
                f"""
                CREATE TRIGGER {name} AFTER UPDATE ON {table} FOR EACH ROW
                    WHEN (OLD.status IS DISTINCT FROM NEW.status
                          OR OLD.lease_generation IS DISTINCT FROM NEW.lease_generation)
                    EXECUTE FUNCTION {function}();
                """
            )


def remove(run_id: uuid.UUID) -> None:
    """Drop the run's triggers and functions (no-op if absent)."""
    name = _name(run_id)
    with connection.cursor() as cursor:
        for table in (TABLE, QUEUE):
            cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
        cursor.execute(f"DROP FUNCTION IF EXISTS {name}()")
        cursor.execute(f"DROP FUNCTION IF EXISTS {name}_q()")


STATE_TABLES = ("buzz_workflows_step", "buzz_agents_run", "buzz_workflows_approval")


def _state_name(run_id: uuid.UUID) -> str:
    return f"buzz_demo_states_{uuid.UUID(str(run_id)).hex}"


def install_states(run_id: uuid.UUID, community_ids: Iterable[uuid.UUID]) -> None:
    """A trigger on the engine's steps and approvals and on agent runs recording every change
    of ``state`` of ``community_ids``' rows into :class:`~project.demo.models.StateChange`. The
    table's name is the trigger's argument: on a Citus cluster the trigger fires on a shard,
    whose ``TG_TABLE_NAME`` carries the shard's suffix."""
    ids = ",".join(str(uuid.UUID(str(c))) for c in community_ids)
    run = str(uuid.UUID(str(run_id)))
    name = _state_name(run_id)
    distribute()
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql
                SECURITY DEFINER SET search_path = pg_catalog, public AS $$
            BEGIN
                IF NEW.community_id = ANY ('{{{ids}}}'::uuid[]) THEN
                    INSERT INTO buzz_demo_statechange (run_id, "table", row_id, community_id, old_state,
                        new_state, application_name, at)
                    VALUES ('{run}', TG_ARGV[0], NEW.id, NEW.community_id, OLD.state, NEW.state,
                        left(current_setting('application_name'), 64), clock_timestamp());
                END IF;
                RETURN NULL;
            END $$
            """
        )
        for table in STATE_TABLES:
            cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
            cursor.execute(
                f"CREATE TRIGGER {name} AFTER UPDATE ON {table} FOR EACH ROW "
                f"WHEN (OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION {name}('{table}')"
            )


def remove_states(run_id: uuid.UUID) -> None:
    name = _state_name(run_id)
    with connection.cursor() as cursor:
        for table in STATE_TABLES:
            cursor.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
        cursor.execute(f"DROP FUNCTION IF EXISTS {name}()")

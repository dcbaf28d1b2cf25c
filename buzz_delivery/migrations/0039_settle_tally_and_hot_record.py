"""The record's terminal UPDATE becomes a HOT update (issue 31; bench/results/hot-record.md), and the
settle rate gets a source of its own: the settle tally.

``buzz_delivery_settle_tally`` (model ``SettleTally``): one row per statement, community and
terminal status that statement reached, ``n`` the records it moved there from a live status, ``at``
the database clock (``buzz_delivery_now()``). Written by one AFTER UPDATE statement trigger on the
record with transition tables, ``buzz_delivery_settle_tally``: every terminal path (batch and single
settles, the reaper's exhaustion, TTL and run expiry, force-fail, supersede) is a record UPDATE, and
no statement inserts a terminal record. The function reads the transition tables first, then
inserts one VALUES row per (community, status), each naming its community: on Citus the trigger
fires on the shard (``citus.enable_unsafe_triggers``) and a statement that joined the transition
tables to a distributed table would not plan there ("could not find named tuplestore"). Its
primary key is ``(community_id, at, id)`` (the readers' probe; Citus's rule); its community is no
database foreign key (a settle would take a KEY SHARE lock on the community's row). Its row-level
security and grants are the record's (``secure_like_the_record``, core 0037); it is in the deletion
catalog (purged with its community; ``distribute_tables`` colocates it) and the tombstone guard.

Core 0040 swaps the record's index, ``CONCURRENTLY`` (outside a transaction): the record loses
``delivery_terminal_age_idx`` (``(community_id, finished_at) WHERE status IN terminal``), the last
index naming a column the terminal writes but the failure code's; the pruner walks
``delivery_community_created_idx (community_id, created_at)`` instead (a terminal's
``finished_at`` never precedes its ``created_at``). The record's ``fillfactor`` becomes
``DELIVERY_RECORD_FILLFACTOR`` (30): the terminal version fits on the committed row's page (pages
written from now on; a ``VACUUM FULL`` or ``pg_repack`` applies it to the old ones).

Backwards: the trigger, its function and the tally go, the fillfactor reset (0040 puts the index
back). On Citus run ``distribute_tables`` after ``migrate`` as always; on a coordinator whose record
is already distributed, the tally is distributed here (as core 0037 does the queue)."""

import importlib
from typing import Any

import django.contrib.postgres.functions
import django.db.models.deletion
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

from buzz_delivery.citus_ddl import OneStatementAtATime

_0037 = importlib.import_module("buzz_delivery.migrations.0037_delivery_live_queue")

RECORD = "buzz_delivery_delivery_record"
TALLY = "buzz_delivery_settle_tally"

TALLY_PRIMARY_KEY = [
    f"ALTER TABLE {TALLY} DROP CONSTRAINT {TALLY}_pkey",
    f"ALTER TABLE {TALLY} ADD CONSTRAINT {TALLY}_pkey PRIMARY KEY (community_id, at, id)",
]


def key_the_tally(apps: Any, schema_editor: Any) -> None:
    """The tally's primary key, and on a Citus coordinator whose record is distributed, the tally
    distributed and colocated with it (what ``distribute_tables`` would do)."""
    for statement in TALLY_PRIMARY_KEY:
        schema_editor.execute(statement)
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')")
        if not cursor.fetchone()[0]:
            return
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = to_regclass(%s))", [RECORD])
        if cursor.fetchone()[0]:
            cursor.execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
            cursor.execute(
                "SELECT create_distributed_table(%s, 'community_id', colocate_with => 'buzz_delivery_community')",
                [TALLY],
            )


def secure_the_tally(apps: Any, schema_editor: Any) -> None:
    _0037.secure_like_the_record(schema_editor, TALLY)


# The statuses a record moves to from a live one (its status is 'pending' while live, core 0037).
TERMINAL = "('finished', 'failed', 'expired')"
TALLY_FUNCTION = f"""
CREATE FUNCTION buzz_delivery_tally_settles() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    settled record;
BEGIN
    FOR settled IN
        SELECT n.community_id, n.status, count(*)::integer AS moved
        FROM buzz_delivery_settled_new AS n
        JOIN buzz_delivery_settled_old AS o ON o.community_id = n.community_id AND o.id = n.id
        WHERE n.status IN {TERMINAL} AND o.status NOT IN {TERMINAL}
        GROUP BY n.community_id, n.status
    LOOP
        INSERT INTO {TALLY} (community_id, at, status, n)
        VALUES (settled.community_id, buzz_delivery_now(), settled.status, settled.moved);
    END LOOP;
    RETURN NULL;
END
$$
"""
TALLY_TRIGGER = f"""
CREATE TRIGGER buzz_delivery_settle_tally AFTER UPDATE ON {RECORD}
REFERENCING OLD TABLE AS buzz_delivery_settled_old NEW TABLE AS buzz_delivery_settled_new
FOR EACH STATEMENT EXECUTE FUNCTION buzz_delivery_tally_settles()
"""
DROP_TALLY_TRIGGER = f"DROP TRIGGER buzz_delivery_settle_tally ON {RECORD}"
DROP_TALLY_FUNCTION = "DROP FUNCTION buzz_delivery_tally_settles()"


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0038_delivery_queue_functions")]

    operations = [
        migrations.CreateModel(
            name="SettleTally",
            fields=[
                (
                    "id",
                    models.UUIDField(
                        db_default=django.contrib.postgres.functions.RandomUUID(),
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("at", models.DateTimeField()),
                (
                    "status",
                    models.CharField(
                        choices=[("finished", "Finished"), ("failed", "Failed"), ("expired", "Expired")], max_length=16
                    ),
                ),
                ("n", models.IntegerField()),
                # In the table itself (not AddField): backwards the table is dropped whole, never
                # its distribution column alone (Citus refuses that; as core 0037's queue).
                (
                    "community",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="buzz_delivery.community",
                    ),
                ),
            ],
            options={
                "verbose_name": "settle tally",
                "verbose_name_plural": "settle tallies",
                "db_table": "buzz_delivery_settle_tally",
                "default_permissions": (),
            },
        ),
        migrations.AddConstraint(
            model_name="settletally",
            constraint=models.CheckConstraint(
                condition=models.Q(("status__in", ["finished", "failed", "expired"])),
                name="settle_tally_status_terminal",
            ),
        ),
        migrations.AddConstraint(
            model_name="settletally",
            constraint=models.CheckConstraint(condition=models.Q(("n__gt", 0)), name="settle_tally_n_positive"),
        ),
        migrations.RunPython(key_the_tally, migrations.RunPython.noop, elidable=False),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="settletally",
                trigger=pgtrigger.compiler.Trigger(
                    name="community_write_fence",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)",
                        execute="buzz_delivery_write_fence_row()",
                        func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ",
                        hash="e27b2a3fbc98407b06162f73b840c6122cd7fd88",
                        operation="INSERT OR UPDATE",
                        pgid="pgtrigger_community_write_fence_6d0b4",
                        table="buzz_delivery_settle_tally",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="settletally",
                trigger=pgtrigger.compiler.Trigger(
                    name="community_write_fence_delete",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)",
                        execute="buzz_delivery_write_fence_row()",
                        func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ",
                        hash="0446c484d0a92762a4959a837d9c05cbde4dbd15",
                        operation="DELETE",
                        pgid="pgtrigger_community_write_fence_delete_f8ee6",
                        table="buzz_delivery_settle_tally",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="settletally",
                trigger=pgtrigger.compiler.Trigger(
                    name="community_write_fence_move",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        condition="WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)",
                        execute="buzz_delivery_write_fence_row()",
                        func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ",
                        hash="da1b030017b20e690ed138204b1cabb0cf64d56c",
                        operation='UPDATE OF "community_id"',
                        pgid="pgtrigger_community_write_fence_move_5c9f5",
                        table="buzz_delivery_settle_tally",
                        when="BEFORE",
                    ),
                ),
            )
        ),
        migrations.RunPython(secure_the_tally, migrations.RunPython.noop, elidable=False),
        migrations.RunSQL(sql=TALLY_FUNCTION, reverse_sql=DROP_TALLY_FUNCTION),
        migrations.RunSQL(sql=TALLY_TRIGGER, reverse_sql=DROP_TALLY_TRIGGER),
        migrations.RunSQL(
            sql=f"ALTER TABLE {RECORD} SET (fillfactor = 30)",  # models.DELIVERY_RECORD_FILLFACTOR, as of 0039
            reverse_sql=f"ALTER TABLE {RECORD} RESET (fillfactor)",
        ),
        OneStatementAtATime(
            pgtrigger.migrations.RemoveTrigger(
                model_name="community",
                name="community_lifecycle_forward_only",
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name="community",
                trigger=pgtrigger.compiler.Trigger(
                    name="community_lifecycle_forward_only",
                    sql=pgtrigger.compiler.UpsertTriggerSql(
                        declare="DECLARE old_rank int; new_rank int;",
                        func="\n            IF NEW.id IS DISTINCT FROM OLD.id THEN\n                RAISE EXCEPTION USING ERRCODE = 'BD002',\n                    MESSAGE = 'buzz_delivery: a community id never changes';\n            END IF;\n            IF NEW.deletion_state IS DISTINCT FROM OLD.deletion_state THEN\n                -- The write fence's other side: writers hold this lock shared until they\n                -- commit; taken here, on the node that owns the community row, it waits for\n                -- them and queues later writers behind this move (SPEC sections 5, 15).\n                PERFORM pg_advisory_xact_lock(1111752705, hashtext(OLD.id::text));\n                -- This transaction's writers judge the community again from now on.\n                PERFORM set_config('buzz_delivery.fence_passed', '', true);\n                old_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], OLD.deletion_state);\n                new_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], NEW.deletion_state);\n                IF new_rank IS DISTINCT FROM old_rank + 1 THEN\n                    RAISE EXCEPTION USING ERRCODE = 'BD002',\n                        MESSAGE = format('buzz_delivery: community %s cannot move from %s to %s '\n                                         '(states move forward one step at a time)',\n                                         OLD.id, OLD.deletion_state, NEW.deletion_state);\n                END IF;\n                IF NEW.deletion_state = 'tombstone' AND (EXISTS (SELECT 1 FROM buzz_delivery_settle_tally WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_rate_limit WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_delivery_queue WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_delivery_record WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_workflow_run WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_event WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_workflow WHERE community_id = OLD.id)) THEN\n                    RAISE EXCEPTION USING ERRCODE = 'BD002',\n                        MESSAGE = format('buzz_delivery: community %s still holds rows; '\n                                         'purge it before it becomes tombstone', OLD.id);\n                END IF;\n                NEW.fence_generation := OLD.fence_generation + 1;\n                NEW.state_changed_at := now();\n            ELSIF NEW.fence_generation IS DISTINCT FROM OLD.fence_generation THEN\n                RAISE EXCEPTION USING ERRCODE = 'BD002',\n                    MESSAGE = 'buzz_delivery: fence_generation changes only with a lifecycle move';\n            END IF;\n            RETURN NEW;\n        ",
                        hash="2f08661d4f90e2e47eb5d5e8a45533c0764b8c7c",
                        operation="UPDATE",
                        pgid="pgtrigger_community_lifecycle_forward_only_9a308",
                        table="buzz_delivery_community",
                        when="BEFORE",
                    ),
                ),
            )
        ),
    ]

"""The live state of a delivery moves to a narrow queue table whose claim is a HOT update (issue 31,
stage 2; ``bench/results/queue-design-plan.md``, whose "Since (stop 55)" paragraph lists where the build differs from the plan).

``buzz_delivery_delivery_queue`` (model ``DeliveryQueue``) holds one row per live delivery (pending
or claimed), deleted at the terminal: the binding columns the claim and the admin need (target,
workflow, priority, created_at, max_attempts) and the live state (status, lease, attempt, policy,
history, slots, the pending holder's singleton key). Its primary key is ``(id, community_id)``, a
foreign key ``(community_id, id)`` references the record's primary key ON DELETE CASCADE (a pruned
or purged record takes its queue row), and ``fillfactor = 30`` keeps room in each page for the new
version of a claimed, renewed or retried row. None of its indexes names a column those write (no
status predicate: the slot keys are partial on the slot being set, the singleton key on the key),
so they are HOT updates. Its triggers are the record's write fence, generation guard and history
guard, and its own binding guard (its key, target and workflow never change: a claim selects by
them, the view shows the record's); its row-level security policies and grants are the record's.

The record keeps every column and loses its status-partial live indexes (poll, pending age,
claimed lease, pending expiry, the slot keys, the singleton key). Its ``status`` is ``'pending'``
for every live delivery from now on: the move below inserts a queue row for each pending or
claimed record with its live state, then turns the claimed records to pending (lease and slots
cleared, as the record's CHECKs want; their generation, attempt, holder and history stay as they
were: while live, the record's state columns are not maintained). Neither the workflows' fan-in
nor the agents' delivery-lost trigger fires on that move (no terminal is reached). The record's
history guard lets the statement that makes it terminal write the queue row's history plus its
entry over the record's stale copy, which that history extends (``triggers.history_append_only``,
``terminal_extends``); any other statement still appends one entry; the queue row's history is
guarded while live.

The view ``buzz_delivery_delivery`` becomes ``record LEFT JOIN queue`` (``security_invoker``,
the same columns in the same order: ``CREATE OR REPLACE VIEW`` keeps its grants): a live column is
the queue row's when there is one, else the record's.

Locks: one transaction. The view and the record are locked ACCESS EXCLUSIVE first, either way,
in the order a reader of the view takes them (the record's indexes are dropped, its claimed rows
updated, the view re-created): readers and writers wait for the migration, which reads and writes every
live row once. Workers must be stopped for it anyway: the plan-cached functions are re-created by
0038 (until then they still write the record). The write fence is switched off on the record for
the move (its row triggers would refuse the rows of a community that is not ``active``, which the
move must carry too); the queue's triggers are installed after the move. Row-level security forced on the record
(``tenant_isolation enable``) is lifted for the move, either way, and forced again: it holds the
tables' owner too, and an owner that is no superuser would move no row, silently.

Backwards: each queue row's live state is copied back into its record (the record's fence and
history guard switched off for that one statement: the queue's history is longer than the
record's), then the queue is dropped and the record's indexes built again.

On Citus run ``distribute_tables`` after ``migrate``, as always: the queue is in the deletion
catalog, so it is distributed by ``community_id`` and colocated with the record there. On a
cluster whose record is already distributed, this migration distributes the queue itself before
it references the record (a local table cannot reference a distributed one)."""

import datetime
from typing import Any

import django.db.models.deletion
import django.db.models.functions.text
import django.db.models.lookups
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

from buzz_delivery import isolation
from buzz_delivery.citus_ddl import OneStatementAtATime

RECORD = "buzz_delivery_delivery_record"
QUEUE = "buzz_delivery_delivery_queue"
VIEW = "buzz_delivery_delivery"

# The view first, then the record, in the order a reader of the view takes them (the view's
# rewrite locks the view, then its tables): a reader that arrived after the record was locked
# holds the view while it waits for the record, and the migration, which re-creates the view
# at its end, would wait for that reader (deadlock; tests/test_delivery_queue_migration_review.py).
LOCK_RECORD = f"LOCK TABLE {VIEW}, {RECORD} IN ACCESS EXCLUSIVE MODE"

# One statement each (Citus propagates DDL with its text: citus_ddl).
QUEUE_PRIMARY_KEY = [
    f"ALTER TABLE {QUEUE} DROP CONSTRAINT {QUEUE}_pkey",
    f"ALTER TABLE {QUEUE} ADD CONSTRAINT {QUEUE}_pkey PRIMARY KEY (id, community_id)",
]
QUEUE_RECORD_KEY = [
    f"ALTER TABLE {QUEUE} ADD CONSTRAINT delivery_queue_record_same_community"
    f" FOREIGN KEY (community_id, id) REFERENCES {RECORD} (community_id, id) ON DELETE CASCADE",
    f"ALTER TABLE {QUEUE} SET (fillfactor = 30)",
]
# On a Citus coordinator whose record is already distributed (a cluster migrated again: tests go
# back and forth), the queue is distributed and colocated at once, as ``distribute_tables`` would:
# a local table cannot reference a distributed one. Its foreign key to the community (Django's,
# added at the end of the migration) and to the record follow.


def key_the_queue(apps: Any, schema_editor: Any) -> None:
    for statement in QUEUE_PRIMARY_KEY:
        schema_editor.execute(statement)
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')")
        citus = cursor.fetchone()[0]
        if citus:
            cursor.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = to_regclass(%s))", [RECORD]
            )
            if cursor.fetchone()[0]:
                cursor.execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
                cursor.execute(
                    "SELECT create_distributed_table(%s, 'community_id', colocate_with => 'buzz_delivery_community')",
                    [QUEUE],
                )
    for statement in QUEUE_RECORD_KEY:
        schema_editor.execute(statement)

# The columns a queue row copies from its record at commit (never changed), then its live state.
BINDING = ("id", "community_id", "target_pubkey", "workflow_id", "priority", "created_at", "max_attempts")
LIVE = (
    "status",
    "lease_generation",
    "lease_until",
    "claimed_at",
    "claimed_by",
    "renewals",
    "attempt",
    "next_attempt_at",
    "expires_at",
    "history",
    "slot_community",
    "slot_target",
    "slot_workflow",
)

# The record's slots counted only while claimed (its keys were partial on the status), its
# singleton key only for the pending holder no claim touched (generation 0): the queue's keys are
# partial on the column alone, so a stale value is not carried over.
INSERT_LIVE_ROWS = (
    f"INSERT INTO {QUEUE} ({', '.join(BINDING + LIVE)}, singleton_key)"
    f" SELECT {', '.join(BINDING)}, {', '.join(c for c in LIVE if not c.startswith('slot_'))},"
    " CASE WHEN status = 'claimed' THEN slot_community END,"
    " CASE WHEN status = 'claimed' THEN slot_target END,"
    " CASE WHEN status = 'claimed' THEN slot_workflow END,"
    " CASE WHEN status = 'pending' AND lease_generation = 0 THEN singleton_key END"
    f" FROM {RECORD} WHERE status IN ('pending', 'claimed')"
)
CLAIMED_RECORDS_PENDING = (
    f"UPDATE {RECORD} SET status = 'pending', lease_until = NULL, claimed_at = NULL,"
    " slot_community = NULL, slot_target = NULL, slot_workflow = NULL"
    " WHERE status = 'claimed'"
)
COPY_LIVE_STATE_BACK = (
    f"UPDATE {RECORD} AS r SET {', '.join(f'{c} = q.{c}' for c in LIVE)}"
    f" FROM {QUEUE} AS q WHERE q.community_id = r.community_id AND q.id = r.id"
)
# The record's row triggers switched off for the move (module docstring): the write fence (its
# INSERT OR UPDATE trigger), and backwards the history guard too.
RECORD_FENCE = "pgtrigger_community_write_fence_cc965"
RECORD_HISTORY_GUARD = "pgtrigger_delivery_history_append_only_27347"


# Row-level security forced on a table (``tenant_isolation enable``) holds its owner too: a
# migration run by the owner, not a superuser, would move no row at all (no policy names the
# owner), silently. Lifted for the move on the tables it reads and writes, then forced again.
FORCED = "SELECT relforcerowsecurity FROM pg_class WHERE oid = to_regclass(%s)"


def _with_triggers_off(
    schema_editor: Any, names: tuple[str, ...], statements: list[str], tables: tuple[str, ...]
) -> None:
    forced = []
    with schema_editor.connection.cursor() as cursor:
        for table in tables:
            cursor.execute(FORCED, [table])
            row = cursor.fetchone()
            if row and row[0]:
                forced.append(table)
    for table in forced:
        schema_editor.execute(f"ALTER TABLE {table} NO FORCE ROW LEVEL SECURITY")
    for name in names:
        schema_editor.execute(f"ALTER TABLE {RECORD} DISABLE TRIGGER {name}")
    for statement in statements:
        schema_editor.execute(statement)
    for name in names:
        schema_editor.execute(f"ALTER TABLE {RECORD} ENABLE TRIGGER {name}")
    for table in forced:
        schema_editor.execute(f"ALTER TABLE {table} FORCE ROW LEVEL SECURITY")


def move_live_rows(apps: Any, schema_editor: Any) -> None:
    """A queue row for every pending or claimed record; the claimed records become pending."""
    _with_triggers_off(schema_editor, (RECORD_FENCE,), [INSERT_LIVE_ROWS, CLAIMED_RECORDS_PENDING], (RECORD, QUEUE))


def move_live_rows_back(apps: Any, schema_editor: Any) -> None:
    """Each queue row's live state back into its record (the queue is dropped after)."""
    _with_triggers_off(
        schema_editor, (RECORD_FENCE, RECORD_HISTORY_GUARD), [COPY_LIVE_STATE_BACK], (RECORD, QUEUE)
    )


# Every privilege on the record that a role other than its owner holds (the two roles of
# buzz_delivery.isolation, an operator's reporting role, PUBLIC): the queue gets the same.
RECORD_GRANTS = """
SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END,
       string_agg(DISTINCT a.privilege_type, ', ')
FROM pg_class AS c
CROSS JOIN LATERAL aclexplode(c.relacl) AS a
LEFT JOIN pg_roles AS r ON r.oid = a.grantee
WHERE c.oid = to_regclass('buzz_delivery_delivery_record') AND a.grantee <> c.relowner
GROUP BY 1
ORDER BY 1
"""
RECORD_RLS = (
    "SELECT relrowsecurity, relforcerowsecurity FROM pg_class WHERE oid = to_regclass('buzz_delivery_delivery_record')"
)


def secure_like_the_record(schema_editor: Any, table: str) -> None:
    """``table``'s row-level security as the record's: the record's grants, the two policies of
    :mod:`buzz_delivery.isolation` (where its roles exist), and enforcement switched on and forced
    when it is on the record (core 0039 secures the settle tally with it too)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(RECORD_GRANTS)
        for grantee, privileges in cursor.fetchall():
            cursor.execute(f"GRANT {privileges} ON {table} TO {grantee}")
        if not isolation._missing_roles(cursor, isolation.roles()):
            for statement in isolation.policy_sql([(table, "community_id")], isolation.roles()):
                cursor.execute(statement)
        cursor.execute(RECORD_RLS)
        enabled, forced = cursor.fetchone()
        if enabled:
            cursor.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        if forced:
            cursor.execute(f"ALTER TABLE {table} FORCE ROW LEVEL SECURITY")


def secure_the_queue(apps: Any, schema_editor: Any) -> None:
    """The queue's row-level security as the record's. Backwards nothing: the queue is dropped."""
    secure_like_the_record(schema_editor, QUEUE)


# The view's columns, in 0034's order (CREATE OR REPLACE VIEW keeps them and the view's grants).
COLUMNS = (
    "id, step_id, target_pubkey, definition_event_id, message_event_id, cause_kind, cause_event_id,"
    " cause_scheduled_for, cause_webhook_invocation_id, status, lease_generation, lease_until, claimed_at,"
    " finished_at, created_at, attempt, max_attempts, next_attempt_at, expires_at, failure_code,"
    " failure_message, execution_trace, trigger_context, community_id, workflow_id, run_id, claimed_by,"
    " history, renewals, priority, slot_community, slot_target, slot_workflow, singleton_key, requeues"
).split(", ")


def _view_column(column: str) -> str:
    if column in LIVE:
        return f"CASE WHEN q.id IS NOT NULL THEN q.{column} ELSE r.{column} END AS {column}"
    return f"r.{column}"


VIEW_WITH_QUEUE = (
    f"CREATE OR REPLACE VIEW {VIEW} WITH (security_invoker = true) AS"
    f" SELECT {', '.join(_view_column(c) for c in COLUMNS)}"
    f" FROM {RECORD} AS r LEFT JOIN {QUEUE} AS q ON q.community_id = r.community_id AND q.id = r.id"
)
VIEW_OF_RECORD = (
    f"CREATE OR REPLACE VIEW {VIEW} WITH (security_invoker = true) AS SELECT {', '.join(COLUMNS)} FROM {RECORD}"
)


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0036_delivery_one_key_to_its_run")]

    operations = [
        migrations.RunSQL(sql=LOCK_RECORD, reverse_sql=migrations.RunSQL.noop),
        migrations.CreateModel(
            name='DeliveryQueue',
            fields=[
                ('id', models.UUIDField(editable=False, primary_key=True, serialize=False)),
                ('target_pubkey', models.BinaryField(max_length=32)),
                ('priority', models.SmallIntegerField(db_default=0, default=0)),
                ('created_at', models.DateTimeField()),
                ('max_attempts', models.IntegerField(blank=True, null=True)),
                ('status', models.CharField(choices=[('pending', 'Pending'), ('claimed', 'Claimed'), ('finished', 'Finished'), ('failed', 'Failed'), ('expired', 'Expired')], db_default='pending', default='pending', max_length=16)),
                ('lease_generation', models.BigIntegerField(db_default=0, default=0)),
                ('lease_until', models.DateTimeField(blank=True, null=True)),
                ('claimed_at', models.DateTimeField(blank=True, null=True)),
                ('claimed_by', models.TextField(blank=True, null=True)),
                ('renewals', models.IntegerField(db_default=0, default=0)),
                ('attempt', models.IntegerField(db_default=0, default=0)),
                ('next_attempt_at', models.DateTimeField(blank=True, null=True)),
                ('expires_at', models.DateTimeField(blank=True, null=True)),
                ('history', models.JSONField(blank=True, db_default=models.Value([], output_field=models.JSONField()), default=list)),
                ('slot_community', models.SmallIntegerField(blank=True, editable=False, null=True)),
                ('slot_target', models.SmallIntegerField(blank=True, editable=False, null=True)),
                ('slot_workflow', models.SmallIntegerField(blank=True, editable=False, null=True)),
                ('singleton_key', models.CharField(blank=True, editable=False, max_length=64, null=True)),
                # In the table itself (not AddField): backwards the table is dropped whole, never
                # its distribution column alone (Citus refuses that).
                ('community', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, to='buzz_delivery.community')),
                ('workflow', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='buzz_delivery.workflow')),
            ],
            options={
                'verbose_name': 'delivery queue row',
                'verbose_name_plural': 'delivery queue',
                'db_table': 'buzz_delivery_delivery_queue',
                'default_permissions': (),
            },
        ),
        migrations.RunPython(key_the_queue, migrations.RunPython.noop, elidable=False),
        # The record's live indexes go before the move (its UPDATE of the claimed rows maintains
        # none of them) and come back after the move back.
        migrations.RemoveConstraint(
            model_name='deliveryrecord',
            name='delivery_singleton_pending_key',
        ),
        migrations.RemoveConstraint(
            model_name='deliveryrecord',
            name='delivery_slot_community_key',
        ),
        migrations.RemoveConstraint(
            model_name='deliveryrecord',
            name='delivery_slot_target_key',
        ),
        migrations.RemoveConstraint(
            model_name='deliveryrecord',
            name='delivery_slot_workflow_key',
        ),
        migrations.RemoveIndex(
            model_name='deliveryrecord',
            name='delivery_pending_poll_idx',
        ),
        migrations.RemoveIndex(
            model_name='deliveryrecord',
            name='delivery_pending_age_idx',
        ),
        migrations.RemoveIndex(
            model_name='deliveryrecord',
            name='delivery_claimed_lease_idx',
        ),
        migrations.RemoveIndex(
            model_name='deliveryrecord',
            name='delivery_pending_expiry_idx',
        ),
        migrations.RunPython(move_live_rows, move_live_rows_back, elidable=False),
        migrations.AddIndex(
            model_name='deliveryqueue',
            index=models.Index(fields=['community', 'target_pubkey', '-priority', 'created_at', 'id'], name='delivery_queue_poll_idx'),
        ),
        migrations.AddIndex(
            model_name='deliveryqueue',
            index=models.Index(condition=models.Q(('created_at__gt', datetime.datetime(1970, 1, 1, 0, 0, tzinfo=datetime.timezone.utc))), fields=['created_at', 'id'], name='delivery_queue_created_idx'),
        ),
        migrations.AddIndex(
            model_name='deliveryqueue',
            index=models.Index(condition=models.Q(('expires_at__isnull', False)), fields=['community', 'expires_at'], name='delivery_queue_expiry_idx'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('status__in', ['pending', 'claimed'])), name='delivery_queue_status_live'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('claimed_at__isnull', False), ('lease_until__isnull', False), ('status', 'claimed')), models.Q(models.Q(('status', 'claimed'), _negated=True), ('claimed_at__isnull', True), ('lease_until__isnull', True)), _connector='OR'), name='delivery_queue_claimed_iff_lease'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=django.db.models.lookups.Exact(django.db.models.functions.text.Length('target_pubkey'), 32), name='delivery_queue_target_pubkey_32_bytes'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('lease_generation__gte', 0)), name='delivery_queue_lease_generation_gte_0'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('attempt__gte', 0)), name='delivery_queue_attempt_gte_0'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('max_attempts__isnull', True), models.Q(('attempt__lte', models.F('max_attempts')), ('max_attempts__gte', 1)), _connector='OR'), name='delivery_queue_attempt_within_max'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('status', 'claimed'), _negated=True), ('attempt__gte', 1), _connector='OR'), name='delivery_queue_claimed_has_attempt'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('claimed_by__isnull', True), django.db.models.lookups.LessThanOrEqual(django.db.models.functions.text.Length('claimed_by'), 200), _connector='OR'), name='delivery_queue_claimed_by_length'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('renewals__gte', 0)), name='delivery_queue_renewals_gte_0'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(django.db.models.lookups.Exact(models.Func(models.F('history'), function='jsonb_typeof', output_field=models.TextField()), 'array'), django.db.models.lookups.LessThanOrEqual(models.Func(models.F('history'), function='jsonb_array_length', output_field=models.IntegerField()), 50)), name='delivery_queue_history_bounded'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('priority__gte', -10), ('priority__lte', 10)), name='delivery_queue_priority_range'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('slot_community__isnull', True), models.Q(('slot_community__gte', 0), ('slot_community__lt', 1000)), _connector='OR'), name='delivery_queue_slot_community_range'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('slot_target__isnull', True), models.Q(('slot_target__gte', 0), ('slot_target__lt', 1000)), _connector='OR'), name='delivery_queue_slot_target_range'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('slot_workflow__isnull', True), models.Q(('slot_workflow__gte', 0), ('slot_workflow__lt', 1000)), _connector='OR'), name='delivery_queue_slot_workflow_range'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.CheckConstraint(condition=models.Q(('singleton_key__isnull', True), ('singleton_key__regex', '^[A-Za-z0-9_.:-]{1,64}$'), _connector='OR'), name='delivery_queue_singleton_key_format'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.UniqueConstraint(condition=models.Q(('singleton_key__isnull', False)), fields=('community', 'target_pubkey', 'singleton_key'), name='delivery_queue_singleton_key'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.UniqueConstraint(condition=models.Q(('slot_community__isnull', False)), fields=('community', 'slot_community'), name='delivery_queue_slot_community_key'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.UniqueConstraint(condition=models.Q(('slot_target__isnull', False)), fields=('community', 'target_pubkey', 'slot_target'), name='delivery_queue_slot_target_key'),
        ),
        migrations.AddConstraint(
            model_name='deliveryqueue',
            constraint=models.UniqueConstraint(condition=models.Q(('slot_workflow__isnull', False)), fields=('community', 'workflow', 'slot_workflow'), name='delivery_queue_slot_workflow_key'),
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name='deliveryqueue',
                trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='424445a77d4803f2725af7e5c5d758da98fcbd5f', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_758b4', table='buzz_delivery_delivery_queue', when='BEFORE')),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name='deliveryqueue',
                trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='1400b488f576b042794a9df3acca3a0af7220e3c', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_0f486', table='buzz_delivery_delivery_queue', when='BEFORE')),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name='deliveryqueue',
                trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='5a98d05ec1703fdefa0a783ff57f814e5067b353', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_9fece', table='buzz_delivery_delivery_queue', when='BEFORE')),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name='deliveryqueue',
                trigger=pgtrigger.compiler.Trigger(name='delivery_queue_binding_immutable', sql=pgtrigger.compiler.UpsertTriggerSql(func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: delivery %s: its binding and snapshots never '\n                                 'change; state changes go through buzz_delivery.services', OLD.id);\n        ", hash='80c39f7819d38fa30f7e041d80e93bd088095d6e', operation='UPDATE OF "id", "community_id", "target_pubkey", "workflow_id"', pgid='pgtrigger_delivery_queue_binding_immutable_b92d3', table='buzz_delivery_delivery_queue', when='BEFORE')),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name='deliveryqueue',
                trigger=pgtrigger.compiler.Trigger(name='delivery_generation_monotonic', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (NEW.lease_generation < OLD.lease_generation)', func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: delivery %s: lease_generation cannot go back from %s to %s',\n                                 OLD.id, OLD.lease_generation, NEW.lease_generation);\n        ", hash='04e02757f6630b00d8999ca170c941e94d1394a8', operation='UPDATE', pgid='pgtrigger_delivery_generation_monotonic_8a0d4', table='buzz_delivery_delivery_queue', when='BEFORE')),
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name='deliveryqueue',
                trigger=pgtrigger.compiler.Trigger(name='delivery_queue_history_append_only', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (NEW.history IS DISTINCT FROM OLD.history AND NOT ((NEW.history - (-1)) = OLD.history OR (jsonb_array_length(OLD.history) >= 50 AND (NEW.history - (-1)) = (OLD.history - 0))))', func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: %s %s: its history only grows by one entry per '\n                                 'statement; past entries are never rewritten', TG_TABLE_NAME, OLD.id);\n        ", hash='a81309c3050ed9c5ac27b438e3189b46c8be7258', operation='UPDATE OF "history"', pgid='pgtrigger_delivery_queue_history_append_only_1d253', table='buzz_delivery_delivery_queue', when='BEFORE')),
            )
        ),

        OneStatementAtATime(
            pgtrigger.migrations.RemoveTrigger(
                model_name='community',
                name='community_lifecycle_forward_only',
            )
        ),

        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name='community',
                trigger=pgtrigger.compiler.Trigger(name='community_lifecycle_forward_only', sql=pgtrigger.compiler.UpsertTriggerSql(declare='DECLARE old_rank int; new_rank int;', func="\n            IF NEW.id IS DISTINCT FROM OLD.id THEN\n                RAISE EXCEPTION USING ERRCODE = 'BD002',\n                    MESSAGE = 'buzz_delivery: a community id never changes';\n            END IF;\n            IF NEW.deletion_state IS DISTINCT FROM OLD.deletion_state THEN\n                -- The write fence's other side: writers hold this lock shared until they\n                -- commit; taken here, on the node that owns the community row, it waits for\n                -- them and queues later writers behind this move (SPEC sections 5, 15).\n                PERFORM pg_advisory_xact_lock(1111752705, hashtext(OLD.id::text));\n                -- This transaction's writers judge the community again from now on.\n                PERFORM set_config('buzz_delivery.fence_passed', '', true);\n                old_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], OLD.deletion_state);\n                new_rank := array_position(ARRAY['active','quiescing','fenced','tombstone'], NEW.deletion_state);\n                IF new_rank IS DISTINCT FROM old_rank + 1 THEN\n                    RAISE EXCEPTION USING ERRCODE = 'BD002',\n                        MESSAGE = format('buzz_delivery: community %s cannot move from %s to %s '\n                                         '(states move forward one step at a time)',\n                                         OLD.id, OLD.deletion_state, NEW.deletion_state);\n                END IF;\n                IF NEW.deletion_state = 'tombstone' AND (EXISTS (SELECT 1 FROM buzz_delivery_rate_limit WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_delivery_queue WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_delivery_record WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_workflow_run WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_event WHERE community_id = OLD.id) OR EXISTS (SELECT 1 FROM buzz_delivery_workflow WHERE community_id = OLD.id)) THEN\n                    RAISE EXCEPTION USING ERRCODE = 'BD002',\n                        MESSAGE = format('buzz_delivery: community %s still holds rows; '\n                                         'purge it before it becomes tombstone', OLD.id);\n                END IF;\n                NEW.fence_generation := OLD.fence_generation + 1;\n                NEW.state_changed_at := now();\n            ELSIF NEW.fence_generation IS DISTINCT FROM OLD.fence_generation THEN\n                RAISE EXCEPTION USING ERRCODE = 'BD002',\n                    MESSAGE = 'buzz_delivery: fence_generation changes only with a lifecycle move';\n            END IF;\n            RETURN NEW;\n        ", hash='f247368d6285cd2cb0127a9912ebe180575884aa', operation='UPDATE', pgid='pgtrigger_community_lifecycle_forward_only_9a308', table='buzz_delivery_community', when='BEFORE')),
            )
        ),

        # The record's history guard: the terminal may write the queue row's history plus its entry
        # over the record's copy, which it extends (triggers.history_append_only, terminal_extends).
        OneStatementAtATime(
            pgtrigger.migrations.RemoveTrigger(
                model_name='deliveryrecord',
                name='delivery_history_append_only',
            )
        ),
        OneStatementAtATime(
            pgtrigger.migrations.AddTrigger(
                model_name='deliveryrecord',
                trigger=pgtrigger.compiler.Trigger(name='delivery_history_append_only', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (NEW.history IS DISTINCT FROM OLD.history AND NOT ((NEW.history - (-1)) = OLD.history OR (jsonb_array_length(OLD.history) >= 50 AND (NEW.history - (-1)) = (OLD.history - 0)) OR (OLD.status NOT IN ('finished', 'failed', 'expired') AND NEW.status IN ('finished', 'failed', 'expired') AND (jsonb_array_length(NEW.history) >= 50 OR (jsonb_array_length(NEW.history) > jsonb_array_length(OLD.history) AND jsonb_path_query_array(NEW.history, '$[0 to $n]', jsonb_build_object('n', jsonb_array_length(OLD.history) - 1)) = OLD.history)))))", func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: %s %s: its history only grows by one entry per '\n                                 'statement; past entries are never rewritten', TG_TABLE_NAME, OLD.id);\n        ", hash='b42d83352b4fb877ae95c530d2019f25498dd210', operation='UPDATE OF "history"', pgid='pgtrigger_delivery_history_append_only_27347', table='buzz_delivery_delivery_record', when='BEFORE')),
            )
        ),
        migrations.RunPython(secure_the_queue, migrations.RunPython.noop, elidable=False),
        migrations.RunSQL(sql=VIEW_WITH_QUEUE, reverse_sql=VIEW_OF_RECORD),
        # Backwards only, so last here: the first statement of the move back (the view and the
        # record held for all of it, in the readers' order).
        migrations.RunSQL(sql=migrations.RunSQL.noop, reverse_sql=LOCK_RECORD),
    ]

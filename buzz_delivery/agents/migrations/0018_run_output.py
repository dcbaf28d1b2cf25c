"""Streamed output of agent runs (issue 29, SPEC 16 "Streamed output"): ``buzz_agents_output``,
one row per chunk a holder emitted (``ctx.emit``), and the run's counters of them
(``output_chunks``: the last seq, ``output_bytes``). The new table gets what every
community-scoped table has: a primary key that leads with ``community_id``, a composite foreign
key to its run (``ON DELETE CASCADE``: pruning or purging a run takes its output with it), the
write fence, the tombstone guard and row-level security. A trigger keeps the sequence gapless
(an inserted chunk's ``seq`` is the run's ``output_chunks``, bumped by one in the same statement,
and one past the run's last chunk); another lets the counters move only forward, by one chunk."""

import importlib

import buzz_delivery.models
import django.db.models.deletion
import django.db.models.functions.datetime
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

from buzz_delivery import isolation

_0014 = importlib.import_module("buzz_delivery.agents.migrations.0014_agent_policy")

_LAST_TABLE = "       OR EXISTS (SELECT 1 FROM buzz_agents_policy WHERE community_id = OLD.id) THEN"
assert _0014.GUARD.count(_LAST_TABLE) == 1
GUARD = _0014.GUARD.replace(
    _LAST_TABLE,
    "       OR EXISTS (SELECT 1 FROM buzz_agents_policy WHERE community_id = OLD.id)\n"
    "       OR EXISTS (SELECT 1 FROM buzz_agents_output WHERE community_id = OLD.id) THEN",
)

KEYS = """
ALTER TABLE buzz_agents_output DROP CONSTRAINT buzz_agents_output_pkey,
    ADD CONSTRAINT buzz_agents_output_pkey PRIMARY KEY (community_id, id);
ALTER TABLE buzz_agents_output ADD CONSTRAINT ag_output_run_same_community
    FOREIGN KEY (community_id, run_id) REFERENCES buzz_agents_run (community_id, id) ON DELETE CASCADE;
"""
DROP_KEYS = """
ALTER TABLE buzz_agents_output DROP CONSTRAINT ag_output_run_same_community;
ALTER TABLE buzz_agents_output DROP CONSTRAINT buzz_agents_output_pkey,
    ADD CONSTRAINT buzz_agents_output_pkey PRIMARY KEY (id);
"""

SEQUENCE = """
CREATE FUNCTION buzz_agents_output_seq() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    used integer;
    last_ integer;
BEGIN
    SELECT output_chunks INTO used FROM buzz_agents_run
    WHERE community_id = NEW.community_id AND id = NEW.run_id;
    SELECT max(seq) INTO last_ FROM buzz_agents_output
    WHERE community_id = NEW.community_id AND run_id = NEW.run_id;
    IF used IS NULL OR NEW.seq IS DISTINCT FROM used OR NEW.seq <> coalesce(last_, 0) + 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'BD003',
            MESSAGE = format('buzz_agents: output seq %s is not the run''s next (counter %s, last %s)',
                             NEW.seq, used, last_);
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER buzz_agents_output_seq
BEFORE INSERT ON buzz_agents_output
FOR EACH ROW EXECUTE FUNCTION buzz_agents_output_seq();

CREATE FUNCTION buzz_agents_output_counters() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'BD003',
        MESSAGE = 'buzz_agents: output_chunks moves by one and output_bytes never goes back';
END;
$$;
CREATE TRIGGER buzz_agents_output_counters
BEFORE UPDATE OF output_chunks, output_bytes ON buzz_agents_run
FOR EACH ROW WHEN (NEW.output_chunks NOT IN (OLD.output_chunks, OLD.output_chunks + 1)
                   OR NEW.output_bytes < OLD.output_bytes)
EXECUTE FUNCTION buzz_agents_output_counters();
"""
DROP_SEQUENCE = """
DROP TRIGGER buzz_agents_output_counters ON buzz_agents_run;
DROP FUNCTION buzz_agents_output_counters();
DROP TRIGGER buzz_agents_output_seq ON buzz_agents_output;
DROP FUNCTION buzz_agents_output_seq();
"""


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_agents', '0017_workflow_cancel_unwinds'),
        ('buzz_delivery', '0024_claim_under_limits_as_a_function'),
        ('buzz_workflows', '0021_run_and_step_priority'),
    ]

    operations = [
        migrations.CreateModel(
            name='RunOutput',
            fields=[
                ('id', models.UUIDField(default=buzz_delivery.models.new_uuid7, editable=False, primary_key=True, serialize=False)),
                ('seq', models.IntegerField()),
                ('chunk', models.TextField()),
                ('generation', models.BigIntegerField()),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
            ],
            options={
                'db_table': 'buzz_agents_output',
                'ordering': ['seq'],
            },
        ),
        migrations.AddField(
            model_name='agentrun',
            name='output_bytes',
            field=models.BigIntegerField(db_default=0, default=0, editable=False),
        ),
        migrations.AddField(
            model_name='agentrun',
            name='output_chunks',
            field=models.IntegerField(db_default=0, default=0, editable=False),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.CheckConstraint(condition=models.Q(('output_bytes__gte', 0), ('output_chunks__gte', 0)), name='ag_run_output_counters_gte_0'),
        ),
        migrations.AddField(
            model_name='runoutput',
            name='community',
            field=models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, to='buzz_delivery.community'),
        ),
        migrations.AddField(
            model_name='runoutput',
            name='run',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='stream', to='buzz_agents.agentrun'),
        ),
        migrations.AddConstraint(
            model_name='runoutput',
            constraint=models.UniqueConstraint(fields=('community', 'run', 'seq'), name='ag_output_seq_key'),
        ),
        migrations.AddConstraint(
            model_name='runoutput',
            constraint=models.CheckConstraint(condition=models.Q(('seq__gte', 1)), name='ag_output_seq_gte_1'),
        ),
        migrations.AddConstraint(
            model_name='runoutput',
            constraint=models.CheckConstraint(condition=models.Q(('chunk', ''), _negated=True), name='ag_output_chunk_not_empty'),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='runoutput',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='808d64110a2040363ae64134f6266e00124dccf6', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_be443', table='buzz_agents_output', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='runoutput',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='a2140846497e6be072a6b24df300391ceac0380e', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_e099c', table='buzz_agents_output', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='runoutput',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='d59e86dedc446a2689273553d55a0127063d3ce6', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_68f5c', table='buzz_agents_output', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='runoutput',
            trigger=pgtrigger.compiler.Trigger(name='ag_output_immutable', sql=pgtrigger.compiler.UpsertTriggerSql(func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_workflows: %s rows are immutable', TG_TABLE_NAME);\n        ", hash='31c61203e3f26df8eee8f2e7cb5a123c19ae967e', operation='UPDATE', pgid='pgtrigger_ag_output_immutable_53a66', table='buzz_agents_output', when='BEFORE')),
        ),
            migrations.RunSQL(sql=KEYS, reverse_sql=DROP_KEYS),
        migrations.RunSQL(sql=SEQUENCE, reverse_sql=DROP_SEQUENCE),
        migrations.RunSQL(sql=GUARD, reverse_sql=_0014.GUARD),
        isolation.migration_operation("buzz_agents"),
    ]

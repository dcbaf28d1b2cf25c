"""The operator's policy for agent runs (issue 27): ``buzz_agents_policy`` (a community's row,
``agent_pubkey`` NULL, or one agent key's), and the lease cap each run keeps from it
(``max_lease_seconds``). The new table gets what every community-scoped table has: a primary key
that leads with ``community_id``, the write fence (above), the tombstone guard and row-level
security. The approval decision an agent run reads back from its journal no longer carries the
operator's username (``decided_by`` is ``operator``); the run's history, which only operators
read, keeps it."""

import importlib

import buzz_delivery.models
import django.db.models.deletion
import django.db.models.functions.datetime
import django.db.models.functions.text
import django.db.models.lookups
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

from buzz_delivery import isolation

_0002 = importlib.import_module("buzz_delivery.agents.migrations.0002_keys_and_triggers")
_0004 = importlib.import_module("buzz_delivery.agents.migrations.0004_approval_and_cancel_in_history")
_0013 = importlib.import_module("buzz_delivery.agents.migrations.0013_history_entries_immutable")

_GUARD = _0004._function(_0002.TOMBSTONE_GUARD, "buzz_agents_refuse_tombstone")
_LAST_TABLE = "       OR EXISTS (SELECT 1 FROM buzz_agents_run WHERE community_id = OLD.id) THEN"
assert _GUARD.count(_LAST_TABLE) == 1
GUARD = _GUARD.replace(
    _LAST_TABLE,
    "       OR EXISTS (SELECT 1 FROM buzz_agents_run WHERE community_id = OLD.id)\n"
    "       OR EXISTS (SELECT 1 FROM buzz_agents_policy WHERE community_id = OLD.id) THEN",
)
_DECIDED_BY = "'decided_by', NEW.decided_by)"
# From 0013's function (its history entries built immutably, for Citus), not 0004's.
assert _0013.RESUME.count(_DECIDED_BY) == 1
RESUME = _0013.RESUME.replace(
    _DECIDED_BY, "'decided_by', CASE WHEN NEW.decided_by IS NULL THEN NULL ELSE 'operator' END)"
)
PRIMARY_KEY = (
    "ALTER TABLE buzz_agents_policy DROP CONSTRAINT buzz_agents_policy_pkey,"
    " ADD CONSTRAINT buzz_agents_policy_pkey PRIMARY KEY (community_id, id);"
)


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_agents', '0013_history_entries_immutable'),
        ('buzz_delivery', '0017_lease_statements_as_functions'),
    ]

    operations = [
        migrations.AddField(
            model_name='agentrun',
            name='max_lease_seconds',
            field=models.FloatField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name='AgentPolicy',
            fields=[
                ('id', models.UUIDField(default=buzz_delivery.models.new_uuid7, editable=False, primary_key=True, serialize=False)),
                ('agent_pubkey', models.BinaryField(blank=True, max_length=32, null=True)),
                ('max_tool_calls', models.IntegerField(blank=True, null=True)),
                ('max_cost', models.BigIntegerField(blank=True, null=True)),
                ('max_attempts', models.IntegerField(blank=True, null=True)),
                ('max_timeout_seconds', models.IntegerField(blank=True, null=True)),
                ('max_lease_seconds', models.FloatField(blank=True, null=True)),
                ('shadow', models.BooleanField(blank=True, null=True)),
                ('updated_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('updated_by', models.CharField(blank=True, default='', max_length=200)),
                ('community', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.PROTECT, to='buzz_delivery.community')),
            ],
            options={
                'verbose_name_plural': 'agent policies',
                'db_table': 'buzz_agents_policy',
                'constraints': [models.UniqueConstraint(fields=('community', 'agent_pubkey'), name='ag_policy_one_per_scope', nulls_distinct=False), models.CheckConstraint(condition=models.Q(('agent_pubkey__isnull', True), django.db.models.lookups.Exact(django.db.models.functions.text.Length('agent_pubkey'), 32), _connector='OR'), name='ag_policy_agent_32_bytes'), models.CheckConstraint(condition=models.Q(('max_tool_calls__isnull', True), models.Q(('max_tool_calls__gte', 0), ('max_tool_calls__lte', 100000)), _connector='OR'), name='ag_policy_max_tool_calls_range'), models.CheckConstraint(condition=models.Q(('max_cost__isnull', True), models.Q(('max_cost__gte', 0), ('max_cost__lte', 9007199254740991)), _connector='OR'), name='ag_policy_max_cost_range'), models.CheckConstraint(condition=models.Q(('max_attempts__isnull', True), models.Q(('max_attempts__gte', 1), ('max_attempts__lte', 100)), _connector='OR'), name='ag_policy_max_attempts_range'), models.CheckConstraint(condition=models.Q(('max_timeout_seconds__isnull', True), models.Q(('max_timeout_seconds__gte', 1), ('max_timeout_seconds__lte', 2592000)), _connector='OR'), name='ag_policy_max_timeout_range'), models.CheckConstraint(condition=models.Q(('max_lease_seconds__isnull', True), ('max_lease_seconds__gt', 0), _connector='OR'), name='ag_policy_max_lease_positive')],
            },
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='agentpolicy',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='683d6f8a52dd28010a3e86bb0ad9187c13a6965e', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_dcf8c', table='buzz_agents_policy', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='agentpolicy',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='20275be837a8f328d3e447872a200217fa5f634c', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_4a076', table='buzz_agents_policy', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='agentpolicy',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='cb3e7073f8d8a86489740cf3525acf9d3ed8222e', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_9928d', table='buzz_agents_policy', when='BEFORE')),
        ),
        migrations.RunSQL(
            sql=PRIMARY_KEY,
            reverse_sql=(
                "ALTER TABLE buzz_agents_policy DROP CONSTRAINT buzz_agents_policy_pkey,"
                " ADD CONSTRAINT buzz_agents_policy_pkey PRIMARY KEY (id);"
            ),
        ),
        migrations.RunSQL(sql=GUARD, reverse_sql=_GUARD),
        migrations.RunSQL(sql=RESUME, reverse_sql=_0013.RESUME),
        isolation.migration_operation("buzz_agents"),
    ]

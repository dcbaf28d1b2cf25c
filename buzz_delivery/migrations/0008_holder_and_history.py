"""Who holds a delivery's lease, and its history on the row (issue 17).

- ``claimed_by``: the claimer's holder identity, at most 200 characters (a CHECK).
- ``renewals``: renewals of the current (or last) lease; the claim resets it, each renew adds 1.
- ``history``: a JSON array of the last 50 transitions (claim, settle, retry, reap, expiry,
  operator action), each ``{"event", "generation", "actor", "at", "renewals", "status"}``,
  appended by the very statement that makes the transition through
  ``buzz_delivery_history_push`` below, bounded by a CHECK and kept append-only by a trigger
  (``triggers.history_append_only``). The column has a constant default, so adding it does not
  rewrite the table.

``buzz_delivery_history_push(history, entry)``: the array with ``entry`` (an object) appended
and only its last 50 entries kept. An IMMUTABLE one-expression SQL function of IMMUTABLE
operators only (``jsonb || object`` appends the object; a jsonpath slice keeps the last 50; no
CASE, so Citus accepts it in a SET list), so the planner inlines it into each statement. It
must stay so: a body that calls a STABLE function (``jsonb_build_array`` is one) is not inlined,
and an SQL function called per row costs tens of microseconds (tests/test_history.py checks the
plan).
"""

import django.db.models.functions.text
import django.db.models.lookups
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

CREATE_PUSH = """
CREATE OR REPLACE FUNCTION buzz_delivery_history_push(history jsonb, entry jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT jsonb_path_query_array(history || entry, '$[last - 49 to last]') $$;
"""
DROP_PUSH = "DROP FUNCTION IF EXISTS buzz_delivery_history_push(jsonb, jsonb);"


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0007_scale_out_keys_and_fence'),
    ]

    operations = [
        migrations.RunSQL(sql=CREATE_PUSH, reverse_sql=DROP_PUSH),
        migrations.AddField(
            model_name='workflowagentdelivery',
            name='claimed_by',
            field=models.TextField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='workflowagentdelivery',
            name='history',
            field=models.JSONField(blank=True, db_default=models.Value([], output_field=models.JSONField()), default=list),
        ),
        migrations.AddField(
            model_name='workflowagentdelivery',
            name='renewals',
            field=models.IntegerField(db_default=0, default=0),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflowagentdelivery',
            trigger=pgtrigger.compiler.Trigger(name='delivery_history_append_only', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (NEW.history IS DISTINCT FROM OLD.history AND NOT ((NEW.history - (-1)) = OLD.history OR (jsonb_array_length(OLD.history) >= 50 AND (NEW.history - (-1)) = (OLD.history - 0))))', func="\n            RAISE EXCEPTION USING ERRCODE = 'BD003',\n                MESSAGE = format('buzz_delivery: %s %s: its history only grows by one entry per '\n                                 'statement; past entries are never rewritten', TG_TABLE_NAME, OLD.id);\n        ", hash='dbaab84f595f8fd11686b6bcd92d101c7dec7b74', operation='UPDATE OF "history"', pgid='pgtrigger_delivery_history_append_only_ca9c8', table='buzz_delivery_delivery', when='BEFORE')),
        ),
        migrations.AddConstraint(
            model_name='workflowagentdelivery',
            constraint=models.CheckConstraint(condition=models.Q(('claimed_by__isnull', True), django.db.models.lookups.LessThanOrEqual(django.db.models.functions.text.Length('claimed_by'), 200), _connector='OR'), name='delivery_claimed_by_length'),
        ),
        migrations.AddConstraint(
            model_name='workflowagentdelivery',
            constraint=models.CheckConstraint(condition=models.Q(('renewals__gte', 0)), name='delivery_renewals_gte_0'),
        ),
        migrations.AddConstraint(
            model_name='workflowagentdelivery',
            constraint=models.CheckConstraint(condition=models.Q(django.db.models.lookups.Exact(models.Func(models.F('history'), function='jsonb_typeof', output_field=models.TextField()), 'array'), django.db.models.lookups.LessThanOrEqual(models.Func(models.F('history'), function='jsonb_array_length', output_field=models.IntegerField()), 50)), name='delivery_history_bounded'),
        ),
    ]

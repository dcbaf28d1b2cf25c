"""``buzz_delivery_history_push(history, entry)`` keeps the last 50 entries without a jsonpath.

Migration 0008's body sliced ``history || entry`` with ``jsonb_path_query_array(..., '$[last - 49
to last]')``: a jsonpath evaluation that rebuilds the array on every push, ~2.5 µs a row against
~0.9 for the append alone (200,000 rows, PostgreSQL 15). Every history column it serves (the
delivery's, the workflow step's, the agent run's) is CHECKed to at most 50 entries, so a push
drops at most the oldest one: ``jsonb - 0`` when the history is full, ``jsonb - 50`` (past the end
of an appended array of at most 50: nothing removed) otherwise. Still one IMMUTABLE expression of
IMMUTABLE operators with no CASE, so the planner inlines it into each statement (the plan-cached
functions re-plan on the replace) and Citus accepts it in a SET list. Every claim and settle pushes
once: ~3 µs of server CPU a delivery (issue 31). Backwards: 0008's body."""

from django.db import migrations

NEW_PUSH = """
CREATE OR REPLACE FUNCTION buzz_delivery_history_push(history jsonb, entry jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (history || entry) - (50 * (1 - LEAST(jsonb_array_length(history) / 50, 1))) $$
"""

OLD_PUSH = """
CREATE OR REPLACE FUNCTION buzz_delivery_history_push(history jsonb, entry jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT jsonb_path_query_array(history || entry, '$[last - 49 to last]') $$
"""


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_delivery", "0034_delivery_record_behind_a_view"),
    ]

    operations = [
        migrations.RunSQL(sql=NEW_PUSH, reverse_sql=OLD_PUSH),
    ]

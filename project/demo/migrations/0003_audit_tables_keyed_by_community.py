"""The demo's audit tables (status and state changes, written by triggers on the deliveries,
steps, approvals and agent runs) keyed by ``(id, community_id)`` and without a database foreign
key to their demo run (Django still deletes them with it), and a ``holder`` column: so that on a
Citus cluster they can be distributed by ``community_id``, colocated with the community, where
a trigger running on a shard may write them (``project.demo.audit.distribute``; issue 30). On a
shard the session's ``application_name`` is Citus's own, so the audit also records the lease's
holder (``claimed_by``), which names the worker there."""

import django.db.models.deletion
from django.db import migrations, models

TABLES = ("buzz_demo_statuschange", "buzz_demo_statechange")


def _primary_key(table: str) -> migrations.RunSQL:
    # Two statements each: Citus refuses ADD CONSTRAINT with another subcommand.
    return migrations.RunSQL(
        sql=[
            f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey",
            f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY (id, community_id)",
        ],
        reverse_sql=[
            f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey",
            f"ALTER TABLE {table} ADD CONSTRAINT {table}_pkey PRIMARY KEY (id)",
        ],
    )


class Migration(migrations.Migration):
    dependencies = [("buzz_demo", "0002_tool_effect_and_state_change")]

    operations = [
        migrations.AlterField(
            model_name="statuschange",
            name="run",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="status_changes",
                to="buzz_demo.demorun",
            ),
        ),
        migrations.AlterField(
            model_name="statechange",
            name="run",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="state_changes",
                to="buzz_demo.demorun",
            ),
        ),
        migrations.AddField(
            model_name="statuschange",
            name="holder",
            field=models.CharField(blank=True, default="", max_length=200),
        ),
        *[_primary_key(t) for t in TABLES],
    ]

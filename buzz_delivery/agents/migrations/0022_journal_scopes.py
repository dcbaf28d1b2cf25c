"""Replay scopes of the tool-call journal (docs/agents.md "Resume"): an entry is replayed as call
``scope_index`` of scope ``scope`` ('' = the run's root), so concurrent calls in different scopes
replay whatever order they were journaled in. No row is rewritten: an entry written before this
migration has scope '' and ``scope_index`` NULL, which means its ``seq`` (a unique index on
``coalesce(scope_index, seq)``), so an old journal replays by position as before."""

import django.db.models.functions.comparison
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_agents", "0021_intake_as_a_function"),
        ("buzz_delivery", "0033_delivery_requeues"),
        ("buzz_workflows", "0028_step_claim_reaches_its_steps_by_key"),
    ]

    operations = [
        migrations.AddField(
            model_name="journalentry",
            name="scope",
            field=models.CharField(blank=True, db_default="", default="", max_length=200),
        ),
        migrations.AddField(
            model_name="journalentry",
            name="scope_index",
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name="journalentry",
            constraint=models.UniqueConstraint(
                models.F("community"),
                models.F("run"),
                models.F("scope"),
                django.db.models.functions.comparison.Coalesce("scope_index", "seq"),
                name="ag_journal_scope_key",
            ),
        ),
        migrations.AddConstraint(
            model_name="journalentry",
            constraint=models.CheckConstraint(
                condition=models.Q(("scope_index__isnull", True), ("scope_index__gte", 1), _connector="OR"),
                name="ag_journal_scope_index_gte_1",
            ),
        ),
    ]

"""Concurrency limits by key for agent runs (issue 32, services/flow.py ``AGENT_CONCURRENCY_LIMITS``):
the slot columns, their range and one partial UNIQUE index per kind of key over the leased runs
(``running``, ``waiting_tool``): a run parked, pending or ended holds no slot."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_agents', '0018_run_output'),
        ('buzz_delivery', '0025_rate_limits'),
        ('buzz_workflows', '0021_run_and_step_priority'),
    ]

    operations = [
        migrations.AddField(
            model_name='agentrun',
            name='slot_agent',
            field=models.SmallIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name='agentrun',
            name='slot_community',
            field=models.SmallIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.CheckConstraint(condition=models.Q(('slot_community__isnull', True), models.Q(('slot_community__gte', 0), ('slot_community__lt', 1000)), _connector='OR'), name='ag_run_slot_community_range'),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.CheckConstraint(condition=models.Q(('slot_agent__isnull', True), models.Q(('slot_agent__gte', 0), ('slot_agent__lt', 1000)), _connector='OR'), name='ag_run_slot_agent_range'),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.UniqueConstraint(condition=models.Q(('slot_community__isnull', False), ('state__in', ('running', 'waiting_tool'))), fields=('community', 'slot_community'), name='ag_run_slot_community_key'),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.UniqueConstraint(condition=models.Q(('slot_agent__isnull', False), ('state__in', ('running', 'waiting_tool'))), fields=('community', 'agent_pubkey', 'slot_agent'), name='ag_run_slot_agent_key'),
        ),
    ]

"""Concurrency limits by key for workflow steps (issue 32, services/flow.py ``STEP_CONCURRENCY_LIMITS``):
the slot columns, the workflow a claim under limits copies from the run, their range and one
partial UNIQUE index per kind of key over the running steps."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0025_rate_limits'),
        ('buzz_workflows', '0021_run_and_step_priority'),
    ]

    operations = [
        migrations.AddField(
            model_name='step',
            name='slot_community',
            field=models.SmallIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name='step',
            name='slot_step',
            field=models.SmallIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name='step',
            name='slot_workflow',
            field=models.SmallIntegerField(blank=True, editable=False, null=True),
        ),
        migrations.AddField(
            model_name='step',
            name='slot_workflow_id',
            field=models.UUIDField(blank=True, editable=False, null=True),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.CheckConstraint(condition=models.Q(('slot_community__isnull', True), models.Q(('slot_community__gte', 0), ('slot_community__lt', 1000)), _connector='OR'), name='wf_step_slot_community_range'),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.CheckConstraint(condition=models.Q(('slot_workflow__isnull', True), models.Q(('slot_workflow__gte', 0), ('slot_workflow__lt', 1000)), _connector='OR'), name='wf_step_slot_workflow_range'),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.CheckConstraint(condition=models.Q(('slot_step__isnull', True), models.Q(('slot_step__gte', 0), ('slot_step__lt', 1000)), _connector='OR'), name='wf_step_slot_step_range'),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.UniqueConstraint(condition=models.Q(('slot_community__isnull', False), ('state', 'running')), fields=('community', 'slot_community'), name='wf_step_slot_community_key'),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.UniqueConstraint(condition=models.Q(('slot_workflow__isnull', False), ('state', 'running')), fields=('community', 'slot_workflow_id', 'slot_workflow'), name='wf_step_slot_workflow_key'),
        ),
        migrations.AddConstraint(
            model_name='step',
            constraint=models.UniqueConstraint(condition=models.Q(('slot_step__isnull', False), ('state', 'running')), fields=('community', 'slot_workflow_id', 'key', 'slot_step'), name='wf_step_slot_step_key'),
        ),
    ]

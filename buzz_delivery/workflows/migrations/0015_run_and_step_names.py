"""The engine's runs and steps are "workflow runs" and "workflow steps" in the admin, apart from
the core's "delivery runs" (issue 36). No SQL."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_workflows', '0014_write_fence_when_not_passed'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='run',
            options={'permissions': [('cancel_engine_run', 'Can cancel workflow runs'), ('restart_engine_run', 'Can restart workflow runs from failure'), ('retry_engine_step', 'Can retry failed workflow steps (restart from failure)')], 'verbose_name': 'workflow run'},
        ),
        migrations.AlterModelOptions(
            name='step',
            options={'verbose_name': 'workflow step'},
        ),
    ]

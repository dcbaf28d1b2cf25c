"""The agent run that asked for an approval, found within the approval's community (issue 36):
the approvals list links each agent approval to its run (one probe per listed row), and the
decision trigger that resumes the run no longer scans the community's runs."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_agents', '0010_write_fence_when_not_passed'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('approval__isnull', False)), fields=['community', 'approval'], name='ag_run_approval_idx'),
        ),
    ]

"""The core run is a "delivery run" in the admin, apart from the engine's "workflow run" (issue 36)."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0017_lease_statements_as_functions'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='workflowrun',
            options={'verbose_name': 'delivery run'},
        ),
    ]

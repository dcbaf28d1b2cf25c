"""OpenTelemetry: a workflow run keeps the trace context it was started in (issue 34): W3C headers, NULL without tracing
(buzz_delivery.tracing.work). A nullable column without a default: a catalog change only."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_workflows', '0019_delegable_entry_points'),
    ]

    operations = [
        migrations.AddField(
            model_name='run',
            name='trace_context',
            field=models.JSONField(blank=True, null=True),
        ),
    ]

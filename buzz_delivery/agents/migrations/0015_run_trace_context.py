"""OpenTelemetry: an agent run keeps the trace context it was accepted in (issue 34): W3C headers, NULL without tracing
(buzz_delivery.tracing.work). A nullable column without a default: a catalog change only."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_agents', '0014_agent_policy'),
    ]

    operations = [
        migrations.AddField(
            model_name='agentrun',
            name='trace_context',
            field=models.JSONField(blank=True, null=True),
        ),
    ]

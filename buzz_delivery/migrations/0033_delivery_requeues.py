"""A delivery's operator requeues (``requeues``, 0 for every row so far, never reset): the
requeue epoch a row is in, however much of its history (the last 50 entries) was dropped since.
The tasks backend keys a recorded error with it (buzz_delivery.tasks.services). Not returned
by claims: the claim statements and their plan-cached functions are unchanged."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("buzz_delivery", "0032_claim_limited_reaches_its_admitted_by_key"),
    ]

    operations = [
        migrations.AddField(
            model_name="workflowagentdelivery",
            name="requeues",
            field=models.IntegerField(db_default=0, default=0, editable=False),
        ),
    ]

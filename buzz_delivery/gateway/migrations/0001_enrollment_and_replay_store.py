"""Enrollments and the NIP-98 replay store (SPEC sections 14 and 15).

The enrollment table is community-scoped from its first migration: its real primary key is
(community_id, id) (Django still sees ``id`` as the key; ``enrollment_id_idx`` serves lookups by
id alone), it carries the core write fence trigger, and its unique key leads with community_id.
The replay store is keyed by event id alone: it is not community-scoped (see ``SeenEvent``).
"""

import buzz_delivery.models
import django.db.models.deletion
import django.db.models.functions.datetime
import django.db.models.functions.text
import django.db.models.lookups
import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("buzz_delivery", "0007_scale_out_keys_and_fence"),
    ]

    operations = [
        migrations.CreateModel(
            name="SeenEvent",
            fields=[
                ("event_id", models.BinaryField(max_length=32, primary_key=True, serialize=False)),
                ("pubkey", models.BinaryField(max_length=32)),
                ("created_at", models.DateTimeField()),
                ("seen_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False)),
            ],
            options={
                "db_table": "buzz_gateway_seen_event",
                "indexes": [models.Index(fields=["created_at"], name="seen_event_created_idx")],
                "constraints": [
                    models.CheckConstraint(
                        condition=django.db.models.lookups.Exact(
                            django.db.models.functions.text.Length("event_id"), 32
                        ),
                        name="seen_event_event_id_32_bytes",
                    ),
                    models.CheckConstraint(
                        condition=django.db.models.lookups.Exact(django.db.models.functions.text.Length("pubkey"), 32),
                        name="seen_event_pubkey_32_bytes",
                    ),
                ],
            },
        ),
        migrations.CreateModel(
            name="Enrollment",
            fields=[
                (
                    "id",
                    models.UUIDField(
                        default=buzz_delivery.models.new_uuid7, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("agent_pubkey", models.BinaryField(max_length=32)),
                (
                    "enrolled_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False),
                ),
                ("revoked_at", models.DateTimeField(blank=True, null=True)),
                ("enrolled_by", models.CharField(blank=True, default="", max_length=200)),
                (
                    "community",
                    models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.PROTECT, to="buzz_delivery.community"
                    ),
                ),
            ],
            options={
                "db_table": "buzz_gateway_enrollment",
                "indexes": [
                    models.Index(
                        condition=models.Q(("revoked_at__isnull", True)),
                        fields=["agent_pubkey"],
                        name="enrollment_live_key_idx",
                    ),
                    models.Index(fields=["id"], name="enrollment_id_idx"),
                ],
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("revoked_at__isnull", True)),
                        fields=("community", "agent_pubkey"),
                        name="enrollment_one_live_per_key",
                    ),
                    models.CheckConstraint(
                        condition=django.db.models.lookups.Exact(
                            django.db.models.functions.text.Length("agent_pubkey"), 32
                        ),
                        name="enrollment_agent_pubkey_32_bytes",
                    ),
                    models.CheckConstraint(
                        condition=models.Q(
                            ("revoked_at__isnull", True), ("revoked_at__gte", models.F("enrolled_at")), _connector="OR"
                        ),
                        name="enrollment_revoked_after_enrolled",
                    ),
                ],
            },
        ),
        pgtrigger.migrations.AddTrigger(
            model_name="enrollment",
            trigger=pgtrigger.compiler.Trigger(
                name="community_write_fence",
                sql=pgtrigger.compiler.UpsertTriggerSql(
                    func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ",
                    hash="e59b39a62e8a6563c75eaacb844f8f7acd33b475",
                    operation="INSERT OR UPDATE OR DELETE",
                    pgid="pgtrigger_community_write_fence_5771c",
                    table="buzz_gateway_enrollment",
                    when="BEFORE",
                ),
            ),
        ),
        migrations.RunSQL(
            sql="ALTER TABLE buzz_gateway_enrollment DROP CONSTRAINT buzz_gateway_enrollment_pkey;"
            " ALTER TABLE buzz_gateway_enrollment ADD CONSTRAINT buzz_gateway_enrollment_pkey"
            " PRIMARY KEY (community_id, id);",
            reverse_sql="ALTER TABLE buzz_gateway_enrollment DROP CONSTRAINT buzz_gateway_enrollment_pkey;"
            " ALTER TABLE buzz_gateway_enrollment ADD CONSTRAINT buzz_gateway_enrollment_pkey PRIMARY KEY (id);",
        ),
    ]

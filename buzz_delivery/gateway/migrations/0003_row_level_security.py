"""Row-level security for this app's community-scoped tables (SPEC section 13): grants to the
two roles and the two policies on each, as in the core's 0008. Enforcement is switched by
``manage.py tenant_isolation``."""

from django.db import migrations

from buzz_delivery import isolation


class Migration(migrations.Migration):
    dependencies = [("buzz_gateway", "0002_tombstone_guard"), ("buzz_delivery", "0011_row_level_security")]

    operations = [isolation.migration_operation("buzz_gateway")]

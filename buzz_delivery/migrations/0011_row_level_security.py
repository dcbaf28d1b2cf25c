"""Row-level security for the core's community-scoped tables (SPEC section 13).

Creates the roles where this user may, grants them DML on the core's tables and installs the
two policies on each community-scoped one. Enforcement stays off until
``manage.py tenant_isolation enable`` (see :mod:`buzz_delivery.isolation`)."""

from django.db import migrations

from buzz_delivery import isolation


class Migration(migrations.Migration):
    dependencies = [("buzz_delivery", "0010_delivery_ops_indexes")]

    operations = [
        migrations.RunSQL(isolation.CURRENT_COMMUNITY_FUNCTION, isolation.DROP_CURRENT_COMMUNITY_FUNCTION),
        isolation.migration_operation("buzz_delivery"),
    ]

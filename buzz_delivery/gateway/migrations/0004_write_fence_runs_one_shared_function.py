# The write-fence triggers run the core's shared row function (core migration 0014, issue 16).

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0014_write_fence_runs_one_shared_function'),
        ('buzz_gateway', '0003_row_level_security'),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name='enrollment',
            name='community_write_fence',
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='enrollment',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='0c96467ea61f5dc95fd6b4f9d44fbe1708a16a00', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_5771c', table='buzz_gateway_enrollment', when='BEFORE')),
        ),
    ]

"""The write fence in three triggers whose WHEN skips the rows of a community this
transaction already found active under its fence lock (``buzz_delivery.fence_passed``): the row
function returned at once for those, but each still cost a PL/pgSQL call. INSERT or UPDATE
(judged by NEW), DELETE (by OLD), and an UPDATE that moves a row to another community (both).
See ``buzz_delivery.triggers.write_fence``; issue 16."""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_gateway', '0004_write_fence_runs_one_shared_function'),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name='enrollment',
            name='community_write_fence',
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='enrollment',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='dbed29fe32736d9f7adf9179f98a8aaec88a872a', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_5771c', table='buzz_gateway_enrollment', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='enrollment',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='8763c74a83ae8ec3f6a24c89bb9f5b9b5755a539', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_8a279', table='buzz_gateway_enrollment', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='enrollment',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='d7ca63d6e19d6d928bce1ac1378d2d1138d5c6dc', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_f882e', table='buzz_gateway_enrollment', when='BEFORE')),
        ),
    ]

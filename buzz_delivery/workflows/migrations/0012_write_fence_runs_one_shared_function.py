# The write-fence triggers run the core's shared row function (core migration 0014, issue 16).

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0014_write_fence_runs_one_shared_function'),
        ('buzz_workflows', '0011_run_failed_index'),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name='approval',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='definitionversion',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='run',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='schedule',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='step',
            name='community_write_fence',
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='approval',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='0fc016d25166faaf0133b45b405802226e5ca730', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_13437', table='buzz_workflows_approval', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='definitionversion',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='d60ccbb3b8dc5f87923a5717b1a029059700d066', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_3222f', table='buzz_workflows_definition', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='run',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='b51c1152c79b2fb3cc505ed736a57616db03b427', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_0b6fc', table='buzz_workflows_run', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='schedule',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='aa7c8e9def9e2c3fcb277aec0b71b7605c1fb429', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_8604f', table='buzz_workflows_schedule', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='step',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='0c3d75510e108e8568d6d067447200cf76967925', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_667a4', table='buzz_workflows_step', when='BEFORE')),
        ),
    ]

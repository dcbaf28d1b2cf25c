# The write-fence triggers run the core's shared row function (core migration 0014, issue 16).

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('buzz_delivery', '0014_write_fence_runs_one_shared_function'),
        ('buzz_agents', '0008_admin_list_filter_indexes'),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name='agentrun',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='intakekey',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='journalentry',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='stepwait',
            name='community_write_fence',
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='agentrun',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='6fbe081a6298bb3ec97e91bd18ce3dd9efffac45', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_c7773', table='buzz_agents_run', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='intakekey',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='fe8611cbcf23edac3fb77cf850e14130aa612afe', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_bb957', table='buzz_agents_intake_key', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='journalentry',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='436be02a1d1872aa871870337f3aba33eab00147', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_2f271', table='buzz_agents_journal', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='stepwait',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='a1a65d688500120e319a065fdc0a51be92e8068c', operation='INSERT OR UPDATE OR DELETE', pgid='pgtrigger_community_write_fence_bf8a4', table='buzz_agents_step_wait', when='BEFORE')),
        ),
    ]

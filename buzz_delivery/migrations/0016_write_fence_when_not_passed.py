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
        ('buzz_delivery', '0015_age_indexes_not_for_claims'),
    ]

    operations = [
        pgtrigger.migrations.RemoveTrigger(
            model_name='event',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='workflow',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='workflowagentdelivery',
            name='community_write_fence',
        ),
        pgtrigger.migrations.RemoveTrigger(
            model_name='workflowrun',
            name='community_write_fence',
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='event',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='43b0c4cb8bdf5bb60e946ce40e1aef41e33b9aa4', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_2927a', table='buzz_delivery_event', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='event',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='1cbe7ef34907073221960ee5c08c19a40fa45c9f', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_043f7', table='buzz_delivery_event', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='event',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='d7ac4ea3d3e6db7e1b687a36a1a6aeadd0713153', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_2fb8b', table='buzz_delivery_event', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflow',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='94c3b1284868d7d4da1fa240c44decdaefa80a21', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_0a5bb', table='buzz_delivery_workflow', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflow',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='23150e5c92421d406fc031ae8b68e27fa4df0246', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_e729b', table='buzz_delivery_workflow', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflow',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='42213f5b5bf04e1a7138a1df3d2bbc42b107618c', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_208b1', table='buzz_delivery_workflow', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflowagentdelivery',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='2100b4e6c50c6f2c021bc8e591e1bb9f069dc642', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_59f88', table='buzz_delivery_delivery', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflowagentdelivery',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='17650ecad7cf22dfb9587b0f65e8fbcf20b8cd64', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_5a5ed', table='buzz_delivery_delivery', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflowagentdelivery',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='11dd3f11dddbd2043470d838407cea16aceccebd', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_b8f28', table='buzz_delivery_delivery', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflowrun',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='9eb6b1ab12c00e0fa3627eac5abfad163c34c198', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_bb97d', table='buzz_delivery_workflow_run', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflowrun',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='6d34d0ae5e622dbc85bf6eba6588b8ed953ce1a0', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_e2c54', table='buzz_delivery_workflow_run', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='workflowrun',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='882f936c76dd08ac3f805435559daf1115a01ed1', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_b71a3', table='buzz_delivery_workflow_run', when='BEFORE')),
        ),
    ]

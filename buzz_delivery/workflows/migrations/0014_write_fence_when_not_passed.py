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
        ('buzz_workflows', '0013_release_notify_deferred'),
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
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='c220134198f77111f7fb49e59d6b87ed4b90a905', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_13437', table='buzz_workflows_approval', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='approval',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='014175b650bae32fa16a328c7c974e3dc74bb596', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_9eb80', table='buzz_workflows_approval', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='approval',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='85f36e73aeecb8928eba1ebb4574bdc423dc9abd', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_842a6', table='buzz_workflows_approval', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='definitionversion',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='ce214e42cfce4be63fdd65a3ae61933bb1ceebe5', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_3222f', table='buzz_workflows_definition', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='definitionversion',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='043d453d77987ec78c8c88829898b49f1263b0a5', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_993ad', table='buzz_workflows_definition', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='definitionversion',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='e49c2c4d3b03f1e6a90cef9ce9a4ec92cf5420a4', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_f1234', table='buzz_workflows_definition', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='run',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='adacbfa8b700e77d7dce0538a23a4a4fdc842baa', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_0b6fc', table='buzz_workflows_run', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='run',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='e843390fec67ab5c51a1fd2d9c9b21c5fe5e69dd', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_28f24', table='buzz_workflows_run', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='run',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='579988cf5dada0997f8493744b3603fa0cab8ceb', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_c8bf9', table='buzz_workflows_run', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='schedule',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='c5450ee8d9b041e3f6399aa92c27be600d2f325c', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_8604f', table='buzz_workflows_schedule', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='schedule',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='a69a9a4b8b924c6951b7c238a20db5e7810d0bc9', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_f6195', table='buzz_workflows_schedule', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='schedule',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='7787a1790f6846851e178ecf0be31b94186339d2', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_b7fbc', table='buzz_workflows_schedule', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='step',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM NEW.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='a6f70a9149e3c63861636735603a4bd19be73ede', operation='INSERT OR UPDATE', pgid='pgtrigger_community_write_fence_667a4', table='buzz_workflows_step', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='step',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (current_setting('buzz_delivery.fence_passed', true) IS DISTINCT FROM OLD.community_id::text)", execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='b90ec96cab2be0f9024b229d4951a27407a1d029', operation='DELETE', pgid='pgtrigger_community_write_fence_delete_44b99', table='buzz_workflows_step', when='BEFORE')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='step',
            trigger=pgtrigger.compiler.Trigger(name='community_write_fence_move', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (OLD.community_id IS DISTINCT FROM NEW.community_id)', execute='buzz_delivery_write_fence_row()', func="\n            IF TG_OP = 'INSERT' THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n                RETURN NEW;\n            END IF;\n            PERFORM buzz_delivery_check_write_fence(OLD.community_id, TG_OP);\n            IF TG_OP = 'DELETE' THEN\n                RETURN OLD;\n            END IF;\n            IF NEW.community_id IS DISTINCT FROM OLD.community_id THEN\n                PERFORM buzz_delivery_check_write_fence(NEW.community_id, TG_OP);\n            END IF;\n            RETURN NEW;\n        ", hash='86fc6b6cb40d7b448f5c5ac9f74709a8505ee812', operation='UPDATE OF "community_id"', pgid='pgtrigger_community_write_fence_move_4990e', table='buzz_workflows_step', when='BEFORE')),
        ),
    ]

from django.apps import AppConfig


class WorkflowsConfig(AppConfig):
    """The workflow engine app. Its tables join the deletion catalog before the core's
    (:func:`buzz_delivery.catalog.deletion_catalog`), children first."""

    name = "buzz_delivery.workflows"
    label = "buzz_workflows"
    verbose_name = "Buzz workflows"
    default_auto_field = "django.db.models.BigAutoField"
    buzz_deletion_catalog = (
        "buzz_workflows.SentEvent",
        "buzz_workflows.Schedule",
        "buzz_workflows.Approval",
        "buzz_workflows.Step",
        "buzz_workflows.Run",
        "buzz_workflows.DefinitionVersion",
    )

    def ready(self) -> None:
        from buzz_delivery.workflows import functions  # noqa: F401  (registers noop and echo)
        from buzz_delivery.workflows.registry import autodiscover

        autodiscover()  # every installed app's workflows.py, and BUZZ_WORKFLOWS['MODULES']

from django.apps import AppConfig


class TasksConfig(AppConfig):
    """The ``django.tasks`` backend on the delivery inbox; label ``buzz_tasks`` (its table is
    ``buzz_tasks_result``)."""

    name = "buzz_delivery.tasks"
    label = "buzz_tasks"
    verbose_name = "Buzz django.tasks results"
    default_auto_field = "django.db.models.BigAutoField"
    # Its community-scoped table joins the deletion catalog (purge, tombstone guard, Citus).
    buzz_deletion_catalog = ("buzz_tasks.TaskResult",)

    def ready(self) -> None:
        from buzz_delivery.tasks import checks  # noqa: F401  (registers the system checks)

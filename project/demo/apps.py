from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "project.demo"
    label = "buzz_demo"
    verbose_name = "buzz-delivery demo"

    def ready(self) -> None:
        # The demo's function steps register themselves with the engine's registry
        # (@workflow_function) when imported: in every process, workflow workers included.
        from project.demo import steps  # noqa: F401

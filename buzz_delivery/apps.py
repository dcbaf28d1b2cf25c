from django.apps import AppConfig


class BuzzDeliveryConfig(AppConfig):
    name = "buzz_delivery"
    verbose_name = "Buzz deliveries"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from buzz_delivery import checks  # noqa: F401  (registers the system checks)

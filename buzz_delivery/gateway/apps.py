from django.apps import AppConfig


class GatewayConfig(AppConfig):
    """The agent gateway app; label ``buzz_gateway`` (its tables are ``buzz_gateway_*``)."""

    name = "buzz_delivery.gateway"
    label = "buzz_gateway"
    verbose_name = "Buzz agent gateway"
    default_auto_field = "django.db.models.BigAutoField"
    # Its community-scoped table joins the deletion catalog (purge, tombstone guard, Citus).
    buzz_deletion_catalog = ("buzz_gateway.Enrollment",)

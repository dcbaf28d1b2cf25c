from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "project.demo"
    label = "buzz_demo"
    verbose_name = "buzz-delivery demo"

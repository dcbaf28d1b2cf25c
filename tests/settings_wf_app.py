"""The example project's settings with one more installed app (``tests.wf_app``), whose
``workflows.py`` registers a function step, and a module named in ``BUZZ_WORKFLOWS['MODULES']``."""

from project.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.wf_app"]  # noqa: F405
BUZZ_WORKFLOWS = {**globals().get("BUZZ_WORKFLOWS", {}), "MODULES": ["tests.wf_app.extra_steps"]}

"""The example project's settings without ``LOGGING``: a host project that configured none."""

from project.settings import *  # noqa: F403

del LOGGING  # noqa: F821

"""The example project's settings with the ``BUZZ_WORKFLOWS`` and ``BUZZ_AGENTS`` a new-user trial
wrote: a misspelt key and a lease below the core's bounds in each (tests/test_checks_apps.py)."""

from project.settings import *  # noqa: F403

BUZZ_WORKFLOWS = {"MAX_ATTEMPS": 3, "LEASE_SECONDS": 1}
BUZZ_AGENTS = {"MAX_ATTEMPS": 3, "LEASE_SECONDS": 1}

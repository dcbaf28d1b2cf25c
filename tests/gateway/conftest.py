"""Fixtures of the gateway tests: one real gunicorn server for the session (``gateway_server``)."""

from tests.gateway.support import gateway_server  # noqa: F401 (a fixture)

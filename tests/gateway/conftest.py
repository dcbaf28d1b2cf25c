"""Fixtures of the gateway tests: one real gunicorn server for the session (``gateway_server``),
one of a test's own that answers 503 on a lock wait (``impatient_gateway``) or 429 past one
request per key (``one_request_per_key``)."""

from tests.gateway.support import gateway_server, impatient_gateway, one_request_per_key  # noqa: F401 (fixtures)

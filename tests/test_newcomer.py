"""What a newcomer meets on the README's path: a styled admin with ``DEBUG`` off, a clear error
when ``buzz_delivery.testing`` lacks its extra (issue 17)."""

from __future__ import annotations

from django.conf import settings
from django.test import Client


def test_the_admin_css_is_served_with_debug_off():
    assert settings.DEBUG is False  # the example project's default, and the test runner's
    client = Client()

    response = client.get("/static/admin/css/base.css")

    assert response.status_code == 200
    assert b"".join(response.streaming_content if response.streaming else [response.content])

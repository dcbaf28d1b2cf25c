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
    # and the app's own stylesheet (the delivery list that fits a 1400-pixel window)
    ours = client.get("/static/buzz_delivery/admin/deliveries.css")
    assert ours.status_code == 200
    assert b"#result_list" in b"".join(ours.streaming_content if ours.streaming else [ours.content])


def test_buzz_delivery_testing_without_factory_boy_names_the_extra(monkeypatch):
    import importlib
    import sys

    import pytest

    monkeypatch.setitem(sys.modules, "factory", None)  # as after a plain install: not importable
    for name in ("buzz_delivery.testing", "buzz_delivery.workflows.testing"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    for name in ("buzz_delivery.testing", "buzz_delivery.workflows.testing"):
        with pytest.raises(ImportError, match=r"pip install 'buzz-delivery\[testing\]'"):
            importlib.import_module(name)

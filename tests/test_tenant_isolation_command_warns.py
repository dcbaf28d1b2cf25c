"""``manage.py tenant_isolation enable`` and ``status`` print ``check --database``'s W020 on
stderr: with a superuser login and ``SWITCH_ROLES`` off, "20 of 20 community-scoped tables
enforced" held nothing, and only ``check --database default`` said so. The exit code stays."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from buzz_delivery import isolation

pytestmark = pytest.mark.django_db


def _superuser() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        return bool(cursor.fetchone()[0])


@pytest.mark.parametrize("action", ["enable", "status"])
def test_a_superuser_login_without_switch_roles_is_warned_of_on_stderr(action):
    assert _superuser()  # the test login: row-level security does not hold it
    out, err = io.StringIO(), io.StringIO()
    with override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False}):
        call_command("tenant_isolation", action, stdout=out, stderr=err)  # no CommandError: exit 0
    assert isolation.enforced(connection.cursor())
    assert "community-scoped tables enforced" in out.getvalue() and "W020" not in out.getvalue()
    said = err.getvalue()
    assert said.startswith("WARNING (buzz_delivery.W020) Tenant isolation is on, but the tenant code's role "), said
    assert "is a superuser" in said and "row-level security does not hold it" in said
    assert "HINT: Set BUZZ_DELIVERY['SWITCH_ROLES'] = True" in said


@pytest.mark.parametrize("action", ["enable", "status"])
def test_with_switch_roles_on_nothing_is_warned(action):
    err = io.StringIO()
    with override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": True}):
        call_command("tenant_isolation", action, stdout=io.StringIO(), stderr=err)
    assert err.getvalue() == ""


@pytest.mark.django_db(transaction=True)
def test_disable_warns_of_nothing():
    err = io.StringIO()
    try:
        with override_settings(BUZZ_DELIVERY={"SWITCH_ROLES": False}):
            call_command("tenant_isolation", "disable", stdout=io.StringIO(), stderr=err)
    finally:
        call_command("tenant_isolation", "enable", stdout=io.StringIO(), stderr=io.StringIO())
    assert err.getvalue() == ""

"""Review: the BUZZ_AGENTS layer goes to the intake function as ``integer`` parameters
(``%(default_max_timeout_seconds)s::integer``...), where policy.bounded took any int. A setting
beyond int4 (MAX_TIMEOUT_SECONDS = 2**31, ~68 years, unvalidated by agents.conf) made a run with
that deadline before; the function refuses the intake with a DataError naming no field."""

from __future__ import annotations

import uuid

import pytest
from django.test import override_settings

from buzz_delivery.agents.services import Created, intake_event
from tests.agents_support import AGENT

pytestmark = pytest.mark.django_db


def test_a_large_timeout_setting_still_takes_intakes(community):
    with override_settings(BUZZ_AGENTS={"MAX_TIMEOUT_SECONDS": 2**31}):
        assert isinstance(intake_event(community.id, "t", uuid.uuid4().hex, {}, AGENT), Created)

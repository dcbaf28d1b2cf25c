"""The communities a multi-community worker leaves after a lock wait, and the renewal order after one."""

from __future__ import annotations

import uuid

from buzz_delivery.lockwaits import Skipped, tried_last


def test_a_skipped_community_waits_its_time_then_is_forgotten():
    a, b = uuid.uuid4(), uuid.uuid4()
    skipped = Skipped(60.0)
    assert not skipped and skipped.next_try() is None and not skipped.waits(a)
    skipped.skip(a)
    assert skipped and skipped.waits(a) and not skipped.waits(b)
    assert 0 < skipped.next_try() <= 60.0
    over = Skipped(0.0)
    over.skip(a)
    assert not over.waits(a)  # its time is over: tried again
    over.skip(b)
    assert over.next_try() is None and not over  # forgotten, not a busy loop at 0 s


def test_a_renewal_that_waited_goes_last_and_a_released_one_stays_released():
    held = {"locked": 1, "free": 2, "other": 3}
    tried_last(held, "locked")
    assert list(held) == ["free", "other", "locked"]
    tried_last(held, "gone")  # released meanwhile: nothing comes back
    assert held == {"free": 2, "other": 3, "locked": 1}

"""``Settler.put`` notifies the settler only when it waits: a waiting settler still wakes.

``put`` appends to the queue under its mutex and skips the condition's notify when nothing
waits on it (the settler is busy settling the last batch: the common case, one put a
delivery). A settler blocked for its first result, or lingering for more, must still be woken
by the next put: without the notify, its untimed wait would last until some later put that
never comes (a drain's last results left unsettled, their leases to lapse).
"""

from __future__ import annotations

import threading
import time

from buzz_delivery.worker.settler import Settler, next_batch

WAIT = 30.0  # generous bound on what must happen at once


def _settler() -> Settler:
    return Settler(max_batch=10, linger=60.0, lease_seconds=30, count=lambda *_: None, done=lambda _: None)


def _waiting(settler: Settler) -> bool:
    with settler._queue.mutex:
        return bool(settler._queue.not_empty._waiters)  # type: ignore[attr-defined]


def _until(predicate: object, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_a_put_wakes_a_settler_blocked_for_its_first_result() -> None:
    settler = _settler()
    got: list[tuple[list[object], bool]] = []
    thread = threading.Thread(target=lambda: got.append(next_batch(settler._queue, 1, 0.0)), daemon=True)
    thread.start()
    _until(lambda: _waiting(settler), "the gather never waited")
    settler.put("job")  # type: ignore[arg-type]
    thread.join(WAIT)
    woke = not thread.is_alive()
    if not woke:
        settler.close()  # let the wait go
        thread.join(5)
    assert woke, "a put did not wake the settler waiting for its first result"
    assert got == [(["job"], False)]


def test_a_put_wakes_a_lingering_settler_and_joins_its_batch() -> None:
    settler = _settler()
    settler.put("first")  # type: ignore[arg-type]
    got: list[tuple[list[object], bool]] = []
    # A batch of two, lingering up to a minute for the second: the put must end the linger.
    thread = threading.Thread(target=lambda: got.append(next_batch(settler._queue, 2, 60.0)), daemon=True)
    thread.start()
    _until(lambda: _waiting(settler), "the gather never lingered")
    settler.put("second")  # type: ignore[arg-type]
    thread.join(WAIT)
    woke = not thread.is_alive()
    if not woke:
        settler.close()
        thread.join(5)
    assert woke, "a put did not end the settler's linger"
    assert got == [(["first", "second"], False)]


def test_puts_while_nothing_waits_are_taken_in_order_by_the_next_gather() -> None:
    settler = _settler()
    for i in range(5):
        settler.put(i)  # type: ignore[arg-type]
    settler.close()
    assert next_batch(settler._queue, 10, 0.0) == ([0, 1, 2, 3, 4], True)

"""The settler's wait for more results ends by its deadline, whatever the queue's state.

On CPython 3.11 ``queue.SimpleQueue.get(timeout=t)`` on an empty queue whose lock was left free
(a put that woke a waiter, the item then taken: the settler's usual state) takes that lock at
once and computes what is left of ``t`` again, without clamping it; when the thread was
preempted in between for longer than what was left, that is negative, and the wait that
follows has no timeout at all: until the next put. The settler lingers in exactly such waits,
with what is left of its linger as ``t``; a batch held that way at the end of a burst was
settled only when more work came, or not before the drain gave up (its leases left to lapse,
the deliveries run again). The remote worker's settlers met it in test_work_pipelining.

Preemption cannot be arranged, so the test makes the linger short (10 µs, where a few thousand
gathers met it on this machine, every time) and gathers many times on a thread that must end.
"""

from __future__ import annotations

import threading

from buzz_delivery.worker.settler import Settler, next_batch

GATHERS = 20_000
LINGER = 1e-5


def test_short_lingers_end_by_their_deadline_and_never_wait_for_the_next_result():
    source = Settler(max_batch=10, linger=LINGER, lease_seconds=30, count=lambda *_: None, done=lambda _: None)._queue
    gathered: list[int] = []

    def gather() -> None:
        for i in range(GATHERS):
            source.put(i)
            items, closed = next_batch(source, 10, LINGER)
            assert (items, closed) == ([i], False)
            gathered.append(i)

    thread = threading.Thread(target=gather, daemon=True)
    thread.start()
    thread.join(30)
    stuck = thread.is_alive()
    if stuck:
        source.put(None)  # let the endless wait go (the thread then fails its own assert)
        thread.join(5)
    assert not stuck, f"a linger waited for the next result instead of its deadline, after {len(gathered)} gathers"
    assert len(gathered) == GATHERS

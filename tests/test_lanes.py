"""LaneRunner: per-lane order, inline runs on idle lanes, queueing behind them."""

from __future__ import annotations

import threading
import time

from jaxcolo.process.lanes import LaneRunner


def test_try_inline_runs_in_the_calling_thread_and_queues_later_work():
    lanes = LaneRunner("test-lane")
    order, threads = [], []
    release = threading.Event()
    done = threading.Event()

    def first():
        threads.append(threading.current_thread())
        order.append(1)
        # Work submitted to this lane while it runs must queue behind it.
        lanes.submit("a", lambda: order.append(2))
        lanes.submit("a", lambda: (order.append(3), done.set()))
        assert not lanes.try_inline("a", lambda: order.append("never"))
        assert lanes.try_inline("b", lambda: order.append("b"))  # other lane
        release.wait(5)
        order.append(1.5)

    t = threading.Thread(target=lambda: lanes.try_inline("a", first))
    t.start()
    time.sleep(0.05)
    assert order == [1, "b"]  # lane a is still running its inline task
    release.set()
    t.join(5)
    assert done.wait(5)
    assert order == [1, "b", 1.5, 2, 3]
    assert threads == [t]
    # The lane is idle again: the next task runs inline.
    ran = []
    assert lanes.try_inline("a", lambda: ran.append(threading.current_thread()))
    assert ran == [threading.current_thread()]
    lanes.close()
    assert not lanes.try_inline("c", lambda: None)  # closed

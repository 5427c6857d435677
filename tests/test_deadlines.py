"""The executor's deadline thread: expiries, weakly held checks, and a
failing callback that must not end the thread (every later timeout would
silently never fire)."""

import gc
import threading
import time
from concurrent.futures import Future

from jaxcolo.process.deadlines import Deadlines


class _Call:
    def __init__(self):
        self.future = Future()


def _wait_for(event: threading.Event) -> bool:
    return event.wait(5)


def test_a_failing_check_does_not_stop_later_timeouts():
    expired, checked = threading.Event(), []

    def on_check(obj):
        checked.append(obj)
        raise RuntimeError("a check that fails")

    d = Deadlines(lambda call, s: expired.set(), on_check)
    try:
        first = _Call()
        d.check(first, 0.01)
        time.sleep(0.1)
        assert checked == [first]
        d.add(_Call(), 0.05)
        assert _wait_for(expired)
    finally:
        d.close()


def test_checks_hold_their_object_weakly_and_done_calls_never_expire():
    expired, checked = [], []
    d = Deadlines(lambda call, s: expired.append(call), checked.append)
    try:
        gone, kept, done = _Call(), _Call(), _Call()
        d.check(gone, 0.05)
        d.check(kept, 0.05)
        d.add(done, 0.05)
        done.future.set_result(1)
        del gone
        gc.collect()
        time.sleep(0.3)
        assert checked == [kept] and expired == []
    finally:
        d.close()

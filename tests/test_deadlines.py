"""The executor's deadline thread: expiries, weakly held checks, and a
failing callback that must not end the thread (every later timeout would
silently never fire)."""

import gc
import threading
from concurrent.futures import Future

from jaxcolo.process.deadlines import Deadlines


class _Call:
    def __init__(self):
        self.future = Future()


def _wait_for(event: threading.Event) -> bool:
    return event.wait(5)


def test_a_failing_check_does_not_stop_later_timeouts():
    expired, checked = threading.Event(), []

    ran = threading.Event()

    def on_check(obj):
        checked.append(obj)
        ran.set()
        raise RuntimeError("a check that fails")

    d = Deadlines(lambda call, s: expired.set(), on_check)
    try:
        first = _Call()
        d.check(first, 0.01)
        assert _wait_for(ran) and checked == [first]
        d.add(_Call(), 0.05)
        assert _wait_for(expired)
    finally:
        d.close()


def test_checks_hold_their_object_weakly_and_done_calls_never_expire():
    expired, checked = [], []
    marker = threading.Event()  # a later deadline: the earlier ones are
    d = Deadlines(lambda call, s: expired.append(call),  # past when it runs
                  lambda obj: marker.set() if obj is last else
                  checked.append(obj))
    try:
        gone, kept, done, last = _Call(), _Call(), _Call(), _Call()
        d.check(gone, 0.05)
        d.check(kept, 0.05)
        d.add(done, 0.05)
        done.future.set_result(1)
        del gone
        gc.collect()
        d.check(last, 0.3)
        assert _wait_for(marker)
        assert checked == [kept] and expired == []
    finally:
        d.close()

"""LaneRunner: per-lane order, inline runs on idle lanes, queueing behind them."""

from __future__ import annotations

import threading

from jaxcolo.process.lanes import HoldingGate, LaneRunner


def test_try_inline_runs_in_the_calling_thread_and_queues_later_work():
    lanes = LaneRunner("test-lane")
    order, threads = [], []
    release = threading.Event()
    done = threading.Event()
    waiting = threading.Event()  # first() got to its wait

    def first():
        threads.append(threading.current_thread())
        order.append(1)
        # Work submitted to this lane while it runs must queue behind it.
        lanes.submit("a", lambda: order.append(2))
        lanes.submit("a", lambda: (order.append(3), done.set()))
        assert not lanes.try_inline("a", lambda: order.append("never"))
        assert lanes.try_inline("b", lambda: order.append("b"))  # other lane
        waiting.set()
        release.wait(5)
        order.append(1.5)

    t = threading.Thread(target=lambda: lanes.try_inline("a", first))
    t.start()
    assert waiting.wait(5)
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


def _enter_in_thread(gate, ticket):
    entered = threading.Event()
    t = threading.Thread(target=lambda: (gate.enter(ticket), entered.set()),
                         daemon=True)
    t.start()
    return entered


def test_holding_gate_keeps_a_failed_calls_turn_until_resumed():
    gate = HoldingGate(True)
    t0, t1, t2 = gate.ticket(), gate.ticket(), gate.ticket()
    gate.enter(t0)
    gate.end_turn(10, failed=True)          # held
    second = _enter_in_thread(gate, t1)
    assert not second.wait(0.2)
    assert not gate.resume(99)              # not held: refused
    assert gate.resume(10)
    assert second.wait(5)
    # the resume of a call whose turn has not come yet arrives first
    gate.expect_hold(11)
    assert gate.resume(11)
    gate.end_turn(11, failed=True)          # passes on at once
    assert _enter_in_thread(gate, t2).wait(5)
    assert not gate.resume(11)              # only once


def test_gate_without_holding_passes_failed_turns_on():
    gate = HoldingGate(False)
    t0, t1 = gate.ticket(), gate.ticket()
    gate.enter(t0)
    gate.expect_hold(5)
    gate.end_turn(5, failed=True)
    assert _enter_in_thread(gate, t1).wait(5)
    assert not gate.resume(5)


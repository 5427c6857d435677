"""jaxcolo.codec.counted: work counted in a helper thread and stopped."""

import cProfile
import sys
import time

import jax
import numpy as np
import pytest
from jax import export

import jaxcolo
from jaxcolo.codec import memo
from jaxcolo.codec.counted import OutOfBudget, run_counted


def _calls(n):
    for _ in range(n):
        abs(1)


def test_counts_and_returns():
    out, events = run_counted(lambda: (_calls(100), "done")[1], 10_000)
    assert out == "done" and 200 <= events < 1000


def test_errors_come_back_as_they_are():
    with pytest.raises(KeyError, match="x"):
        run_counted(lambda: {}["x"], 10_000)


def _swallowing_runaway():
    try:
        while True:
            _calls(10)
    except:  # noqa: E722 - what some library code does
        pass
    end = time.monotonic() + 60
    while time.monotonic() < end:
        pass
    return "finished"


def test_a_stop_swallowed_by_a_bare_except_is_sent_again():
    """CPython drops a profile function that raised; code that swallows
    the stop and runs on uncounted is stopped from outside."""
    t0 = time.monotonic()
    with pytest.raises(OutOfBudget):
        run_counted(_swallowing_runaway, 1000)
    assert time.monotonic() - t0 < 10


def test_the_callers_profiler_is_left_alone():
    """Constrained symbolic dims are encoded and decoded under cProfile
    (a C-level profiler) and under a Python-level profile function, which
    stay installed."""
    (a, b) = export.symbolic_shape("a, b", constraints=("a >= b + 2",))
    x = jax.ShapeDtypeStruct((a, b), np.float32)
    profiler = cProfile.Profile()
    memo.clear()  # encoded and decoded here, not remembered
    profiler.enable()
    try:
        assert jaxcolo.deserialize(jaxcolo.serialize(x)) == x
        assert sys.getprofile() is profiler
    finally:
        profiler.disable()
    seen = []
    memo.clear()
    sys.setprofile(lambda frame, event, arg: seen.append(event))
    try:
        assert jaxcolo.deserialize(jaxcolo.serialize(x)) == x
        assert sys.getprofile() is not None
    finally:
        sys.setprofile(None)
    assert seen


def test_a_swallowed_stop_is_sent_again_in_the_helper_thread_too():
    """With a profiler in the caller, the work runs in a helper thread:
    the stop is sent again there."""
    profiler = cProfile.Profile()
    t0 = time.monotonic()
    profiler.enable()
    try:
        with pytest.raises(OutOfBudget):
            run_counted(_swallowing_runaway, 1000)
    finally:
        profiler.disable()
    assert time.monotonic() - t0 < 10


def test_an_interrupt_of_the_caller_stops_the_work():
    import _thread
    import threading
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_counted(lambda: _calls(10**8), 10**12)
    assert time.monotonic() - t0 < 10

"""Shared fixtures and helpers of the colocated tests.

``executor`` is parametrised over EXECUTORS: every colocated behaviour test
runs against each executor kind.  A new executor (e.g. a process executor)
adds an entry here instead of copying tests.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxcolo
from jaxcolo.colocated.inline import InlineExecutor
from jaxcolo.colocated.program import read_program

# name -> factory; each factory returns a fresh executor.
EXECUTORS = {
    "inline": InlineExecutor,
}


@pytest.fixture(params=sorted(EXECUTORS), scope="module")
def executor(request):
    """An executor, installed with use_executor for the test module."""
    ex = EXECUTORS[request.param]()
    with ex, jaxcolo.use_executor(ex):
        yield ex


def cpu_devices():
    return jaxcolo.colocated_cpu_devices(jax.local_devices())


def put(value, where):
    """device_put onto a device or a sharding."""
    return jax.device_put(np.asarray(value) if not isinstance(value, list)
                          else value, where)


def signatures(fn) -> int:
    """Distinct input signatures ``fn`` has built programs for."""
    return len({read_program(p.payload).in_specs
                for p in fn.programs()})

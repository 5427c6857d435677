"""The release bookkeeping of dropped executors (jaxcolo.process.lifetime)
under garbage collection, with plain objects standing for executors (an
empty ``Owned`` has nothing to shut down) so that thousands can die."""

import os
import subprocess
import sys

_FINALIZERS_DURING_COLLECTIONS = """
import faulthandler, sys, threading
sys.path[:0] = sys.argv[1:]
from jaxcolo.process import lifetime
faulthandler.dump_traceback_later(60, exit=True)

class Holder:
    pass

def drop_many():
    for _ in range(20000):
        c = Holder()
        c.me = c  # dies in a cycle: a collection runs its finalizer
        lifetime.finalizer(c, lifetime.Owned())
        del c
        a = Holder()  # dies by reference counting, on this thread
        lifetime.finalizer(a, lifetime.Owned())
        del a

t = threading.Thread(target=drop_many, daemon=True)  # as a reader thread
t.start()
t.join(50)
import gc
gc.collect()
print("stuck" if t.is_alive() else "done", len(lifetime._LIVE), flush=True)
"""


def test_finalizers_run_by_collections_inside_releases_do_not_deadlock():
    """A release on a thread other than the main one started a thread
    under the bookkeeping lock; a collection started by those allocations
    ran another dropped executor's finalizer, which waited for the same
    lock (or for the threading module's own, in the new thread): the
    thread hung (4 runs in 4)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", _FINALIZERS_DURING_COLLECTIONS, root,
         os.path.join(root, "generated")], capture_output=True, text=True,
        timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["done", "0"], out.stderr[-3000:]

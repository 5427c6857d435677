"""The out-of-process executor: workers in other processes (or machines).

Modules, one job each:

* ``messages``   -- the ``message`` payloads controller and workers exchange;
* ``arrays``     -- jax.Array shards <-> message buffers (no pickle);
* ``worker``     -- the worker side: sessions, lanes, running programs;
* ``runtime``    -- worker process start-up (XLA flags, jax.distributed,
                    the device map) and the ``jaxcolo worker`` command;
* ``hosts``      -- the controller's connection to one worker (a host);
* ``launch``     -- starting local worker processes;
* ``controller`` -- ``ProcessExecutor``.

Shared memory lives in ``jaxcolo.transport.blobs``.
"""

_LAZY = {"ProcessExecutor": "jaxcolo.process.controller"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(
            f"module 'jaxcolo.process' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

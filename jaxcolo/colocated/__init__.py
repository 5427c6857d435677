"""Colocated Python on jaxcolo payloads (drop-in for
``jax.experimental.colocated_python``).

Modules, one job each:

* ``function``  -- ``colocated_python``: specialisation, caching, calls;
* ``objects``   -- ``colocated_python_class``: host-side instances;
* ``devices``   -- ``colocated_cpu_devices``;
* ``program``   -- the program payload codec (root kind ``program``);
* ``body``      -- pickling of function/class bodies (the only pickle);
* ``specs``     -- argument/result specs and device checks;
* ``cache``     -- fast/slow single-flight specialisation cache;
* ``executor``  -- the Executor interface, ``use_executor``, the default;
* ``inline``    -- ``InlineExecutor``.

Attributes load lazily so that importing the package (which
``jaxcolo.payload`` does for the program codec) stays cheap.
"""

_LAZY = {
    "colocated_python": "jaxcolo.colocated.function",
    "ColocatedFunction": "jaxcolo.colocated.function",
    "colocated_python_class": "jaxcolo.colocated.objects",
    "colocated_cpu_devices": "jaxcolo.colocated.devices",
    "Executor": "jaxcolo.colocated.executor",
    "use_executor": "jaxcolo.colocated.executor",
    "get_executor": "jaxcolo.colocated.executor",
    "default_executor": "jaxcolo.colocated.executor",
    "InlineExecutor": "jaxcolo.colocated.inline",
    "Program": "jaxcolo.colocated.program",
    "ProgramRef": "jaxcolo.colocated.program",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(
            f"module 'jaxcolo.colocated' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

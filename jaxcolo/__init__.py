"""jaxcolo: versioned flatbuffer payloads for JAX specs, and a colocated-Python
executor whose programs and specs travel as those payloads.

Importing ``jaxcolo`` does not import JAX; the codec (and JAX) load on first
use of an attribute that needs them, so a CLI or worker can configure XLA
(e.g. ``XLA_FLAGS``) first.
"""

from jaxcolo.errors import EncodeError, ExecutorError, HostWedgedError, \
    PayloadError, UnavailableHereError, UnknownDeviceError, UnregisteredError, \
    VersionError
from jaxcolo.versions import MIN_READABLE_VERSION, SCHEMA_VERSION

_LAZY = {
    "serialize": ("jaxcolo.payload", "serialize"),
    "deserialize": ("jaxcolo.payload", "deserialize"),
    "inspect": ("jaxcolo.inspection", "inspect"),
    "register_effect": ("jaxcolo.codec.effects", "register_effect"),
    "register_default_factory": ("jaxcolo.codec.names",
                                 "register_default_factory"),
    "colocated_python": ("jaxcolo.colocated.function", "colocated_python"),
    "colocated_python_class": ("jaxcolo.colocated.objects",
                               "colocated_python_class"),
    "colocated_cpu_devices": ("jaxcolo.colocated.devices",
                              "colocated_cpu_devices"),
    "Executor": ("jaxcolo.colocated.executor", "Executor"),
    "InlineExecutor": ("jaxcolo.colocated.inline", "InlineExecutor"),
    "ProcessExecutor": ("jaxcolo.process.controller", "ProcessExecutor"),
    "use_executor": ("jaxcolo.colocated.executor", "use_executor"),
    "get_executor": ("jaxcolo.colocated.executor", "get_executor"),
}

__all__ = [
    "serialize", "deserialize", "inspect", "SCHEMA_VERSION",
    "MIN_READABLE_VERSION", "PayloadError", "VersionError", "EncodeError",
    "ExecutorError", "HostWedgedError", "UnavailableHereError",
    "UnknownDeviceError", "UnregisteredError", "register_effect",
    "register_default_factory", "colocated_python",
    "colocated_python_class", "colocated_cpu_devices", "Executor",
    "InlineExecutor", "ProcessExecutor", "use_executor", "get_executor",
]


def __getattr__(name):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'jaxcolo' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

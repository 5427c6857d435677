"""jaxcolo: versioned flatbuffer payloads for JAX specs, and a colocated-Python
executor whose programs and specs travel as those payloads."""

from jaxcolo.errors import EncodeError, ExecutorError, PayloadError, VersionError
from jaxcolo.versions import MIN_READABLE_VERSION, SCHEMA_VERSION
from jaxcolo.payload import deserialize, serialize
from jaxcolo.codec.effects import register_effect
from jaxcolo.inspection import inspect

__all__ = [
    "serialize", "deserialize", "inspect", "SCHEMA_VERSION",
    "MIN_READABLE_VERSION", "PayloadError", "VersionError", "EncodeError",
    "ExecutorError", "register_effect",
]

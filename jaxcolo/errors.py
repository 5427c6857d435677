"""The exception family of jaxcolo.

Contract: every malformed or unreadable payload raises :class:`PayloadError`
(a ``ValueError``) whose message names the field path (``$.meshes[0].device_ids``)
and the reason; payloads that are well formed but of an unsupported version
raise :class:`VersionError`.  Objects that cannot be serialized (at all, or at
the requested version) raise :class:`EncodeError`.
"""

from __future__ import annotations


class PayloadError(ValueError):
    """Malformed, corrupt or unreadable payload bytes."""

    def __init__(self, reason: str, path: str = "$"):
        self.reason = reason
        self.path = path
        super().__init__(f"{reason} - at {path}")

    def __reduce__(self):  # pickles (executor errors) as (reason, path)
        return type(self), (self.reason, self.path), self.__dict__


class VersionError(PayloadError):
    """Readable bytes whose version this reader does not support."""


class EncodeError(ValueError):
    """An object that cannot be serialized (at the requested version)."""

    def __init__(self, reason: str, path: str = "$"):
        self.reason = reason
        self.path = path
        super().__init__(f"{reason} - at {path}")

    def __reduce__(self):
        return type(self), (self.reason, self.path), self.__dict__


class ExecutorError(RuntimeError):
    """Executor-side failure: worker lost, timeout, executor closed."""

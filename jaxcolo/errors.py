"""The exception family of jaxcolo.

Contract: every malformed or unreadable payload raises :class:`PayloadError`
(a ``ValueError``) whose message names the field path (``$.meshes[0].device_ids``)
and the reason; payloads that are well formed but of an unsupported version
raise :class:`VersionError`.  Objects that cannot be serialized (at all, or at
the requested version) raise :class:`EncodeError`.
"""

from __future__ import annotations

import functools
import struct


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


class UnavailableHereError(PayloadError):
    """A well-formed payload naming something this process does not have
    (the payload may read fine in another process): see the subclasses."""


class UnknownDeviceError(UnavailableHereError):
    """A well-formed payload naming a device id the resolver does not know
    (the payload may be fine on another process)."""


class UnregisteredError(UnavailableHereError):
    """A well-formed payload naming a type this process has not registered:
    a custom pytree node or namedtuple, a defaultdict's default_factory,
    an effect, a PRNG impl."""


# Exceptions that mean "the bytes are malformed" if one ever escapes a
# decoder despite its checks: reported as PayloadError, never leaked.
MALFORMED = (IndexError, KeyError, struct.error, UnicodeDecodeError,
             TypeError, OverflowError, RecursionError, MemoryError,
             AssertionError, AttributeError, ValueError, StopIteration)


def reports_malformed(fn):
    """Decorate a decoder so that only PayloadError comes out of it."""
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PayloadError:
            raise
        except MALFORMED as e:
            raise PayloadError(
                f"malformed payload ({type(e).__name__}: {e})", "$") from None
    return checked


class EncodeError(ValueError):
    """An object that cannot be serialized (at the requested version)."""

    def __init__(self, reason: str, path: str = "$"):
        self.reason = reason
        self.path = path
        super().__init__(f"{reason} - at {path}")

    def __reduce__(self):
        return type(self), (self.reason, self.path), self.__dict__

    def under(self, prefix: str) -> EncodeError:
        """This error with its path ("$...", relative to the part being
        built) re-rooted at ``prefix``."""
        return EncodeError(self.reason, prefix + self.path[1:])


class ExecutorError(RuntimeError):
    """Executor-side failure: worker lost, timeout, executor closed."""


class ConnectionLost(ExecutorError):
    """A message could not be written: the connection to the peer is gone
    (the executor then declares that worker lost)."""


class HostWedgedError(ExecutorError):
    """A worker refuses multi-host calls: a multi-host call of a controller
    it served before may have left its collectives out of step with the
    other hosts' (restart every worker process of the cluster)."""

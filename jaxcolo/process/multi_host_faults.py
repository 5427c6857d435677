"""What the controller reads from a multi-host call's error replies, and the
resumes it sends once every host is done with a failed one.

* :func:`collectives_broke`: a part failed in its gloo collectives (CPU
  clusters' collectives are gloo's), e.g. gloo's setup gave up waiting for a
  host that never came: that host set up state its peers did not, so their
  next collectives would pair wrongly (the cluster restarts; running
  workers are marked wedged).
* :data:`WEDGED_ERROR`: the error type of a worker refusing multi-host
  calls (:mod:`jaxcolo.process.wedge`).
* :func:`send_resumes`: ``resume`` messages to the hosts holding after a
  failed multi-host call.
"""

from __future__ import annotations

import logging

from jaxcolo.errors import ExecutorError, HostWedgedError
from jaxcolo.process.messages import Message, MessageKind

log = logging.getLogger("jaxcolo.executor")

# Errors XLA raises for a failed execution (jax.errors, older jaxlibs).
_RUNTIME_ERRORS = ("jax.errors.JaxRuntimeError",
                   "jaxlib.xla_extension.XlaRuntimeError",
                   "jaxlib._jax.XlaRuntimeError")

WEDGED_ERROR = f"{HostWedgedError.__module__}.{HostWedgedError.__qualname__}"


def collectives_broke(m: Message) -> bool:
    """Error reply ``m`` is a gloo collective's failure."""
    return m.error_type in _RUNTIME_ERRORS and \
        "gloo" in (m.error_message or "").lower()


def send_resumes(resume) -> None:
    """Send ``resume`` for each (call id, link) of ``resume``."""
    for cid, held in resume:
        try:
            held.send(Message(MessageKind.resume, call_id=cid))
        except ExecutorError as e:  # lost: nothing to resume there
            log.info("%s: resume not sent: %s", held.describe, e)

"""Sending a call's parts to its hosts (a part of ``ProcessExecutor``).

:class:`CallSending` packs a call's input shards for each host that runs it
and sends the call message.  Multi-host calls go out in one executor-wide
order (``_ordered_lock``), so every host meets their collectives in the same
order.  A call's timeout covers its sends: a send that has not begun by the
deadline (another send holds the connection) fails the call with nothing
sent; one still being written then goes on in the background (frames are
never left half-sent) and the call times out.  A multi-host call with a
timeout is sent by a thread the caller waits for until the deadline, and
all of its hosts get it, also late: a part that reached only some of them
would strand those in its collectives.

It uses the executor's ``_lock``, ``_ids``, ``_pending``, ``_stats``,
``_instances``, ``_ordered_lock``, ``_closed``; a mixin, like HostSet.
"""

from __future__ import annotations

import threading

from jaxcolo.colocated.futures import executor_thread
from jaxcolo.errors import ConnectionLost, ExecutorError
from jaxcolo.process import messages, packing, templates
from jaxcolo.process.stragglers import RESUME_SINCE
from jaxcolo.process.hosts import HostLink
from jaxcolo.process.results import Call
from jaxcolo.transport import interrupts
from jaxcolo.transport.writer import SendDeadline, seconds_until


class CallSending:
    def _dispatch(self, call: Call, args, lane_id: int, limit) -> None:
        """Send ``call`` to its hosts (``limit``: (deadline, seconds) or
        None).  Failures fail the call; a BaseException (Ctrl-C) after a
        part went out is raised."""
        hosts = call.plan.hosts
        if len(hosts) == 1:
            h = hosts[0]
            link = self._links[h]
            try:
                if link.is_lost or not self._ready.is_set():
                    # (a deferred call's deadline may fire meanwhile)
                    call.waits_for = self._link_wait(h)
                    link = self._link(h, limit)
                    call.waits_for = None
            except ExecutorError as e:
                call.fail(e)
            else:
                self._send(h, link, call, args, lane_id, False, limit)
        elif limit is None:
            self._send_multi_host(call, args, lane_id)
        else:  # sends that outlast the deadline go on in the background
            self._send_multi_host_until(call, args, lane_id, limit)

    def _send_multi_host(self, call: Call, args, lane_id: int,
                         limit=None) -> None:
        """Send the parts of a multi-host call, in the executor-wide order
        of multi-host calls."""
        with self._ordered_lock:
            call.sending = True
            try:
                call.waits_for = ("an earlier multi-host call that failed "
                                  "on a host to be done on the others")
                self._wait_for_unheld_failures(call)
                if not self._hosts_can_hold(call.plan.hosts):
                    call.waits_for = ("the multi-host calls sent before it "
                                      "to be done on every host (a session "
                                      "before v7 runs one at a time)")
                    self._wait_for_earlier_multi_host(call)
                links = self._cluster_links(call.plan.hosts, call, limit)
                # Every host gets it, also after one failed it (that one
                # holds), unless a host cannot hold (v<7)
                holds = all(link.version >= RESUME_SINCE for _, link in links)
                for h, link in links:
                    if call.send_broken or call.abandoned:
                        break
                    if call.timed_out:  # sent to all its hosts, or to none
                        if not call.sent_parts:
                            break
                    elif call.future.done() and not holds:
                        break  # failed on a host that cannot hold
                    self._send(h, link, call, args, lane_id, True)
            finally:
                self._note_multi_host_sent(call)
                self._sent_multi_host(call)

    def _send_multi_host_until(self, call: Call, args, lane_id: int,
                               limit) -> None:
        """``_send_multi_host`` in a thread, waited for until the call's
        deadline: a send still going on then (a host not reading, another
        call's sends ahead of it) finishes in the background, and all of
        the call's hosts get it (a part that reached only some of them
        would strand those in its collectives); the call times out."""
        done = threading.Event()
        call.waits_for = "the sends of earlier multi-host calls"

        def send() -> None:
            try:  # callbacks of calls failed here run on their own thread
                with executor_thread():
                    self._send_multi_host(call, args, lane_id, limit)
            except BaseException as e:  # noqa: BLE001 - the call reports it
                call.fail(e)
            finally:
                done.set()
        threading.Thread(target=send, daemon=True,
                         name="jaxcolo-multi-host-send").start()
        done.wait(seconds_until(limit[0]))

    def _send(self, h: int, link: HostLink, call: Call, args, lane_id: int,
              ordered: bool, limit=None) -> None:
        """Send part ``h`` of ``call``.  ``limit`` (deadline, seconds):
        a send not begun by then fails the call with a timeout (nothing
        was sent); one partly written goes on in the background (the call
        then times out when its deadline is checked)."""
        plan = call.plan
        call_id = next(self._ids)
        with self._lock:  # (a call is failed after releasing it)
            if self._closed:
                error = ExecutorError("ProcessExecutor is closed")
            elif link.is_lost:
                error = ExecutorError(f"{link.describe} was lost before the "
                                      "call could be sent")
            else:
                error = None
                if plan.instance_id:
                    try:  # lost while this call waited for the restart
                        self._check_instance(plan)
                    except ExecutorError as e:
                        error = e
                    else:
                        self._instances.setdefault(plan.instance_id,
                                                   set()).add(h)
            if error is None and ordered and call.abandoned:
                return  # its hosts were lost meanwhile: not sent here
            if error is None:
                self._pending[call_id] = (call, h, link)
                call.call_ids.append(call_id)
                call.links.append((h, link))
        if error is not None:
            call.send_broken = True
            call.fail(error)
            return
        deadline = None if limit is None else limit[0]
        packer = None
        sent = registered = False
        try:
            link.ensure_registered(plan.ref, deadline)
            registered = True
            kind = (messages.MessageKind.discover if call.discover
                    else messages.MessageKind.call)
            devices = plan.host_devices[h]
            # every input in the message: its template, without a Packer
            inline = packing.inline_shards(args, devices)
            data = frames = key = None
            if inline is not None:
                key = (kind, link.version, plan.ref.id, ordered,
                       bool(lane_id), inline[0])
                data = templates.encode_inline(key, call_id, lane_id,
                                               inline[1])
                frames = ()
            if data is None:
                packer = packing.Packer(link.pool, deadline=deadline)
                for i, x in enumerate(args):
                    packer.add(i, x, devices)
                message = messages.Message(
                    kind, call_id=call_id, lane=lane_id,
                    program_id=plan.ref.id, shards=packer.finish(),
                    segments=packer.segments, ordered=ordered)
                data = messages.encode(message, link.version)
                frames = packer.frames
                if key is not None:  # the next such call takes the fast way
                    templates.remember_inline(key, message, link.version,
                                              inline[1])
            link.expect_reply()
            with interrupts.CRITICAL:  # Ctrl-C: after it is sent and known
                try:                   # to be (the reply is awaited, the
                    link.send_encoded(data, frames, deadline)  # worker
                except SendDeadline as e:              # returns the leases)
                    if not e.started:
                        link.expect_reply(-1)
                        raise
                sent = True  # sent, or its rest is being sent
                call.sent_parts += 1
        except SendDeadline:  # nothing of the call was sent
            self._timed_out_unsent(call, call_id, (
                f"{plan.name}: call timed out after {limit[1]}s before it "
                f"could be sent to {link.describe} (its connection was busy "
                "with earlier messages the worker had not read); it was "
                "not sent"))
        except packing.CopyDeadline as e:
            self._timed_out_unsent(call, call_id, (
                f"{plan.name}: call timed out after {limit[1]}s while its "
                f"inputs were copied into shared memory ({e}); it was not "
                "sent"))
        except ConnectionLost as e:  # the worker is gone: this call
            call.send_broken = True    # fails (not retried), later calls
            self._fail_pending(call_id, ExecutorError(  # wait for its
                f"{link.describe} was lost before the call could be sent "
                f"({e}); {'its part for that host' if ordered else 'it'} "
                "was not sent"))
            link.lost(f"{e} (sending a call)")  # restart
        except ExecutorError as e:
            call.send_broken = True
            self._fail_pending(call_id, ExecutorError(
                f"{link.describe}: could not send the call: {e}"))
        except BaseException as e:
            if sent:  # its reply comes; the call fails with e in _start
                raise
            if not registered:  # (Ctrl-C while registering its program)
                call.send_broken = True  # none of it went out: no part
                with self._lock:         # of it is pending (a stale
                    self._pending.pop(call_id, None)  # entry read as a
                raise  # part still running lost a multi-host call's hosts
            call.send_broken = True
            if link.is_lost:  # e.g. its segment pool closed under us
                e = ExecutorError(f"{link.describe} was lost while the call "
                                  f"was being sent ({e!r})")
            self._fail_pending(call_id, e)
        finally:
            if not sent and packer is not None and not link.is_lost:
                packer.abandon()  # never sent: its leases come back

    def _timed_out_unsent(self, call: Call, call_id, message: str) -> None:
        """Part ``call_id`` of ``call`` timed out before any of it was sent."""
        call.send_broken = True
        with self._lock:
            self._stats["timeouts"] += 1
        self._fail_pending(call_id, ExecutorError(message))

    def _fail_pending(self, call_id, error) -> None:
        with self._lock:
            entry = self._pending.pop(call_id, None)
        if entry is not None:
            entry[0].fail(error)


"""The controller's view of a program (:class:`Plan`) and of one call in
flight (:class:`Call`): which hosts run it, and how their replies become
the call's result.

A Plan is made once per program content id: the program decoded against
the executor's own devices (a device no host owns is a PayloadError naming
the id), the hosts owning its devices, the devices each host gets shards
for, and the layouts of its outputs.

A Call completes when every host it was sent to replied: an ``error`` reply
fails it at once (with the re-raised remote exception; a multi-host part
that failed in the hosts' collectives, an executor event -- a host was
lost or gave up, the cluster restarts -- with an ExecutorError caused by
it); otherwise the last ``result`` assembles the outputs from every host's
shards.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import jax
from jax._src import tree_util as jtu

from jaxcolo import envelope
from jaxcolo.codec import spec_tree
from jaxcolo.colocated import specs as specs_mod
from jaxcolo.colocated.futures import CallFuture
from jaxcolo.errors import ExecutorError, PayloadError
from jaxcolo.process import arrays
from jaxcolo.process.multi_host_faults import collectives_broke
from jaxcolo_fb import MessageKind

class Plan:
    __slots__ = ("ref", "program", "name", "instance_id", "hosts",
                 "host_devices", "in_leaves", "out_layouts", "check_args")

    def __init__(self, ref, program, owner: dict):
        self.ref = ref
        self.program = program
        self.name = program.name
        self.instance_id = program.instance_id if program.kind == "method" \
            else 0
        by_host: dict = {}
        for d in program.devices:
            by_host.setdefault(owner[d.id], set()).add(d)
        self.hosts = tuple(sorted(by_host))
        self.host_devices = by_host
        self.in_leaves = tuple(program.in_leaves)
        # ValueError unless a call's arrays match the in_specs (every call)
        self.check_args = specs_mod.ArgCheck(self.name, self.in_leaves)
        self.out_layouts = None
        if program.has_out_specs:
            self.out_layouts = [arrays.Layout(s, False) for s in
                                jtu.tree_leaves(program.out_specs)]


class Call:
    """One call in flight; ``future`` gets its result."""

    __slots__ = ("plan", "discover", "future", "call_ids", "links", "_parts",
                 "_remaining", "_lock", "_make_error", "_assembling", "held",
                 "abandoned", "sending", "sent_parts", "watched",
                 "send_broken", "timed_out", "settled", "_when_settled",
                 "program", "waits_for",
                 "_settle_lock", "__weakref__")

    def __init__(self, plan: Plan, discover: bool, make_error):
        self.plan = plan
        self.discover = discover
        self.future = CallFuture()
        self.future.set_running_or_notify_cancel()
        self.call_ids: list = []
        self.links: list = []        # (host, HostLink) it was sent to
        self._parts: dict = {}
        self._remaining = len(plan.hosts)
        self._lock = threading.Lock()
        self._make_error = make_error
        self._assembling = False  # buffers of _parts may have views now
        # multi-host: (call id, link) of hosts whose part failed and that
        # hold their next multi-host calls until resumed (the executor's)
        self.held: list = []
        self.abandoned = False  # its stragglers were lost: never resume
        # the caller's ProgramRef: counted alive (not forgotten) meanwhile
        self.program = None
        self.sending = False    # the executor is still sending its parts
        # what its send waits for, if not its thread's earlier calls (the
        # lane order): named if it times out before it was sent
        self.waits_for: str | None = None
        self.sent_parts = 0     # parts that went out
        self.watched = False    # a straggler check is scheduled
        self.send_broken = False  # a part could not be sent
        self.timed_out = False    # failed at its deadline
        self.settled = False      # multi-host: its thread may go on
        self._when_settled: list = []
        # (not _lock: the future completes under that, running settle)
        self._settle_lock = threading.Lock()

    def when_settled(self, fn) -> None:
        """Call ``fn()`` once the call no longer holds up its thread's next
        calls: when its future is done (single-host), or (multi-host) when
        also every part was sent and none runs any more, unless it timed
        out (see ``settle``)."""
        if len(self.plan.hosts) == 1:
            # Future's own method: runs inline in the thread completing it
            Future.add_done_callback(self.future, lambda _: fn())
            return
        with self._settle_lock:
            if not self.settled:
                self._when_settled.append(fn)
                return
        fn()

    def settle(self) -> None:
        """(Multi-host; the executor decides when.)  Run the when_settled
        hooks, once."""
        with self._settle_lock:
            if self.settled:
                return
            self.settled = True
            hooks, self._when_settled = self._when_settled, []
        for fn in hooks:
            fn()

    def wait(self):
        return self.future.result()

    def has_part(self, h: int) -> bool:
        """Host ``h`` replied with a result."""
        return h in self._parts

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.future.done():
                return
            self.future.set_exception(error)
            unused = ()
            if not self._assembling:
                unused = list(self._parts.values())
                self._parts.clear()
        for m, _, link in unused:  # results of other hosts, never viewed
            link.release_unused(m)

    def part_done(self, h: int, link, m, get) -> bool:
        """Take host ``h``'s reply; False if it is dropped unused (the call
        already failed)."""
        if m.kind == MessageKind.error:
            try:
                error = self._make_error(link, m)
            except BaseException as e:  # noqa: BLE001 - never lose the call
                error = ExecutorError(f"{m.error_type}: {m.error_message} "
                                      f"(the error could not be rebuilt: "
                                      f"{e!r})")
            if len(self.plan.hosts) > 1 and collectives_broke(m):
                error = self._collectives_error(h, m, error)
            self.fail(error)
            return True
        with self._lock:
            if self.future.done():
                return False
            self._parts[h] = (m, get, link)
            self._remaining -= 1
            last = self._remaining == 0
            if last:
                self._assembling = True
        if not last:
            return True
        try:
            result = self._assemble()
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            self.fail(e)
            return True
        with self._lock:
            if not self.future.done():
                self.future.set_result(result)
        return True

    def _collectives_error(self, h: int, m, remote) -> ExecutorError:
        """The error of a multi-host call whose part on host ``h`` failed
        in the hosts' gloo collectives (``remote``, from reply ``m``): a
        host of the call was lost or gave up mid-collective -- what the
        caller gets when a worker dies mid-call, whichever reply comes
        first -- and the cluster's collectives are out of step."""
        first = (m.error_message or "").strip().splitlines()
        error = ExecutorError(
            f"{self.plan.name}: host {h}'s part failed in the hosts' "
            f"collectives ({m.error_type}: {first[0][:300] if first else ''}"
            "): a host of the call was lost or gave up, and the hosts' "
            "collectives are out of step (local workers restart; running "
            "workers are marked wedged); the call was not retried")
        error.__cause__ = remote
        return error

    def _check_hosts_agree(self, parts, specs, tree) -> None:
        """ValueError unless every host discovered the same output specs
        (each host's shards are read by them)."""
        h0 = self.plan.hosts[0]
        for h, (m, _, _) in zip(self.plan.hosts[1:], parts[1:]):
            if m.specs == specs:
                continue
            other = None
            if m.specs is not None:  # within the reply's inflation budget
                with envelope.inflation_scope(m.inflation):
                    other = spec_tree.decode_spec_tree(m.specs)
            if other != tree:
                raise ValueError(
                    f"{self.plan.name}: hosts {h0} and {h} returned outputs "
                    f"of different specs: {tree} vs {other}")

    def _discovered_layouts(self, parts):
        specs = parts[0][0].specs
        if specs is None:
            raise PayloadError("discovery result without specs", "$.specs")
        with envelope.inflation_scope(parts[0][0].inflation):
            tree = spec_tree.decode_spec_tree(specs)
        self._check_hosts_agree(parts, specs, tree)
        leaves = jtu.tree_leaves(tree)
        for i, s in enumerate(leaves):
            if type(s) is not jax.ShapeDtypeStruct or s.sharding is None:
                raise PayloadError(f"discovered spec {i} is not a "
                                   "ShapeDtypeStruct with a sharding",
                                   "$.specs")
        # (as the colocated API checks them, before shards are looked for)
        specs_mod.check_within(leaves, self.plan.program.devices, "output",
                               self.plan.name)
        return specs, [arrays.Layout(s, False) for s in leaves]

    def _assemble(self):
        plan = self.plan
        if not self.discover and len(plan.hosts) == 1:  # one host's shards
            m, get, _ = self._parts[plan.hosts[0]]
            layouts = plan.out_layouts
            shards = m.shards
            if shards is None:
                per = [{} for _ in layouts]
            else:
                per = arrays.buffers_by_device(shards, len(layouts), get,
                                               "$.shards")
            return [arrays.assemble(lay, per[i], i, f"{plan.name} output")
                    for i, lay in enumerate(layouts)]
        parts = [self._parts[h] for h in self.plan.hosts]
        specs = None
        if self.discover:
            try:  # nothing is viewed yet: on failure every lease goes back
                specs, layouts = self._discovered_layouts(parts)
            except BaseException:
                for m, _, link in parts:
                    link.release_unused(m)
                raise
        else:
            layouts = self.plan.out_layouts
        merged = [dict() for _ in layouts]
        for m, get, _ in parts:
            shards = m.shards
            if shards is None:
                continue
            per = arrays.buffers_by_device(shards, len(layouts), get,
                                           "$.shards")
            for i, found in enumerate(per):
                merged[i].update(found)
        outs = [arrays.assemble(lay, merged[i], i, f"{self.plan.name} output")
                for i, lay in enumerate(layouts)]
        return (outs, specs) if self.discover else outs

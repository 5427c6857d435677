"""A worker session's registered programs, by content id.

A program is decoded when it is registered (``register``); a call names it
by id (``for_call``), and gets the program's decoded form or the error its
decode gave.  A program refused for a type this process had not registered
(``UnregisteredError``) is decoded again at a later call once something may
have registered it: a module imported, a pytree node, effect or PRNG impl
registered (``registrations``); never on every call.  A method program goes
with its instance (``drop_instance``).

Calls and registrations come from the session's reader thread; drops from
its lanes (single dict operations).
"""

from __future__ import annotations

import sys

from jax._src.export import _export as jexport

from jaxcolo.codec import effects as effects_codec
from jaxcolo.colocated.program import ProgramRef
from jaxcolo.errors import PayloadError, UnregisteredError
from jaxcolo.process import arrays, main_types

UNREGISTERED_HINT = (
    "; a worker has the registrations of the modules it imports (those of "
    "the function's argument types and those its body refers to), not "
    "those of the controller's script (__main__): register the type in a "
    "module")


def registrations() -> tuple:
    """Changes when this process may have registered a type since (a module
    imported, a pytree node, effect or PRNG impl registered)."""
    return (len(sys.modules), len(jexport.deserialization_registry),
            effects_codec.registered_count())


class Entry:
    """One registered program: ``decoded`` (and its input ``in_layouts``)
    or the ``error`` each of its calls gets."""

    __slots__ = ("ref", "error", "decoded", "in_layouts", "lacked",
                 "judge")

    def __init__(self, ref: ProgramRef):
        self.ref = ref
        self.error = None
        self.decoded = None
        self.in_layouts = None
        self.lacked = None  # registrations() when a type was missing
        self.judge = None  # its body's script classes (main_types)


def _fresh(error: PayloadError) -> PayloadError:
    """A new exception like ``error`` (each PayloadError type takes
    (reason, path)): raising one kept object every call grew its traceback
    by the raising frames, which held each call's message and buffers."""
    return type(error)(error.reason, error.path)


class ProgramTable:
    def __init__(self, stats: dict):
        self._programs: dict[bytes, Entry] = {}
        self._by_instance: dict[int, list] = {}  # instance id -> program ids
        self._stats = stats  # the session's: registered, programs_decoded
        stats.setdefault("registered", 0)
        stats.setdefault("programs_decoded", 0)
        stats.setdefault("unregistered", 0)

    def __len__(self) -> int:
        return len(self._programs)

    def has(self, program_id) -> bool:
        return program_id in self._programs

    def register(self, program_id, payload, inflation) -> None:
        """Decode and keep a program (PayloadError if the message is
        inconsistent; a program that does not decode is kept with its
        error)."""
        if program_id is None or payload is None:
            raise PayloadError("register needs program_id and program",
                               "$.program")
        ref = ProgramRef.of(payload)
        if ref.id != program_id:
            raise PayloadError("program id does not match the program's "
                               "content", "$.program_id")
        entry = Entry(ref)
        self._decode(entry, inflation)
        self._programs[ref.id] = entry
        self._stats["registered"] += 1
        self._note_method(entry)

    def for_call(self, program_id) -> Entry:
        """The entry a call of ``program_id`` runs; its error raised."""
        entry = self._programs.get(program_id)
        if entry is None:
            raise PayloadError("call of a program that was never registered",
                               "$.program_id")
        if entry.error is not None:
            if entry.lacked is not None and entry.lacked != registrations():
                self._decode(entry, None)  # registered since then?
                self._note_method(entry)
            if entry.error is not None:
                raise _fresh(entry.error)
        return entry

    def decode_for_run(self, program, resolver):
        """The program as the InlineExecutor that runs it decodes it:
        judged by its body's script classes, as when it was registered."""
        entry = self._programs.get(program.id)
        judge = entry.judge if entry is not None else None
        return main_types.decode_judged(program.payload, judge, resolver)

    def forget(self, program_ids) -> None:
        """Drop programs the controller will not call again (unknown ids
        are ignored; one registered again is decoded again)."""
        for pid in program_ids:
            if self._programs.pop(pid, None) is not None:
                self._stats["unregistered"] += 1

    def drop_instance(self, instance_id: int) -> None:
        """Forget the method programs of a destroyed instance."""
        for pid in self._by_instance.pop(instance_id, ()):
            self._programs.pop(pid, None)

    def _note_method(self, entry: Entry) -> None:
        if entry.decoded is not None and entry.decoded.kind == "method":
            ids = self._by_instance.setdefault(entry.decoded.instance_id, [])
            if entry.ref.id not in ids:  # (registered again after a forget)
                ids.append(entry.ref.id)

    def _decode(self, entry: Entry, inflation) -> None:
        self._stats["programs_decoded"] += 1
        entry.error = entry.lacked = None
        try:
            prog, entry.judge = main_types.decode_importing(
                entry.ref.payload, inflation)
            entry.in_layouts = [arrays.Layout(s, True)
                                for s in prog.in_leaves]
            entry.decoded = prog
        except UnregisteredError as e:
            entry.error = UnregisteredError(e.reason + UNREGISTERED_HINT,
                                            e.path)
            entry.lacked = registrations()
        except PayloadError as e:
            entry.error = _fresh(e)
        except Exception as e:  # noqa: BLE001 - e.g. an indivisible sharding
            entry.error = PayloadError(f"unusable in_specs: {e!r}",
                                       "$.program.in_specs")

"""A function's exception, from the worker to the caller: chains of
exceptions whose class pickles itself, and exceptions whose own methods
raise SystemExit or KeyboardInterrupt while the worker reports them."""

import pickle
import threading

import pytest

import jaxcolo
from jaxcolo import versions
from jaxcolo.process import remote_errors
from tests import colocated_types as ct
from tests.colocated_support import cpu_devices, put


def _raised(make):
    try:
        make()
    except Exception as e:  # noqa: BLE001 - the exception under test
        return e
    raise AssertionError("nothing raised")


def _file_missing_from_key():
    try:
        {}["config"]
    except KeyError as e:
        raise FileNotFoundError(2, "No such file", "cfg.toml") from e


def _denied_while_handling():
    try:
        raise OSError(5, "disk")
    except OSError:
        raise PermissionError(13, "denied")


def _module_missing_from_value():
    try:
        raise ValueError("inner")
    except ValueError as e:
        raise ModuleNotFoundError("No module named 'foo'", name="foo") from e


def _self_reducing_from_key():
    try:
        {}["k"]
    except KeyError as e:
        raise ct.SelfReducing("bad", 7) from e


CHAINS = {  # how each is raised -> (its __cause__'s, __context__'s type;
    # a context that a cause suppresses does not travel, as for others)
    "oserror cause": (_file_missing_from_key, KeyError, type(None)),
    "oserror context": (_denied_while_handling, type(None), OSError),
    "importerror cause": (_module_missing_from_value, ValueError, type(None)),
    "own __reduce__ cause": (_self_reducing_from_key, KeyError, type(None)),
}


def _same(a, b):
    assert type(a) is type(b) and a.args == b.args and str(a) == str(b)
    assert getattr(a, "__dict__", {}) == getattr(b, "__dict__", {})


@pytest.mark.parametrize("case", sorted(CHAINS))
def test_chains_of_exceptions_their_class_pickles(case, monkeypatch):
    """Exceptions whose class pickles itself (OSError, ImportError, own
    __reduce__) came back without __cause__ and __context__; from v12 they
    keep them.  Sessions before 12 leave them out, so their controllers
    (which refuse chain_exception) still get the exception."""
    make, cause, context = CHAINS[case]
    e = _raised(make)
    msg = remote_errors.error_message(1, e, "w", versions.SCHEMA_VERSION)
    back = remote_errors.loads_exception(msg.error_pickle)
    _same(back, e)
    assert type(back.__cause__) is cause
    assert type(back.__context__) is context
    assert back.__suppress_context__ == e.__suppress_context__

    old = remote_errors.error_message(1, e, "w", 11)
    assert b"chain_exception" not in old.error_pickle
    refuse = remote_errors._ExceptionUnpickler.find_class

    def before_12(self, module, name):
        if name == "chain_exception":
            raise pickle.UnpicklingError("a controller before version 12")
        return refuse(self, module, name)
    monkeypatch.setattr(remote_errors._ExceptionUnpickler, "find_class",
                        before_12)
    back = remote_errors.loads_exception(old.error_pickle)
    _same(back, e)
    assert back.__cause__ is None and back.__context__ is None


class _StrRaises(Exception):
    def __init__(self, *args, what=SystemExit):
        super().__init__(*args)
        self.what = what

    def __str__(self):
        raise self.what


class _Unpicklable:
    def __init__(self, what):
        self.what = what

    def __reduce_ex__(self, protocol):
        raise self.what


@pytest.mark.parametrize("what", [SystemExit, KeyboardInterrupt])
def test_an_error_reply_despite_base_exceptions_in_its_methods(what):
    """An exception whose __str__ (or an arg's pickling) raised SystemExit
    or KeyboardInterrupt while the worker made its error reply: the reply
    was never sent and the call waited forever."""
    for e in (_StrRaises("boom", what=what), ValueError(_Unpicklable(what))):
        msg = remote_errors.error_message(1, e, "w", versions.SCHEMA_VERSION)
        assert msg.error_type.endswith(type(e).__qualname__)
        assert msg.error_traceback


class _InitRaises(Exception):
    def __init__(self, text):
        if text == "rebuilt":
            raise SystemExit  # only where it is rebuilt
        super().__init__(text)


def test_a_class_whose_init_raises_base_exceptions_where_rebuilt():
    e = _InitRaises("made")
    e.args = ("rebuilt",)
    msg = remote_errors.error_message(1, e, "w", versions.SCHEMA_VERSION)
    back = remote_errors.loads_exception(msg.error_pickle)
    assert type(back) is _InitRaises and back.args == ("rebuilt",)


def _call_within(f, x, seconds):
    """What ``f(x)`` raised, failing (not hanging) past ``seconds``."""
    out = []

    def call():
        try:
            out.append(f(x))
        except BaseException as e:  # noqa: BLE001 - under test
            out.append(e)
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"no answer within {seconds} s: the call was lost"
    return out[0]


class StrInterrupts(Exception):
    def __str__(self):
        raise KeyboardInterrupt


def _raise_str_interrupts(x):
    raise StrInterrupts("boom")


def test_process_executor_answers_and_keeps_chains():
    with jaxcolo.ProcessExecutor(num_hosts=1) as ex, \
            jaxcolo.use_executor(ex):
        x = put(1, cpu_devices()[0])
        f = jaxcolo.colocated_python(_raise_str_interrupts).specialize(
            out_specs_fn=lambda x: x)
        got = _call_within(f, x, 60)
        assert type(got) is StrInterrupts and got.args == ("boom",)
        assert "Remote traceback" in got.__notes__[0]

        g = jaxcolo.colocated_python(
            lambda x: _file_missing_from_key()).specialize(
                out_specs_fn=lambda x: x)
        with pytest.raises(FileNotFoundError, match="cfg.toml") as info:
            g(x)
        assert type(info.value.__cause__) is KeyError
        ok = jaxcolo.colocated_python(lambda x: x + 1)
        assert int(ok(x)) == 2


class _FetchError(OSError):
    """Refers to itself through its request (a back-reference)."""

    def __init__(self, errno, msg, request=None):
        super().__init__(errno, msg)
        self.request = request
        if request is not None:
            request["error"] = self


class _Retried(Exception):
    def __init__(self, attempt):
        super().__init__(f"attempt {attempt}")
        self.me = self


def _retry(make, attempt, retries):
    try:
        raise make(attempt)
    except Exception:
        if attempt == retries:
            raise
        return _retry(make, attempt + 1, retries)  # its context: the last


@pytest.mark.parametrize("make", [
    lambda k: _FetchError(110, f"timed out ({k})", {"attempt": k}),
    _Retried], ids=["own pickling", "default pickling"])
def test_contexts_referring_back_are_pickled_once(make, monkeypatch):
    """Each exception of a retry loop's context chain referring back to
    itself: every re-entry pickled the context again, doubling the time
    and memory with each retry (20 retries: 18 s, 1 GB)."""
    retries = 14
    e = _raised(lambda: _retry(make, 0, retries))
    real, calls = remote_errors._dumps, []
    monkeypatch.setattr(remote_errors, "_dumps",
                        lambda *a: calls.append(1) or real(*a))
    msg = remote_errors.error_message(1, e, "w", versions.SCHEMA_VERSION)
    assert len(calls) <= 4 * (retries + 1)
    back = remote_errors.loads_exception(msg.error_pickle)
    assert type(back) is type(e) and back.args == e.args
    chain = []
    while back is not None:
        chain.append(back)
        back = back.__context__
    assert len(chain) == retries + 1  # (attributes follow memoization:
    if make is _Retried:               # they refer back to it)
        assert all(x.me is x for x in chain)
    else:
        assert all(x.request["error"] is x for x in chain)


class _Chained:
    """Pickles as chain_exception naming ``context`` (one bytes object)."""

    def __init__(self, context):
        self.context = context

    def __reduce__(self):
        return remote_errors.chain_exception, (KeyError("k"), None,
                                               self.context)


def test_a_context_named_many_times_loads_once(monkeypatch):
    """A worker's pickle naming one context pickle M times at each of K
    levels made the controller load M**K of them (2 KB: hours, on the
    thread that reads that host's replies)."""
    data = remote_errors._dumps(ValueError("leaf"))
    for _ in range(4):
        data = remote_errors._dumps(ValueError([_Chained(data)
                                                for _ in range(10)]))
    loads = []

    class Counting(remote_errors._ExceptionUnpickler):
        def load(self):
            loads.append(1)
            return super().load()
    monkeypatch.setattr(remote_errors, "_ExceptionUnpickler", Counting)
    back = remote_errors.loads_exception(data)
    assert type(back) is ValueError and len(back.args[0]) == 10
    assert len(loads) <= 1 + 4 + 1


def test_contexts_past_the_budget_are_left_out():
    """Nested context pickles load within a budget proportional to the
    reply's size; an honest chain fits, a context past it is dropped."""
    e = _raised(lambda: _retry(lambda k: ValueError(f"attempt {k}"), 0, 60))
    msg = remote_errors.error_message(1, e, "w", versions.SCHEMA_VERSION)
    back, n = remote_errors.loads_exception(msg.error_pickle), 0
    while back is not None:
        n, back = n + 1, back.__context__
    assert n == 61
    data = remote_errors._dumps(ValueError("x" * (1 << 20)))
    for _ in range(64):  # each level holds the next: 64 MiB to load
        data = remote_errors._dumps(ValueError(_Chained(data)))
    back, depth = remote_errors.loads_exception(data), 0
    while back is not None:
        depth, back = depth + 1, back.args[0].__context__
    assert 40 <= depth < 64  # 16 MiB and 32 MiB: 48 levels


def test_a_reply_cannot_change_the_allowed_functions():
    """A pickle could set attributes of the functions the controller's
    unpickler allows (BUILD on them): __defaults__ emptied, every later
    exception without a cause came back as an ExecutorError."""
    def short(b):
        return b"\x8c" + bytes([len(b)]) + b
    attack = (b"\x80\x04" + short(remote_errors.__name__.encode()) +
              short(b"rebuild_exception") + b"\x93" + b"N}" +
              short(b"__defaults__") + b")s\x86b0N.")
    honest = remote_errors.dumps_exception(ValueError("honest"))
    assert remote_errors.loads_exception(attack) is None
    assert remote_errors.rebuild_exception.__defaults__ == (None,)
    assert type(remote_errors.loads_exception(honest)) is ValueError


def test_a_huge_memo_index_costs_nothing():
    """9 bytes naming memo index 2**24 made the C unpickler zero a table
    of 2**25 entries (256 MB, 0.2 s; 2**30: 16 GB), per context pickle."""
    import struct
    import tracemalloc
    bomb = b"\x80\x04Nr" + struct.pack("<I", 1 << 24) + b"."
    data = remote_errors._dumps(ValueError([_Chained(bytes(bomb))
                                            for _ in range(3)]))
    tracemalloc.start()
    try:
        assert remote_errors.loads_exception(bomb) is None
        back = remote_errors.loads_exception(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert type(back) is ValueError
    assert peak < 8 << 20


def test_a_long_honest_chain_comes_back_whole():
    """A chain of 101 contexts of 1 KB each came back without its oldest
    43 (the root cause) under a byte budget too tight for nesting."""
    def attempt(k, last):
        try:
            raise RuntimeError(f"attempt {k} failed: " + "." * 1000)
        except RuntimeError:
            if k == last:
                raise
            attempt(k + 1, last)
    e = _raised(lambda: attempt(0, 100))
    msg = remote_errors.error_message(1, e, "w", versions.SCHEMA_VERSION)
    back, n = remote_errors.loads_exception(msg.error_pickle), 1
    while back.__context__ is not None:
        n, back = n + 1, back.__context__
    assert n == 101 and back.args[0].startswith("attempt 0 failed")


class _ReadOnlyCode(Exception):
    def __init__(self, msg, code):
        super().__init__(msg)
        self.__dict__["code"] = code

    @property
    def code(self):
        return self.__dict__["code"]


class _Immutable(Exception):
    def __init__(self, msg, code):
        super().__init__(msg)
        object.__setattr__(self, "code", code)

    def __setattr__(self, name, value):
        if name == "code":
            raise AttributeError("code is read-only")
        super().__setattr__(name, value)


@pytest.mark.parametrize("cls", [_ReadOnlyCode, _Immutable])
def test_attributes_setattr_refuses_keep_their_chain(cls):
    """v12 sets a default-pickled exception's attributes with setattr
    (BUILD); one whose attributes setattr refuses lost its cause."""
    def make():
        try:
            {}["cfg"]
        except KeyError as e:
            raise cls("bad config", 7) from e
    e = _raised(make)
    msg = remote_errors.error_message(1, e, "w", versions.SCHEMA_VERSION)
    back = remote_errors.loads_exception(msg.error_pickle)
    assert type(back) is cls and back.code == 7
    assert type(back.__cause__) is KeyError

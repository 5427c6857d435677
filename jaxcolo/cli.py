"""The ``jaxcolo`` command: inspect, check, demo, worker."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys


def _ensure_devices() -> None:
    # Must happen before JAX is imported in this process.
    if "jax" not in sys.modules and "--xla_force_host_platform_device_count" \
            not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=8")


def _read(path: str) -> bytes | None:
    """The bytes of regular file ``path``, or None (reason printed) if it
    cannot be read.  Devices, FIFOs and the like are refused: reading them
    may never end (``/dev/zero``)."""
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                print(f"{_printable(path)}: not a regular file",
                      file=sys.stderr)
                return None
            return f.read()
    except OSError as e:
        print(f"{_printable(path)}: cannot read: {e.strerror or e}",
              file=sys.stderr)
        return None
    except MemoryError:
        print(f"{_printable(path)}: too large to read into memory",
              file=sys.stderr)
        return None


def _printable(text) -> str:
    """``text`` with control characters escaped (payload strings end up in
    reasons; one reason stays one line and cannot drive the terminal)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else
                   c.encode("unicode_escape").decode("ascii") for c in text)


def cmd_inspect(args) -> int:
    import jaxcolo
    data = _read(args.file)
    if data is None:
        return 2
    try:
        info = jaxcolo.inspect(data)
    except jaxcolo.PayloadError as e:
        print(f"{_printable(args.file)}: invalid payload: {_printable(e)}",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{_printable(args.file)}: {info['format']} {info['root_kind']} "
          f"payload, {info['size']} bytes")
    _print_fields(info, "  ", skip=("format", "root_kind", "size"))
    return 0


def _print_fields(info: dict, indent: str, skip=()) -> None:
    """key: value lines; nested payload descriptions (a program's specs)
    indented under their key; leaves last, at most 20."""
    for key, value in info.items():
        if key in skip or key == "leaves":
            continue
        if isinstance(value, dict):
            print(f"{indent}{_printable(key)}:")
            _print_fields(value, indent + "  ")
        else:
            print(f"{indent}{_printable(key)}: {_printable(value)}")
    leaves = info.get("leaves", [])
    for i, leaf in enumerate(leaves[:20]):
        print(f"{indent}leaf[{i}]: {_printable(leaf)}")
    if len(leaves) > 20:
        print(f"{indent}... {len(leaves) - 20} more leaves")


def cmd_check(args) -> int:
    from jaxcolo.checking import check_readable
    data = _read(args.file)
    if data is None:
        return 2  # not "unreadable by that version" (1): no payload at all
    ok, reason = check_readable(data, args.reader_version)
    print(f"{_printable(args.file)}: {_printable(reason)}")
    return 0 if ok else 1


def cmd_demo(args) -> int:
    from jaxcolo.demo import main
    return main()


def cmd_worker(args) -> int:
    from jaxcolo.process.runtime import run
    return run(args)


def main(argv=None) -> int:
    _ensure_devices()
    ap = argparse.ArgumentParser(prog="jaxcolo", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="describe a payload file")
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("check", help="can a reader of version N read FILE? "
                       "(for JAX export payloads: JAX serialization version N)")
    p.add_argument("file")
    p.add_argument("--reader-version", type=int, required=True)
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("demo", help="serialize a realistic spec tree")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("worker", help="run a ProcessExecutor worker (one "
                                      "host) that controllers connect to")
    from jaxcolo.process.runtime import add_arguments
    add_arguments(p)
    p.set_defaults(fn=cmd_worker)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `jaxcolo inspect FILE | head`: not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())

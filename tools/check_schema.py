"""Check that schema/ only evolves compatibly with every frozen version
under schema/history/vN/:

* ``flatc --conform`` (field types and order, tables and enums kept);
* names and numbers, which --conform does not compare: every enum value of
  a frozen version keeps its name and number, and every table field keeps
  its name and slot (read off flatc's Python output for both schemas; a
  field may only disappear by being marked ``(deprecated)``);
* what neither compares: each file's ``root_type``, and which fields are
  ``(required)``; structs and unions are refused until this check learns
  to compare them (the schema has none);
* the frozen files themselves are unchanged (``history/SHA256SUMS``), the
  newest frozen version is the library's ``SCHEMA_VERSION``, and schema/
  is identical to it (a change to the schema needs a new version).

    python tools/check_schema.py            # check against every frozen version
    python tools/check_schema.py --freeze N # copy schema/*.fbs to history/vN
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from regen import ROOT, flatc  # noqa: E402
sys.path.insert(0, ROOT)
from jaxcolo import versions as jversions  # noqa: E402
from jaxcolo.versions import SCHEMA_VERSION  # noqa: E402
from jaxcolo.wire import layout  # noqa: E402
SCHEMA_DIR = os.path.join(ROOT, "schema")
HISTORY = os.path.join(SCHEMA_DIR, "history")
SUMS = os.path.join(HISTORY, "SHA256SUMS")
ROOT_FILE = "jaxcolo.fbs"


def conform(old_dir: str, new_file: str) -> subprocess.CompletedProcess:
    """Run flatc --conform: is new_file an evolution of old_dir's schema?"""
    return subprocess.run(
        [flatc(), "--conform", os.path.join(old_dir, ROOT_FILE),
         "--conform-includes", old_dir, "-I", os.path.dirname(new_file),
         new_file], capture_output=True, text=True)


def names_and_numbers(schema_dir: str, root_file: str = ROOT_FILE
                      ) -> tuple[dict, dict]:
    """({enum: {name: value}}, {table: {field: slot}}) of the schema whose
    root file is in ``schema_dir``, from flatc's Python output."""
    return module_names_and_numbers(generated_module(schema_dir, root_file))


def generated_module(schema_dir: str, root_file: str = ROOT_FILE):
    """flatc's Python output for the schema whose root file is in
    ``schema_dir``, imported (as one module)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([flatc(), "--python", "--gen-onefile", "--gen-all",
                        "-o", tmp, os.path.join(schema_dir, root_file)],
                       check=True, capture_output=True)
        path = os.path.join(tmp, root_file.replace(".fbs", "_generated.py"))
        spec = importlib.util.spec_from_file_location(
            f"_schema_{abs(hash(schema_dir))}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def module_names_and_numbers(module) -> tuple[dict, dict]:
    """names_and_numbers of a flatc-generated Python module."""
    enums, tables = {}, {}
    for name, obj in vars(module).items():
        if not isinstance(obj, type) or obj.__module__ != module.__name__:
            continue
        attrs = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        if attrs and all(type(v) is int for v in attrs.values()):
            enums[name] = attrs
        elif hasattr(obj, "Init"):
            tables[name] = vars(layout(module, name))
    return enums, tables


def compare_names(old_dir: str, current_dir: str) -> list[str]:
    """Problems: enum values or table fields of the frozen schema renamed,
    renumbered, moved or removed in the current one."""
    old_enums, old_tables = names_and_numbers(old_dir)
    enums, tables = names_and_numbers(current_dir)
    text = "\n".join(open(f).read() for f in
                     glob.glob(os.path.join(current_dir, "*.fbs")))
    out = []
    for enum, values in old_enums.items():
        out += _changes("enum", enum, values, enums.get(enum),
                        lambda name, value: f"{name} = {value}")
    for table, fields in old_tables.items():
        out += _changes("table", table, fields, tables.get(table),
                        lambda name, voff: name,
                        lambda name: re.search(
                            rf"\b{name}\s*:[^;]*\(\s*deprecated", text, re.I),
                        " (mark it deprecated)")
    return out


def _schema_text(schema_dir: str) -> dict:
    """file name -> text without comments, of every .fbs in schema_dir."""
    out = {}
    for f in sorted(glob.glob(os.path.join(schema_dir, "*.fbs"))):
        with open(f) as fh:
            out[os.path.basename(f)] = re.sub(r"//[^\n]*", "", fh.read())
    return out


_TABLE = re.compile(r"\btable\s+(\w+)[^{]*\{([^}]*)\}")
_FIELD = re.compile(r"^\s*(\w+)\s*:([^;]*)$")


def declarations(schema_dir: str) -> tuple[dict, dict, list]:
    """({file: root_type}, {(table, field): attribute text}, [problems])
    of a schema: what --conform and the names check do not compare."""
    roots, attrs, problems = {}, {}, []
    for name, text in _schema_text(schema_dir).items():
        root = re.search(r"\broot_type\s+([\w.]+)\s*;", text)
        roots[name] = root.group(1) if root else None
        for kind in ("struct", "union"):
            if re.search(rf"\b{kind}\s+\w+", text):
                problems.append(
                    f"{name} declares a {kind}: this check compares tables "
                    f"and enums only; teach it {kind}s before using one")
        for table, body in _TABLE.findall(text):
            for decl in body.split(";"):
                m = _FIELD.match(decl)
                if m:
                    found = re.search(r"\(([^)]*)\)", m.group(2))
                    attrs[(table, m.group(1))] = found.group(1) if found \
                        else ""
    return roots, attrs, problems


def compare_declarations(old_dir: str, current_dir: str) -> list[str]:
    """Problems: a root type changed, or a frozen field made (or no longer)
    required; verifying readers (flatc's C++ verifier) reject payloads
    that lack a required field."""
    old_roots, old_attrs, _ = declarations(old_dir)
    roots, attrs, _ = declarations(current_dir)
    out = []
    for name, root in old_roots.items():
        if name in roots and roots[name] != root:
            out.append(f"{name}: root_type {root} is now {roots[name]}")
    required = re.compile(r"\brequired\b")
    for (table, field), text in old_attrs.items():
        now = attrs.get((table, field))
        if now is not None and bool(required.search(now)) != \
                bool(required.search(text)):
            out.append(f"{table}.{field}: 'required' "
                       f"{'added' if required.search(now) else 'removed'}")
    return out


def compare_current_with_frozen(newest: str) -> list[str]:
    """Problems: schema/*.fbs differs from the frozen copy of
    SCHEMA_VERSION, so payloads stamped with that version would not be
    described by it (a schema change needs a new version)."""
    current = {os.path.basename(f): _digest(f) for f in
               glob.glob(os.path.join(SCHEMA_DIR, "*.fbs"))}
    frozen = {os.path.basename(f): _digest(f) for f in
              glob.glob(os.path.join(newest, "*.fbs"))}
    label = os.path.relpath(newest, ROOT)
    return [f"schema/{n} differs from {label}/{n}: bump SCHEMA_VERSION "
            f"(jaxcolo/versions.py) and freeze, or revert the change"
            for n in sorted(set(current) | set(frozen))
            if current.get(n) != frozen.get(n)]


def compare_with_jax() -> list[str]:
    """Problems: schema/jax_export/export.fbs (JAX's Exported wire format,
    which jaxcolo.export reads and writes) differs from the installed JAX's
    own generated code in an enum value or a field's name or slot."""
    from jax._src.export import serialization_generated as jax_fb
    ours = names_and_numbers(os.path.join(SCHEMA_DIR, "jax_export"),
                             "export.fbs")
    theirs = module_names_and_numbers(jax_fb)
    out = []
    for (kind, mine, jax_side) in (("enum", ours[0], theirs[0]),
                                   ("table", ours[1], theirs[1])):
        for owner, fields in jax_side.items():
            out += _changes(kind, owner, fields, mine.get(owner),
                            lambda name, number: f"{name} = {number}")
    return out


def compare_writers_with_jax(ours=None) -> list[str]:
    """Problems: a field of schema/jax_export/export.fbs whose type, slot
    or default differ from JAX's, read off the two generated modules'
    writers (``<Table>Add<Field>`` and ``<Table>Start<Field>Vector``: flatc
    writes a field's slot, scalar type and default, or a vector's element
    size and alignment, into each one's single statement).  A type or
    default changed in our copy passed the name and slot comparison, and
    then jaxcolo wrote what JAX reads differently.  ``ours``: the module
    to compare (default: the generated package jaxcolo uses)."""
    if ours is None:
        import jaxcolo_jax_export_fb as ours
    from jax._src.export import serialization_generated as theirs
    out = []
    for name, fn in sorted(vars(theirs).items()):
        if not (callable(fn) and re.fullmatch(r"[A-Z]\w*(Add\w+|Start\w+"
                                              r"Vector)", name)):
            continue
        mine = getattr(ours, name, None)
        if mine is None:
            continue  # (a missing field is reported by compare_with_jax)
        want, got = _writer_statement(fn), _writer_statement(mine)
        if want != got:
            out.append(f"{name}: JAX's writes {want}, ours {got}")
    return out


def _writer_statement(fn) -> str:
    """What a flatc-generated writer function does, from its bytecode: the
    attributes it calls and the constants it passes (slot, default,
    element size) in order, its parameters by position (generators may
    spell their names differently)."""
    import dis
    params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    parts = []
    for ins in dis.get_instructions(fn):
        if ins.opname == "LOAD_CONST":
            parts.append(repr(ins.argval))
        elif ins.opname in ("LOAD_FAST", "LOAD_DEREF"):
            parts.append(f"arg{params.index(ins.argval)}"
                         if ins.argval in params else ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL"):
            parts.append(str(ins.argval))
    return " ".join(parts)


def _changes(kind, owner, old: dict, now: dict | None, show,
             may_vanish=lambda name: False, removed_hint="") -> list[str]:
    """How ``old`` (name -> number: enum values, or fields' vtable slots)
    of ``owner`` changed in ``now``: renamed, moved or removed."""
    if now is None:
        return [f"{kind} {owner} removed"]
    by_number = {v: k for k, v in now.items()}
    out = []
    for name, number in old.items():
        if now.get(name) == number:
            continue
        if number in by_number:
            out.append(f"{owner}.{name} is now named "
                       f"{owner}.{by_number[number]}")
        elif name in now:
            out.append(f"{owner}.{show(name, number)} is now "
                       f"{owner}.{show(name, now[name])}")
        elif not may_vanish(name):
            out.append(f"{owner}.{show(name, number)} removed{removed_hint}")
    return out


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def frozen_files() -> dict:
    """relative path -> sha256 of every file under history/vN/."""
    out = {}
    for d in frozen_versions():
        for f in sorted(glob.glob(os.path.join(d, "*.fbs"))):
            out[os.path.relpath(f, HISTORY)] = _digest(f)
    return out


def check_frozen_files() -> list[str]:
    """Problems: frozen files edited, added or removed since their freeze."""
    if not os.path.exists(SUMS):
        return [f"{os.path.relpath(SUMS, ROOT)} missing"]
    recorded = {}
    for line in open(SUMS):
        digest, _, name = line.strip().partition("  ")
        recorded[name] = digest
    now = frozen_files()
    out = [f"history/{n} changed after its freeze" for n in sorted(now)
           if n in recorded and recorded[n] != now[n]]
    out += [f"history/{n} is not in SHA256SUMS" for n in sorted(now)
            if n not in recorded]
    out += [f"history/{n} was removed" for n in sorted(recorded)
            if n not in now]
    return out


def write_sums() -> None:
    with open(SUMS, "w") as f:
        for name, digest in frozen_files().items():
            f.write(f"{digest}  {name}\n")


def frozen_versions() -> list[str]:
    return sorted(glob.glob(os.path.join(HISTORY, "v*")),
                  key=lambda d: int(os.path.basename(d)[1:]))


def evolution_problems(frozen: list) -> list[str]:
    """The current schema against each frozen version: flatc --conform,
    then names, numbers and declarations (printing a line per version)."""
    problems = []
    current = os.path.join(SCHEMA_DIR, ROOT_FILE)
    for d in frozen:
        r = conform(d, current)
        status = "ok" if r.returncode == 0 else "NOT CONFORMING"
        print(f"flatc --conform {os.path.relpath(d, ROOT)}: {status}")
        if r.returncode:
            problems.append(f"does not conform to {os.path.relpath(d, ROOT)}:"
                            f"\n{r.stdout}{r.stderr}")
        renamed = compare_names(d, SCHEMA_DIR) + \
            compare_declarations(d, SCHEMA_DIR)
        print(f"names, numbers and declarations vs "
              f"{os.path.relpath(d, ROOT)}: {'ok' if not renamed else 'CHANGED'}")
        problems += [f"  {problem}" for problem in renamed]
    return problems


def history_problems() -> list[str]:
    """Problems with versions.HISTORY, the table of what each version
    added: one row per version 1..SCHEMA_VERSION, in order (a version
    without its row is unknown to readers' checks and to ``jaxcolo
    check``)."""
    rows = [info.version for info in jversions.HISTORY]
    want = list(range(1, SCHEMA_VERSION + 1))
    if rows == want:
        return []
    return [f"versions.HISTORY has rows for versions {rows}, but "
            f"SCHEMA_VERSION {SCHEMA_VERSION} needs one row for each of "
            f"1..{SCHEMA_VERSION}, in order"]


def freeze(n: int) -> int:
    """Copy schema/*.fbs to history/vN: only the next version, only once
    SCHEMA_VERSION says N, and only a schema that evolves every frozen one
    compatibly (a frozen version never changes, so a bad freeze stays)."""
    dest = os.path.join(HISTORY, f"v{n}")
    if os.path.exists(dest):
        sys.exit(f"{dest} exists: frozen versions never change")
    frozen = frozen_versions()
    last = int(os.path.basename(frozen[-1])[1:]) if frozen else 0
    if n != last + 1 or n != SCHEMA_VERSION:
        sys.exit(f"cannot freeze v{n}: the next version is v{last + 1} and "
                 f"SCHEMA_VERSION (jaxcolo/versions.py) is {SCHEMA_VERSION}; "
                 "add the version's row there first")
    problems = check_frozen_files() if os.path.exists(SUMS) else []
    if problems:
        sys.exit("frozen versions were edited: " + "; ".join(problems))
    problems = history_problems()
    if problems:
        sys.exit(f"cannot freeze v{n}: " + "; ".join(problems))
    problems = evolution_problems(frozen) + declarations(SCHEMA_DIR)[2]
    if problems:
        sys.exit(f"not freezing v{n}: the schema does not evolve the frozen "
                 "versions compatibly:\n" + "\n".join(problems))
    os.makedirs(dest)
    for f in glob.glob(os.path.join(SCHEMA_DIR, "*.fbs")):
        shutil.copy(f, dest)
    write_sums()
    print(f"froze schema as {os.path.relpath(dest, ROOT)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--freeze", type=int, metavar="N")
    args = ap.parse_args()
    if args.freeze is not None:
        return freeze(args.freeze)
    versions = frozen_versions()
    problems = evolution_problems(versions)
    for problem in problems:
        print(problem)
    failures = len(problems)
    if not versions:
        print("no frozen schema versions under schema/history yet")
        failures += 1
    elif os.path.basename(versions[-1]) != f"v{SCHEMA_VERSION}":
        print(f"SCHEMA_VERSION is {SCHEMA_VERSION} but the newest frozen "
              f"schema is {os.path.basename(versions[-1])}")
        failures += 1
    else:
        for problem in compare_current_with_frozen(versions[-1]):
            print(problem)
            failures += 1
    for problem in declarations(SCHEMA_DIR)[2] + history_problems():
        print(problem)
        failures += 1
    jax_problems = compare_with_jax() + compare_writers_with_jax()
    print("schema/jax_export/export.fbs vs the installed JAX's generated "
          f"code: {'ok' if not jax_problems else 'DIFFERENT'}")
    for problem in jax_problems:
        failures += 1
        print(f"  {problem}")
    for problem in check_frozen_files():
        print(f"frozen files: {problem}")
        failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

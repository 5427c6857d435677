"""Do older JAX releases read and call payloads jaxcolo writes for them?

    python tools/jax_golden/cross_release.py --venv-root /tmp/jaxvenvs \\
        [--out /tmp/jaxcolo-cross] [--report tests/golden/jax_export/CROSS_RELEASE.md]

For each serialization version N <= 10 that has a PyPI release, the golden
payloads (tests/golden/jax_export) are read with jaxcolo.export and
rewritten with ``jaxcolo.export.serialize(exp, version=N)`` into a
golden-shaped directory; then, in the throwaway venv of the JAX release
whose newest version is N, ``verify_golden.py`` runs ``jax.export.deserialize``
on every rewritten payload, calls it on the recorded inputs and compares
with the recorded outputs.  The source goldens are the release's own (so
their StableHLO uses a calling convention it runs), or the nearest newer
release's for releases without golden data; the 0.10.2 goldens are also
written at older versions (a current export sent to an older release).
Sharded sources are first made as ``jax.export.export`` makes them
(NamedShardings only), so older versions must derive HloShardings.  Cases version N cannot express
are listed with jaxcolo's EncodeError.  Results go to a markdown report.

Run this with the jaxcolo venv's python (jax 0.10.2); the release venvs are
made by make_golden.py (or by hand: ``python -m venv /tmp/jaxvenvs/jax-V &&
.../pip install jax==V jaxlib==V absl-py flatbuffers``).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GOLDEN = os.path.join(REPO, "tests", "golden", "jax_export")
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True

import jaxcolo  # noqa: E402
import jaxcolo.export as je  # noqa: E402

# version -> (release to test with, golden dir whose payloads are rewritten)
TARGETS = {
    2: [("0.4.30", "jax-0.4.30")],
    3: [("0.4.38", "jax-0.4.38"), ("0.5.3", "jax-0.5.3"),
        ("0.4.38", "jax-0.10.2"), ("0.5.3", "jax-0.10.2")],
    4: [("0.6.2", "jax-0.6.2"), ("0.7.2", "jax-0.7.2")],
    5: [("0.8.3", "jax-0.8.3"), ("0.8.3", "jax-0.10.2")],
    6: [("0.9.1", "jax-0.9.2"), ("0.9.1", "jax-0.8.3"),
        ("0.9.1", "jax-0.10.2")],
    8: [("0.9.2", "jax-0.9.2"), ("0.9.2", "jax-0.10.2")],
    10: [("0.10.0", "jax-0.10.2"), ("0.10.0", "jax-0.9.2")],
}


def as_exported_by_jax(exp):
    """``exp`` as ``jax.export.export`` (>= 0.9.2) makes it: NamedShardings
    only, no HloShardings stored (readers derive them, so a deserialized
    Exported has both; writers of versions < 6 must derive them too)."""
    if not exp._has_named_shardings:
        return exp
    return dataclasses.replace(
        exp, in_shardings_hlo=(None,) * len(exp.in_shardings_hlo),
        out_shardings_hlo=(None,) * len(exp.out_shardings_hlo))


def write_cases(version: int, src: str, dest: str,
                release: str | None = None) -> list[dict]:
    """Rewrite the golden dir ``src`` at ``version`` into ``dest``.  A case
    that jaxcolo's verdict says ``release`` cannot read gets
    ``expect_fail`` (the reason): the release must then fail on it."""
    from jaxcolo.export.detect import reader_verdict, scan
    import golden_types
    golden_types.register_serialization()
    golden_types.setup_testing_effects()
    manifest = json.load(open(os.path.join(GOLDEN, src, "manifest.json")))
    os.makedirs(dest, exist_ok=True)
    cases = []
    for case in manifest["cases"]:
        case = dict(case)
        if case["status"] != "ok":
            continue
        data = open(os.path.join(GOLDEN, src, case["file"]), "rb").read()
        exp = as_exported_by_jax(je.deserialize(data))
        try:
            out = je.serialize(exp, vjp_order=1 if exp.has_vjp() else 0,
                               version=version)
        except jaxcolo.EncodeError as e:
            case["status"] = "not expressible"
            case["reason"] = str(e)
            cases.append(case)
            continue
        assert je.serialization_version(out) <= version
        ok, why = reader_verdict(version, scan(out), release)
        if not ok:
            case["expect_fail"] = why
        open(os.path.join(dest, case["file"]), "wb").write(bytes(out))
        shutil.copy(os.path.join(GOLDEN, src, case["io_file"]), dest)
        cases.append(case)
    manifest = dict(manifest, cases=cases)
    json.dump(manifest, open(os.path.join(dest, "manifest.json"), "w"),
              indent=1)
    return cases


def run_release(venv: str, golden_dir: str, extra=()) -> dict[str, str]:
    """verify_golden.py in ``venv`` over ``golden_dir``: case -> line."""
    py = os.path.join(venv, "bin", "python")
    r = subprocess.run([py, os.path.join(HERE, "verify_golden.py"),
                        "--golden", golden_dir, *extra], capture_output=True,
                       text=True, timeout=1800)
    results = {}
    for line in r.stdout.splitlines():
        m = re.match(r"(PASS|FAIL|XFAIL|XPASS) jax-[^/]+/(\S+?)(:| |$)(.*)",
                     line)
        if m:
            results[m.group(2)] = (m.group(1), m.group(4).strip())
    if not results:
        results["<run>"] = ("FAIL", (r.stdout + r.stderr)[-2000:])
    return results


def _release_key(release: str) -> tuple:
    return tuple(int(x) for x in release.split("."))


def _module_too_new(msg: str, release: str, src: str) -> bool:
    """A failure to load the StableHLO bytecode of a source newer than the
    release: the Exported was read; its module (copied verbatim, made by
    the newer jaxlib) is past the old release's compatibility window."""
    return "Failed to deserialize StableHLO" in msg and \
        _release_key(src[4:]) > _release_key(release)


def _control_note(failure: str, control: dict) -> str:
    """What the release does with the unmodified source payload of a
    failed case: the same failure means a runtime limit of the release."""
    name, _, msg = failure.partition(": ")
    status, cmsg = control.get(name, ("", ""))
    if status != "FAIL":
        return ""
    if cmsg.strip()[:120] == msg.strip()[:120]:
        return (" [the unmodified source payload fails the same way: a "
                "runtime limit of this release, not the serialization]")
    return f" [the unmodified source payload fails differently: {cmsg[:120]}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--venv-root", default="/tmp/jaxvenvs")
    ap.add_argument("--out", default="/tmp/jaxcolo-cross")
    ap.add_argument("--report", default=os.path.join(GOLDEN,
                                                     "CROSS_RELEASE.md"))
    ap.add_argument("--versions", type=int, nargs="*")
    args = ap.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    rows = []
    totals = {"pass": 0, "fail": 0, "inexpressible": 0, "module_too_new": 0}
    for version, targets in sorted(TARGETS.items()):
        if args.versions and version not in args.versions:
            continue
        for release, src in targets:
            venv = os.path.join(args.venv_root, f"jax-{release}")
            root = os.path.join(args.out, f"v{version}-{release}-{src}")
            cases = write_cases(version, src, os.path.join(root, src),
                                release)
            if not os.path.exists(os.path.join(venv, "bin", "python")):
                totals["fail"] += 1  # unchecked is not passed
                rows.append((version, release, src, "-", "FAIL", "-",
                             f"no venv at {venv}: nothing checked"))
                print(f"v{version} -> jax {release}: FAIL, no venv at {venv}",
                      flush=True)
                continue
            results = run_release(venv, root)
            passed, failed, notes, too_new = [], [], [], []
            inexpressible = [c for c in cases
                             if c["status"] == "not expressible"]
            for c in cases:
                if c["status"] != "ok":
                    continue
                status, msg = results.get(c["name"], ("FAIL", "no result"))
                ok = status in ("PASS", "XPASS")
                if "expect_fail" in c:  # the verdict is what is checked
                    if ok:
                        failed.append(f"{c['name']}: read fine, but jaxcolo "
                                      f"says {release} cannot "
                                      f"({c['expect_fail']})")
                    else:
                        passed.append(c["name"])
                        notes.append(f"{c['name']} refused as predicted "
                                     f"({c['expect_fail']}): {msg[:120]}")
                elif ok:
                    passed.append(c["name"])
                elif _module_too_new(msg, release, src):
                    too_new.append(c["name"])
                else:
                    failed.append(f"{c['name']}: {msg[:200]}")
            if "<run>" in results:
                failed.append(results["<run>"][1][:500])
            if failed:
                # Control: the release on the unmodified source payloads.
                names = [f.split(":")[0] for f in failed]
                control = run_release(venv, GOLDEN, ["--versions", src[4:],
                                                     "--cases", *names])
                failed = [f + _control_note(f, control) for f in failed]
            totals["pass"] += len(passed)
            totals["fail"] += len(failed)
            totals["inexpressible"] += len(inexpressible)
            notes += [f"{c['name']} not expressible: "
                      f"{c['reason'][:160]}" for c in inexpressible]
            notes += [f"FAIL {f}" for f in failed]
            if too_new:
                totals["module_too_new"] += len(too_new)
                notes.append(f"read, but the StableHLO module (made by jax "
                             f"{src[4:]}) is too new for jax {release} to "
                             f"compile: {', '.join(too_new)}")
            rows.append((version, release, src, len(passed), len(failed),
                         len(inexpressible), "<br>".join(notes)))
            print(f"v{version} -> jax {release} (from {src}): "
                  f"{len(passed)} passed, {len(failed)} failed, "
                  f"{len(inexpressible)} not expressible", flush=True)
            for f in failed:
                print("   FAIL", f)
    write_report(args.report, rows, totals)
    print(f"totals: {totals}; report: {args.report}")
    if not totals["pass"]:
        print("nothing passed (no targets, or none could run): failing")
        return 1
    return 1 if totals["fail"] else 0


def write_report(path, rows, totals):
    import jax
    lines = [
        "# jaxcolo-written payloads read by older JAX releases",
        "",
        "Generated by `python tools/jax_golden/cross_release.py --venv-root "
        "/tmp/jaxvenvs` (writer: jaxcolo.export with jax "
        f"{jax.__version__}).  Each golden payload of the source directory "
        "is read with `jaxcolo.export.deserialize`, rewritten with "
        "`jaxcolo.export.serialize(exp, version=N)`, and then, in a venv "
        "of the JAX release whose newest serialization version is N, read "
        "with that release's `jax.export.deserialize`, called on the "
        "recorded inputs and compared with the recorded outputs "
        "(`verify_golden.py`).  Versions 7, 9 and 12 have no PyPI release; "
        "their payloads (and every other version's) are checked against "
        "jax 0.10.2 by tests/test_export_golden.py.",
        "",
        "| N | release | source goldens | passed | failed | not expressible "
        "at N | notes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in r) + " |")
    lines += ["", f"Totals: {totals['pass']} passed, {totals['fail']} "
              f"failed, {totals['inexpressible']} not expressible, "
              f"{totals['module_too_new']} read but with a StableHLO module "
              "too new for the release to compile.", ""]
    open(path, "w").write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

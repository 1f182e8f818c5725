#!/usr/bin/env python3
"""Write a pip constraints file from a resolved environment and print what changed (stdlib only).

Used by `make lock` and `make lock-gpu`; not part of the package.

  pip freeze --all --exclude-editable | lock.py freeze OUT [--drop NAME ...]
      pins from a real environment (the CPU stack, installed in a throwaway venv)
  lock.py report OUT REPORT.json [--drop NAME ...]
      pins from `pip install --dry-run --report` (the GPU stack, resolved for another platform)
  lock.py subset CONSTRAINTS NAME ...
      the pins of NAME ... from a constraints file (the CPU-tested versions the GPU resolve reuses)
  lock.py stub-wheel DIR NAME VERSION [REQUIREMENT ...]
      a metadata-only wheel standing in for a source-only package during a cross-platform resolve
  lock.py without CONSTRAINTS NAME ...
      a constraints file's pins minus NAME ... (`make test-compat`: the CPU pins around another vLLM)
  lock.py wheel-requires WHEEL [--drop NAME ...] [--pin NAME]
      a wheel's unconditional Requires-Dist lines (no extras) minus NAME ...; with --pin, only the version that
      its `NAME==X` requirement pins (local label dropped: `torch==2.11.0+cpu` -> 2.11.0)

OUT keeps its leading comment block (hand-written documentation); only its `# Resolved:` line and the pins are
rewritten, and only when a pin changed. Names are normalised (PEP 503), local version labels (`+cpu`) are dropped
so that a pin matches both the local wheel and the index build, and pip/wheel are never pinned.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import sys
import zipfile
from datetime import date
from pathlib import Path

ALWAYS_DROP = {"pip", "wheel", "distribute"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(lines) -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-") or " @ " in line:  # options, editables, direct URLs
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*===?\s*([^\s;]+)", line)
        if not m:
            sys.exit(f"lock.py: cannot read pin {raw.strip()!r}")
        pins[canonical(m.group(1))] = m.group(2).split("+", 1)[0]
    return pins


def read_existing(out: Path) -> tuple[list[str], dict[str, str]]:
    if not out.exists():
        return [], {}
    lines = out.read_text(encoding="utf-8").splitlines()
    header: list[str] = []
    for line in lines:
        if line.strip() and not line.startswith("#"):
            break
        header.append(line)
    while header and not header[-1].strip():
        header.pop()
    return header, parse_pins(lines[len(header) :])


def write(out: Path, pins: dict[str, str], resolved: str) -> None:
    if len(pins) < 10:
        sys.exit(f"lock.py: only {len(pins)} pins resolved; {out} left as it was")
    header, old = read_existing(out)
    if pins == old:  # no churn: keep the file (and its `# Resolved:` line) as it is
        print(f"{out}: {len(pins)} pins; unchanged, file left as it was")
        return
    stamp = f"# Resolved: {resolved}"
    if any(line.startswith("# Resolved:") for line in header):
        header = [stamp if line.startswith("# Resolved:") else line for line in header]
    else:
        header = [*(header or [f"# pip constraints, written by constraints/lock.py ({out.name})."]), stamp]
    body = [f"{name}=={pins[name]}" for name in sorted(pins)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join([*header, "", *body]) + "\n", encoding="utf-8")

    changed = sorted(n for n in pins.keys() & old.keys() if pins[n] != old[n])
    added = sorted(pins.keys() - old.keys())
    removed = sorted(old.keys() - pins.keys())
    print(f"{out}: {len(pins)} pins; {len(changed)} changed, {len(added)} added, {len(removed)} removed")
    for n in changed:
        print(f"  changed  {n} {old[n]} -> {pins[n]}")
    if old:  # a first lock lists nothing: every pin would be "added"
        for n in added:
            print(f"  added    {n}=={pins[n]}")
    for n in removed:
        print(f"  removed  {n}=={old[n]}")


def drop(pins: dict[str, str], names) -> dict[str, str]:
    gone = ALWAYS_DROP | {canonical(n) for n in names}
    return {n: v for n, v in pins.items() if n not in gone}


def cmd_freeze(args) -> None:
    pins = drop(parse_pins(sys.stdin), args.drop)
    resolved = f"{date.today().isoformat()}, {args.note}" if args.note else date.today().isoformat()
    write(Path(args.out), pins, resolved)


def cmd_report(args) -> None:
    report = json.loads(Path(args.report).read_text(encoding="utf-8"))
    pins = {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}
    env = report.get("environment", {})
    note = f"pip {report.get('pip_version', '?')} --dry-run --report for Python {env.get('python_full_version', '?')}"
    if args.note:
        note += f", {args.note}"
    write(Path(args.out), drop(pins, args.drop), f"{date.today().isoformat()}, {note}")


def cmd_subset(args) -> None:
    """Print the pins of NAMES from a constraints file (the CPU-tested versions the GPU resolve must reuse)."""
    pins = parse_pins(Path(args.constraints).read_text(encoding="utf-8").splitlines())
    missing = [n for n in args.names if canonical(n) not in pins]
    if missing:
        sys.exit(f"lock.py: {args.constraints} has no pin for {' '.join(missing)}")
    print("\n".join(f"{canonical(n)}=={pins[canonical(n)]}" for n in args.names))


def cmd_stub_wheel(args) -> None:
    """A wheel with METADATA only: lets the resolver see a source-only package's declared dependencies without
    building it (a CUDA extension cannot be built here). Nothing from it is ever installed."""
    dist = f"{args.name.replace('-', '_')}-{args.version}"
    meta = [
        "Metadata-Version: 2.1",
        f"Name: {args.name}",
        f"Version: {args.version}",
        *(f"Requires-Dist: {req}" for req in args.requires),
    ]
    files = {
        f"{dist}.dist-info/METADATA": "\n".join(meta) + "\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: lock.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    target = Path(args.dir) / f"{dist}-py3-none-any.whl"
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(target, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    print(target)


def cmd_without(args) -> None:
    """Print a constraints file's pins minus NAMES (what stays fixed when one package moves)."""
    gone = {canonical(n) for n in args.names}
    pins = parse_pins(Path(args.constraints).read_text(encoding="utf-8").splitlines())
    print("\n".join(f"{n}=={v}" for n, v in sorted(pins.items()) if n not in gone))


def wheel_requires(wheel: str) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA that no extra gates."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        lines = zf.read(meta).decode("utf-8").splitlines()
    reqs = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if not re.search(r"\bextra\s*==", r)]


def cmd_wheel_requires(args) -> None:
    reqs = wheel_requires(args.wheel)
    name_of = {r: canonical(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group(0)) for r in reqs}  # type: ignore[union-attr]
    if args.pin:
        for r in reqs:
            m = re.match(r"[A-Za-z0-9._-]+\s*===?\s*([^\s;,]+)", r)
            if name_of[r] == canonical(args.pin) and m:
                print(m.group(1).split("+", 1)[0])
                return
        sys.exit(f"lock.py: {args.wheel} pins no version of {args.pin}")
    gone = {canonical(n) for n in args.drop}
    print("\n".join(r for r in reqs if name_of[r] not in gone))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("freeze")
    f.add_argument("out")
    f.add_argument("--drop", nargs="*", default=[])
    f.add_argument("--note", default="")
    f.set_defaults(fn=cmd_freeze)
    r = sub.add_parser("report")
    r.add_argument("out")
    r.add_argument("report")
    r.add_argument("--drop", nargs="*", default=[])
    r.add_argument("--note", default="")
    r.set_defaults(fn=cmd_report)
    c = sub.add_parser("subset")
    c.add_argument("constraints")
    c.add_argument("names", nargs="+")
    c.set_defaults(fn=cmd_subset)
    s = sub.add_parser("stub-wheel")
    s.add_argument("dir")
    s.add_argument("name")
    s.add_argument("version")
    s.add_argument("requires", nargs="*")
    s.set_defaults(fn=cmd_stub_wheel)
    w = sub.add_parser("without")
    w.add_argument("constraints")
    w.add_argument("names", nargs="+")
    w.set_defaults(fn=cmd_without)
    q = sub.add_parser("wheel-requires")
    q.add_argument("wheel")
    q.add_argument("--drop", nargs="*", default=[])
    q.add_argument("--pin", default="")
    q.set_defaults(fn=cmd_wheel_requires)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()

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
  lock.py stub-env DIR REPORT.json ROOT ...
      metadata-only wheels of ROOT ... and everything they need (from a --report): an environment's preinstalled
      packages (a container's torch) to install into a throwaway venv, so that a dry run sees them as installed
  lock.py closure REPORT.json ROOT ...
      the names of ROOT ... and everything they need in a --report, one a line
  lock.py check-plan PLAN.json NAME ... [--allow NAME ...]
      exits 1, naming them, when a `pip install --dry-run --report` plan would install any of NAME ... (those also
      in --allow only print a notice)
  lock.py fetch PLAN.json DEST [--head]
      download every file a dry-run plan installs into DEST (sha256 checked; local files copied; the project
      itself and metadata-only stand-ins skipped); with --head only ask each file's size (DEST/sizes.tsv)
  lock.py sdist NAME VERSION DEST
      download NAME's source distribution from PyPI's simple index (what must be built on the target machine)
  lock.py manifest DEST
      write DEST/manifest.json and DEST/manifest.tsv (file, name, version, sha256, bytes) for a wheelhouse
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
    print(stub_wheel(Path(args.dir), args.name, args.version, args.requires))


def stub_wheel(directory: Path, name: str, version: str, requires, extras=()) -> Path:
    dist = f"{re.sub(r'[-.]+', '_', name)}-{version}"
    meta = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Provides-Extra: {extra}" for extra in extras),
        *(f"Requires-Dist: {req}" for req in requires),
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
    target = directory / f"{dist}-py3-none-any.whl"
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(target, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return target


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare interpreter: pip's vendored copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    return Requirement


def closure(report: dict, roots) -> list[dict]:
    """The install items of ROOTS and, transitively, of what they require on the report's platform (markers
    evaluated against the report's environment, extras followed where requested)."""
    requirement = _requirement_class()
    env = dict(report.get("environment", {}))
    items = {canonical(i["metadata"]["name"]): i for i in report["install"]}
    todo = [(canonical(r), "") for r in roots]
    seen: dict[str, set[str]] = {}
    while todo:
        name, extra = todo.pop()
        if name not in items or extra in seen.get(name, set()):
            continue
        seen.setdefault(name, set()).add(extra)
        for raw in items[name]["metadata"].get("requires_dist", []) or []:
            req = requirement(raw)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
                continue
            todo.append((canonical(req.name), ""))
            todo.extend((canonical(req.name), e) for e in req.extras)
    return [items[n] for n in sorted(seen)]


def cmd_closure(args) -> None:
    report = json.loads(Path(args.report).read_text(encoding="utf-8"))
    print("\n".join(canonical(i["metadata"]["name"]) for i in closure(report, args.roots)))


def cmd_stub_env(args) -> None:
    report = json.loads(Path(args.report).read_text(encoding="utf-8"))
    for item in closure(report, args.roots):
        m = item["metadata"]
        stub_wheel(
            Path(args.dir), m["name"], m["version"], m.get("requires_dist", []) or [], m.get("provides_extra", []) or []
        )
        print(f"{canonical(m['name'])}=={m['version']}")


def check_plan(plan: dict, forbidden) -> list[str]:
    """The ``name==version`` entries of a dry-run plan whose names are in FORBIDDEN (canonical names)."""
    gone = {canonical(n) for n in forbidden}
    return sorted(
        f"{canonical(i['metadata']['name'])}=={i['metadata']['version']}"
        for i in plan["install"]
        if canonical(i["metadata"]["name"]) in gone
    )


def cmd_check_plan(args) -> None:
    plan = json.loads(Path(args.plan).read_text(encoding="utf-8"))
    names = [canonical(n) for n in args.names]
    if len(names) == 1 and Path(args.names[0]).is_file():  # a file of names, one a line
        names = [canonical(n) for n in Path(args.names[0]).read_text(encoding="utf-8").split()]
    allowed = {canonical(n) for n in args.allow}
    touched = check_plan(plan, names)
    bad = [b for b in touched if b.split("==")[0] not in allowed]
    print(f"{args.plan}: the plan installs {len(plan['install'])} packages; {len(bad)} of the {len(names)} forbidden")
    for b in sorted(set(touched) - set(bad)):
        print(f"  notice: the plan changes the environment's {b} (allowed: --allow)")
    if bad:
        sys.exit("lock.py: the install would replace the environment's " + " ".join(bad))


def _file_of(item: dict) -> tuple[str, str] | None:
    """(url, sha256) of a plan item's file, or None for a directory (the project) or a stand-in."""
    info = item.get("download_info", {})
    url = info.get("url", "")
    if "dir_info" in info or not url:
        return None
    digest = info.get("archive_info", {}).get("hashes", {}).get("sha256", "")
    if url.startswith("file:") and "lockstub" in url:
        return None
    return url, digest


def cmd_fetch(args) -> None:
    import shutil
    import urllib.parse
    import urllib.request

    plan = json.loads(Path(args.plan).read_text(encoding="utf-8"))
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    total, count, sizes = 0, 0, ["file\tversion\tbytes"]
    for item in plan["install"]:
        found = _file_of(item)
        if found is None:
            continue
        url, digest = found
        name = urllib.parse.unquote(Path(urllib.parse.urlparse(url).path).name)
        target = dest / name
        if args.head:
            if url.startswith("file:"):
                size = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).stat().st_size
            else:
                with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
                    size = int(r.headers["Content-Length"])
            total, count = total + size, count + 1
            sizes.append(f"{name}\t{item['metadata']['version']}\t{size}")
            continue
        if not (target.exists() and (not digest or _sha256(target) == digest)):
            if url.startswith("file:"):
                shutil.copyfile(urllib.parse.unquote(urllib.parse.urlparse(url).path), target)
            else:
                with urllib.request.urlopen(url, timeout=600) as r, open(target, "wb") as f:
                    shutil.copyfileobj(r, f, 1 << 20)
            if digest and _sha256(target) != digest:
                target.unlink()
                sys.exit(f"lock.py: sha256 mismatch for {url}")
        total, count = total + target.stat().st_size, count + 1
    if args.head:
        (dest / "sizes.tsv").write_text("\n".join(sizes) + "\n", encoding="utf-8")
    print(
        f"{args.dest}: {count} files, {total / 2**30:.2f} GiB"
        + (" (sizes only, nothing downloaded)" if args.head else "")
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_filename(filename: str) -> tuple[str, str]:
    """(canonical name, version) of a wheel or sdist file name."""
    if filename.endswith(".whl"):
        name, version = filename.split("-")[:2]
    else:
        stem = re.sub(r"\.(tar\.gz|zip|tar\.bz2)$", "", filename)
        name, version = stem.rsplit("-", 1)
    return canonical(name), version


def cmd_sdist(args) -> None:
    import shutil
    import urllib.request

    index = f"https://pypi.org/simple/{canonical(args.name)}/"
    req = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    for f in files:
        if f["filename"].endswith(".tar.gz") and parse_filename(f["filename"]) == (canonical(args.name), args.version):
            target = Path(args.dest) / f["filename"]
            target.parent.mkdir(parents=True, exist_ok=True)
            with urllib.request.urlopen(f["url"], timeout=600) as r, open(target, "wb") as out:
                shutil.copyfileobj(r, out)
            if _sha256(target) != f["hashes"]["sha256"]:
                target.unlink()
                sys.exit(f"lock.py: sha256 mismatch for {f['url']}")
            print(target)
            return
    sys.exit(f"lock.py: no sdist of {args.name} {args.version} on {index}")


def cmd_manifest(args) -> None:
    dest = Path(args.dest)
    rows = []
    for path in sorted(dest.iterdir()):
        if path.name.startswith("manifest.") or not path.name.endswith((".whl", ".tar.gz", ".zip")):
            continue
        name, version = parse_filename(path.name)
        rows.append(
            {"file": path.name, "name": name, "version": version, "sha256": _sha256(path), "bytes": path.stat().st_size}
        )
    extra = {}
    target = dest / "TARGET"
    if target.exists():
        extra["target"] = target.read_text(encoding="utf-8").strip()
    total = sum(r["bytes"] for r in rows)
    (dest / "manifest.json").write_text(json.dumps({**extra, "files": rows, "bytes": total}, indent=1) + "\n")
    lines = [
        "file\tname\tversion\tsha256\tbytes",
        *(f"{r['file']}\t{r['name']}\t{r['version']}\t{r['sha256']}\t{r['bytes']}" for r in rows),
    ]
    (dest / "manifest.tsv").write_text("\n".join(lines) + "\n")
    print(f"{dest}: manifest of {len(rows)} files, {total / 2**30:.2f} GiB")


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
    e = sub.add_parser("stub-env")
    e.add_argument("dir")
    e.add_argument("report")
    e.add_argument("roots", nargs="+")
    e.set_defaults(fn=cmd_stub_env)
    k = sub.add_parser("closure")
    k.add_argument("report")
    k.add_argument("roots", nargs="+")
    k.set_defaults(fn=cmd_closure)
    p = sub.add_parser("check-plan")
    p.add_argument("plan")
    p.add_argument("names", nargs="+")
    p.add_argument("--allow", nargs="*", default=[], help="forbidden names whose change only prints a notice")
    p.set_defaults(fn=cmd_check_plan)
    g = sub.add_parser("fetch")
    g.add_argument("plan")
    g.add_argument("dest")
    g.add_argument("--head", action="store_true")
    g.set_defaults(fn=cmd_fetch)
    d = sub.add_parser("sdist")
    d.add_argument("name")
    d.add_argument("version")
    d.add_argument("dest")
    d.set_defaults(fn=cmd_sdist)
    m = sub.add_parser("manifest")
    m.add_argument("dest")
    m.set_defaults(fn=cmd_manifest)
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

#!/usr/bin/env python
"""Check the commit messages made since the commit-message convention began (docs/development.md, "Commits").

Every commit after ``BASE`` must have a subject of at most 72 characters that does not end with a period, and a
blank second line when the message has a body. History before ``BASE`` is left as it is (no rewrite). Exits 1 and
lists each offending commit; exits 0 with one line when there is nothing to check: not a git checkout, or
``BASE`` not in its history (a shallow clone).

Example:
    python tools/check_commit_subjects.py                 # the checkout this file is in, since BASE
    python tools/check_commit_subjects.py --repo DIR --base abc1234
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

#: The last commit before the convention ("Review mends: half_engine_refusal loses its flag parameter ...").
BASE = "21796a52442400a429ca6f62c12404215f96026b"
MAX_SUBJECT = 72


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)


def message_problems(message: str) -> list[str]:
    """What breaks the convention in one raw commit message (``git log --format=%B``); empty when nothing does."""
    lines = message.rstrip("\n").split("\n")
    subject = lines[0]
    problems = []
    if len(subject) > MAX_SUBJECT:
        problems.append(f"subject is {len(subject)} characters (at most {MAX_SUBJECT})")
    if subject.rstrip().endswith("."):
        problems.append("subject ends with '.'")
    if len(lines) > 1 and lines[1].strip():
        problems.append("line 2 is not blank (the body starts after a blank line)")
    return problems


def check(repo: Path, base: str) -> tuple[int, list[str]]:
    """Check every commit in ``base..HEAD`` of ``repo``.

    Returns:
        (exit code, report lines): 0 and one line when all pass or there is nothing to check, 1 and one line per
        offending commit (after a header) otherwise.
    """
    if _git(repo, "rev-parse", "--is-inside-work-tree").returncode != 0:
        return 0, [f"commit subjects: skipped, {repo} is not a git checkout"]
    if _git(repo, "cat-file", "-e", f"{base}^{{commit}}").returncode != 0:
        return 0, [f"commit subjects: skipped, base {base[:12]} is not in this history (a shallow clone?)"]
    if _git(repo, "merge-base", "--is-ancestor", base, "HEAD").returncode != 0:
        return 0, [f"commit subjects: skipped, base {base[:12]} is not an ancestor of HEAD"]
    log = _git(repo, "log", "--format=%H%x00%B%x00", f"{base}..HEAD")
    if log.returncode != 0:
        return 1, [f"commit subjects: git log failed: {log.stderr.strip()}"]
    fields = log.stdout.split("\x00")
    offenders = []
    count = 0
    for sha, message in zip(fields[0::2], fields[1::2], strict=False):
        sha = sha.strip()
        if not sha:
            continue
        count += 1
        problems = message_problems(message)
        if problems:
            subject = message.strip().split("\n", 1)[0]
            shown = subject if len(subject) <= 80 else subject[:77] + "..."
            offenders.append(f"  {sha[:10]} {shown}\n    " + "; ".join(problems))
    if offenders:
        header = (
            f"commit subjects: {len(offenders)} of {count} commits since {base[:12]} break the convention "
            "(docs/development.md, 'Commits'):"
        )
        return 1, [header, *offenders]
    return 0, [f"commit subjects: {count} commit{'' if count == 1 else 's'} since {base[:12]} ok"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--repo", type=Path, default=Path(__file__).resolve().parents[1], help="the checkout (default: this one)"
    )
    p.add_argument("--base", default=BASE, help="check the commits after this one (default: BASE in this file)")
    args = p.parse_args(argv)
    code, lines = check(args.repo, args.base)
    print("\n".join(lines), file=sys.stderr if code else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""tools/check_commit_subjects.py, the commit-message check of `make lint`, on throwaway git repositories: commits
after the base pass or fail on their subject's length, a final period and a non-blank line 2; history before the
base is never checked; a directory outside git and a shallow clone without the base are skipped with one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_commit_subjects.py"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}

pytestmark = pytest.mark.skipif(
    subprocess.run(["git", "--version"], capture_output=True, check=False).returncode != 0, reason="no git"
)


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True)
    return done.stdout.strip()


def commit(repo: Path, message: str) -> str:
    git(repo, "commit", "-q", "--allow-empty", "--cleanup=verbatim", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, check=False)


@pytest.fixture
def repo(tmp_path):
    """A repository whose first commit breaks every rule and is the base; returns (path, base)."""
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    base = commit(path, "x" * 200 + ".\nno blank line")
    return path, base


def test_commits_that_follow_the_convention_pass_and_history_before_the_base_is_not_checked(repo):
    path, base = repo
    commit(path, "Add the check")
    commit(path, "y" * 72 + "\n\nWhy, with the measurements: 1.2 s -> 0.4 s.\n")
    done = run_tool("--repo", str(path), "--base", base)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"commit subjects: 2 commits since {base[:12]} ok"


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ("z" * 73, "subject is 73 characters (at most 72)"),
        ("Fix the thing.", "subject ends with '.'"),
        ("Fix the thing\nand a body without a blank line", "line 2 is not blank"),
    ],
    ids=["too-long", "final-period", "line-2"],
)
def test_each_broken_rule_fails_naming_the_commit_and_the_rule(repo, message, problem):
    path, base = repo
    commit(path, "Add a good one")
    bad = commit(path, message)
    commit(path, "Add another good one")
    done = run_tool("--repo", str(path), "--base", base)
    assert done.returncode == 1
    assert f"1 of 3 commits since {base[:12]}" in done.stderr
    assert bad[:10] in done.stderr and problem in done.stderr


def test_outside_a_checkout_or_without_the_base_it_skips_with_one_line(repo, tmp_path):
    outside = tmp_path / "plain"
    outside.mkdir()
    done = run_tool("--repo", str(outside))
    assert done.returncode == 0 and done.stdout.count("\n") == 1 and "not a git checkout" in done.stdout

    path, base = repo
    commit(path, "Add one")
    commit(path, "Add two")
    shallow = tmp_path / "shallow"
    subprocess.run(
        ["git", "clone", "-q", "--depth", "1", f"file://{path}", str(shallow)],
        check=True,
        env={**os.environ, **GIT_ENV},
    )
    done = run_tool("--repo", str(shallow), "--base", base)
    assert done.returncode == 0 and done.stdout.count("\n") == 1 and "not in this history" in done.stdout


def test_the_recorded_base_is_a_full_commit_id():
    """`make lint` checks this checkout since BASE; a short or mistyped id would skip the check silently."""
    source = TOOL.read_text()
    base = source.split('BASE = "', 1)[1].split('"', 1)[0]
    assert len(base) == 40 and all(c in "0123456789abcdef" for c in base)

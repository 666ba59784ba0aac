"""Mooncake Store 0.3.13 as an anchor for our benchmarks, measured in the same run.

`mooncake_cluster()` starts a private cluster: `mooncake_master` (RPC and metrics on
127.0.0.1, no etcd and no HTTP metadata server: clients use P2PHANDSHAKE) plus a
storage process, a Python child that mounts one big global segment over "tcp" and
then waits. A benchmark child calls `open_store()` and one of the `measure_*` helpers,
each of which returns GB/s for one bounded loop (call it a few times, take the median).

Placement is forced with ReplicateConfig.preferred_segment and checked on the first
key through get_replica_desc: "remote" puts land in the storage process's segment (the
client mounts none), so every get crosses processes over TCP; "local" puts land in the
client's own segment, where Mooncake's TCP-only build copies with memcpy.

Caveat: Mooncake 0.3.13 binds its transfer-engine handshake port and TCP data port on
the wildcard address (hard-coded); peers still reach each other through 127.0.0.1.

Usage: python benchmarks/mooncake_anchor.py [--block-mib 1] [--budget-mib 256]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import itertools
import json
import multiprocessing as mp
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from mooncake.store import MooncakeDistributedStore as Store
    from mooncake.store import ReplicateConfig

PIP_HINT = "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1"
APT_HINT = "apt-get install libibverbs1 librdmacm1 libnuma1"
OPS = ("get", "get_into", "put", "put_from")
N_KEYS = 16  # live keys per measurement: enough to defeat caches, far below any segment
HOST = "127.0.0.1"
# INFO logging costs a dozen stderr lines per client; read once, when store.so loads.
ENV_DEFAULTS = {"MC_LOG_LEVEL": "WARNING"}
Where = Literal["local", "remote"]
_seq = itertools.count()
_LIBC = ctypes.CDLL(None)


@dataclass(frozen=True)
class MooncakeCluster:
    """What a client in another process needs; picklable, so it can go to a spawn child."""

    master_addr: str  # "127.0.0.1:port" for setup()'s master_server_addr
    metadata_server: str  # "P2PHANDSHAKE": peers exchange segment metadata directly
    storage_segment: str  # storage process's hostname, used as preferred_segment
    storage_endpoint: str  # transport endpoint its replicas report (placement check)
    version: str


def available() -> str | None:
    """None if Mooncake can run here, else one line saying what to install.

    Shared libraries are probed first because a failed `import mooncake.store` only
    names the first missing one.
    """
    for lib in ("libibverbs.so.1", "libnuma.so.1"):
        try:
            ctypes.CDLL(lib)
        except OSError:
            return f"shared library {lib} not found: {APT_HINT}"
    if importlib.util.find_spec("mooncake") is None:
        return f"python package mooncake not installed: {PIP_HINT}"
    try:
        _store_module()
    except (ImportError, OSError) as e:
        return f"mooncake.store not importable ({e}): {PIP_HINT}"
    if not os.access(_master_binary(), os.X_OK):
        return f"{_master_binary()} missing or not executable: {PIP_HINT}"
    return None


def _store_module() -> Any:
    """Import mooncake.store with ENV_DEFAULTS applied (too late once store.so is loaded)."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import mooncake.store

    return mooncake.store


def _master_binary() -> Path:
    import mooncake

    return Path(next(iter(mooncake.__path__))) / "mooncake_master"


def _version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "unknown"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the parent dies without cleaning up."""
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG; libc loaded before fork, not after


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM, wait, then SIGKILL: only the process we started, by its PID."""
    if proc.stdin:
        proc.stdin.close()  # the storage child exits on EOF, closing its store cleanly
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout:
        proc.stdout.close()


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else ""


@contextlib.contextmanager
def mooncake_cluster(
    storage_bytes: int = 1 << 30, start_timeout_s: float = 30.0
) -> Iterator[MooncakeCluster]:
    """Start master + storage process, yield their addresses, stop both on exit or error.

    Logs go to a temporary directory (quoted in the error if startup fails) so they do
    not interleave with benchmark output.
    """
    reason = available()
    if reason:
        raise RuntimeError(f"mooncake unavailable: {reason}")
    env = {**ENV_DEFAULTS, **os.environ}
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="mooncake-anchor-") as tmp:
        log = Path(tmp) / "cluster.log"
        try:
            with log.open("ab") as out:
                rpc, metrics = _free_port(), _free_port()
                master = [str(_master_binary()), f"--rpc_address={HOST}", f"--rpc_port={rpc}"]
                master += [f"--metrics_host={HOST}", f"--metrics_port={metrics}"]
                master += ["--enable_http_metadata_server=false", "--logtostderr", "-minloglevel=1"]
                kw = {"stdin": subprocess.DEVNULL, "stdout": out, "stderr": out, "env": env}
                kw["preexec_fn"] = _die_with_parent
                procs.append(subprocess.Popen(master, **kw))
                _wait_port(rpc, procs[0], start_timeout_s, log)
                cmd = [sys.executable, __file__, "--storage", f"{HOST}:{rpc}", str(storage_bytes)]
                kw |= {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
                procs.append(subprocess.Popen(cmd, **kw))
                info = json.loads(_readline(procs[1], start_timeout_s, log))
            yield MooncakeCluster(
                f"{HOST}:{rpc}", "P2PHANDSHAKE", info["segment"], info["endpoint"], _version()
            )
        finally:
            for proc in reversed(procs):
                _stop(proc)


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"mooncake_master did not listen on {HOST}:{port}:\n{_tail(log)}")


def _readline(proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if sel.select(timeout_s):
            line = proc.stdout.readline().decode()
            if line.strip():
                return line
    raise RuntimeError(f"mooncake storage process did not start:\n{_tail(log)}")


def open_store(
    cluster: MooncakeCluster, local_segment_bytes: int = 0, local_buffer_bytes: int = 64 << 20
) -> Store:
    """A client for `cluster`, for use in a benchmark child process.

    local_segment_bytes=0 mounts no segment ("remote"); >0 mounts one the client's own
    puts can prefer ("local"). local_buffer_bytes stages get()/put() of bytes objects,
    so it must exceed the block size. The master is probed first because setup()
    against a dead master retries for minutes instead of failing. The store's listening
    sockets are not close-on-exec: fork()ed children (os.system) inherit them.
    """
    host, port = cluster.master_addr.rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()
    store = _store_module().MooncakeDistributedStore()
    sizes = (local_segment_bytes, local_buffer_bytes)
    with tempfile.TemporaryFile() as err:  # setup() always logs 2 harmless lines to fd 2
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            rc = store.setup(HOST, cluster.metadata_server, *sizes, "tcp", "", cluster.master_addr)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if rc != 0:
            err.seek(0)
            raise RuntimeError(f"setup() returned {rc}:\n{err.read().decode(errors='replace')}")
    return store


def replicate_config(store: Store, cluster: MooncakeCluster, where: Where) -> ReplicateConfig:
    """One replica, placed in the client's own segment ("local") or the storage's."""
    cfg = _store_module().ReplicateConfig()
    cfg.replica_num = 1
    cfg.preferred_segment = store.get_hostname() if where == "local" else cluster.storage_segment
    return cfg


def endpoint_of(store: Store, key: str) -> str:
    """Transport endpoint of the segment holding key's first replica."""
    replica = store.get_replica_desc(key)[0]
    return str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)


def _check_placement(store: Store, cluster: MooncakeCluster, key: str, where: Where) -> None:
    remote = endpoint_of(store, key) == cluster.storage_endpoint
    if remote != (where == "remote"):
        raise RuntimeError(f"{key} landed {'remote' if remote else 'local'}, wanted {where}")


def measure(
    store: Store,
    cluster: MooncakeCluster,
    op: str,
    where: Where,
    block_bytes: int = 1 << 20,
    budget_bytes: int = 256 << 20,
) -> float:
    """GB/s (1e9 bytes/s) of budget_bytes moved by `op` in block_bytes objects.

    Timed: gets/get_intos on 16 pre-put keys as one loop; puts/put_froms each timed
    alone. Untimed: the 16 pre-puts, one warm-up get, and removes. Every put uses a
    fresh key (put on an existing key returns 0 but stores nothing) after removing the
    key from 16 puts back, so at most 16 objects are live. One call is one sample.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}")
    cfg = replicate_config(store, cluster, where)
    n_ops = max(N_KEYS, budget_bytes // block_bytes)
    prefix = f"anchor-{os.getpid()}-{next(_seq)}-{op}"
    buf = np.frombuffer(os.urandom(block_bytes), dtype=np.uint8).copy()
    ptr, payload = buf.ctypes.data, buf.tobytes()
    fns: dict[str, Callable[[str], bool]] = {
        "get": lambda k: len(store.get(k)) == block_bytes,
        "get_into": lambda k: store.get_into(k, ptr, block_bytes) == block_bytes,
        "put": lambda k: store.put(k, payload, cfg) == 0,
        "put_from": lambda k: store.put_from(k, ptr, block_bytes, cfg) == 0,
    }
    fn, live = fns[op], [f"{prefix}-{i}" for i in range(N_KEYS)]
    if op in ("get_into", "put_from") and store.register_buffer(ptr, block_bytes) != 0:
        raise RuntimeError("register_buffer failed")
    try:
        for key in live:
            if store.put(key, payload, cfg) != 0:
                raise RuntimeError(f"put {key} failed")
        _check_placement(store, cluster, live[0], where)
        elapsed = 0.0
        if op.startswith("get"):
            fn(live[0])  # warm-up; the pre-puts already warmed the write path
            t0 = time.perf_counter()
            if not all(fn(live[i % N_KEYS]) for i in range(n_ops)):
                raise RuntimeError(f"{op} returned a short or failed read")
            elapsed = time.perf_counter() - t0
        for i in range(n_ops if op.startswith("put") else 0):
            if store.remove(live[i % N_KEYS], True) != 0:  # else the segment fills up
                raise RuntimeError(f"remove {live[i % N_KEYS]} failed")
            live[i % N_KEYS] = key = f"{prefix}-{i}-w"
            t0 = time.perf_counter()
            ok = fn(key)
            elapsed += time.perf_counter() - t0
            if not ok:
                raise RuntimeError(f"{op} {key} failed")
        if op.startswith("put"):
            _check_placement(store, cluster, live[0], where)
        return n_ops * block_bytes / elapsed / 1e9
    finally:
        for key in live:
            store.remove(key, True)  # force: a get leaves a lease that blocks remove
        if op in ("get_into", "put_from"):
            store.unregister_buffer(ptr)


def measure_get(store: Store, cluster: MooncakeCluster, where: Where, **kw: int) -> float:
    """store.get -> bytes: Mooncake stages through its local buffer, then copies to bytes."""
    return measure(store, cluster, "get", where, **kw)


def measure_get_into(store: Store, cluster: MooncakeCluster, where: Where, **kw: int) -> float:
    """store.get_into a registered numpy buffer: Mooncake's zero-copy read path."""
    return measure(store, cluster, "get_into", where, **kw)


def measure_put(store: Store, cluster: MooncakeCluster, where: Where, **kw: int) -> float:
    """store.put of a bytes object (staged through the client's local buffer)."""
    return measure(store, cluster, "put", where, **kw)


def measure_put_from(store: Store, cluster: MooncakeCluster, where: Where, **kw: int) -> float:
    """store.put_from a registered numpy buffer: Mooncake's zero-copy write path."""
    return measure(store, cluster, "put_from", where, **kw)


def run_op(
    cluster: MooncakeCluster,
    op: str,
    where: Where,
    block_bytes: int = 1 << 20,
    budget_bytes: int = 256 << 20,
) -> float:
    """Open a client, measure once, close it: the body of one benchmark child process."""
    segment = max(512 << 20, 4 * N_KEYS * block_bytes) if where == "local" else 0
    store = open_store(cluster, segment, max(64 << 20, 4 * block_bytes))
    try:
        return measure(store, cluster, op, where, block_bytes, budget_bytes)
    finally:
        store.close()


def _storage_main(master_addr: str, segment_bytes: int) -> int:
    """The storage process: mount a segment, report where it is, wait for stdin EOF."""
    cluster = MooncakeCluster(master_addr, "P2PHANDSHAKE", "", "", "")
    store = open_store(cluster, segment_bytes, 16 << 20)
    probe = "anchor-storage-probe"
    cfg = replicate_config(store, cluster, "local")
    if store.put(probe, b"\0" * 4096, cfg) != 0:
        raise RuntimeError("storage probe put failed")
    info = {"segment": store.get_hostname(), "endpoint": endpoint_of(store, probe)}
    store.remove(probe, True)
    print(json.dumps(info), flush=True)
    sys.stdin.read()  # EOF: the cluster owner closed our stdin or died
    store.close()
    return 0


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-mib", type=int, default=1)
    parser.add_argument("--budget-mib", type=int, default=256)
    args = parser.parse_args()
    reason = available()
    if reason:
        print(f"mooncake unavailable: {reason}")
        return 1
    block, budget = args.block_mib << 20, args.budget_mib << 20
    with mooncake_cluster() as cluster:
        print(f"mooncake {cluster.version}: master {cluster.master_addr}, pid {os.getpid()}")
        for where in ("remote", "local"):
            for op in OPS:  # a fresh spawn child per measurement, like our benchmarks
                with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
                    gbps = pool.submit(run_op, cluster, op, where, block, budget).result(120)
                print(
                    f"mooncake {where:<6} {op:<8} {args.block_mib} MiB: {gbps:6.2f} GB/s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--storage"]:
        sys.exit(_storage_main(sys.argv[2], int(sys.argv[3])))
    sys.exit(_main())

"""``kvstore serve --shards N``: one node served by N processes, and the supervisor that
keeps them.

Why processes: a put's server-side work is Python (kvstore/wire/shards.py), so one
interpreter serves one request at a time; N shard processes serve N. The supervisor
(this process) holds no data and serves no request. It:

- splits the node: shard i is a full ``kvstore serve`` named ``<node>.s<i>`` with 1/N of
  the DRAM, HBM and SSD (its SSD in ``<ssd_path>/shard-<i>``, so each reopens its own
  after a restart), its own shared-memory segment, and 1/N of each tenant's quota;
- starts shards 1..N-1 on free ports, then shard 0 on the ports the user asked for,
  told every shard's address, which it hands to clients (Info ``shards``);
- restarts a shard that dies on the ports it had, so the map clients hold stays true
  (its DRAM is lost as in any crash; its SSD is reopened and re-announced); a shard
  that keeps dying stops the node, as a crashing single server would;
- serves ``/metrics`` for all shards on the user's metrics port, each series labelled
  with its ``shard`` (kvstore/observe/federate.py); with ``kv_events_endpoint`` each
  shard publishes its own KV-event stream, as vLLM's data-parallel ranks do
  (kvstore/server/kv_events.py);
- prints one ready line for the node, listing the shards, and on SIGTERM or SIGINT
  stops them all (each ends its leases and closes its SSD as a single server does).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import NodeConfig, ServerConfig
from kvstore.errors import ConfigError, KVStoreError
from kvstore.procs.children import Child, serve_argv, spawn, stop_group, wait_ready
from kvstore.server.kv_events import shard_endpoint
from kvstore.server.membership import advertised_host, join_address
from kvstore.wire.shards import ShardPeer, ShardRole, auto_shards, shard_name

__all__ = ["ShardPlan", "ShardSupervisor", "shard_count"]

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # a shard warms its DRAM before it is ready
STOP_GRACE_S = 10.0
RESTARTS = 5  # a shard dying this often ...
RESTART_WINDOW_S = 60.0  # ... within this long stops the node
_SPLIT = ("dram_bytes", "hbm_bytes", "ssd_bytes")
_SHARD_FACTS = ("node_id", "port", "data_port", "shm_name", "pid", "kv_events", "kv_events_replay")


def shard_count(node: NodeConfig, config: ServerConfig) -> int:
    """How many shards ``config.shards`` means for this node."""
    if config.shards == "auto":
        return auto_shards(node.dram_bytes + node.hbm_bytes)
    return int(config.shards)


@dataclass
class ShardPlan:
    """The flags of each shard's ``kvstore serve``, from the node's resolved configs.

    ``user_flags`` are the flags the user gave the supervisor (``--config`` among them);
    each shard gets them, then its own share and names on top."""

    node: NodeConfig
    config: ServerConfig
    count: int
    user_flags: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.config
        for ep in (c.kv_events_endpoint, c.kv_events_replay_endpoint):
            shard_endpoint(ep, self.count - 1)  # a port for every shard, or a clear error
        if len(shard_name(self.node.node_id, self.count - 1)) > 64:
            raise ConfigError(f"node_id {self.node.node_id!r}: too long to name its shards")
        if (
            self.node.dram_bytes // self.count < self.node.max_value_bytes
            and not self.node.hbm_bytes
        ):
            raise ConfigError(
                f"shards: {self.count} shards of {self.node.dram_bytes} bytes of DRAM each hold "
                f"less than max_value_bytes ({self.node.max_value_bytes}); use fewer shards"
            )

    def flags(
        self, index: int, ports: tuple[int, int], peers: tuple[ShardPeer, ...]
    ) -> dict[str, Any]:
        """Shard ``index``'s flags, listening on ``ports`` (gRPC, data; 0 picks one)."""
        n, node, c = self.count, self.node, self.config
        out: dict[str, Any] = {k: v for k, v in self.user_flags.items() if v is not None}
        out.update({k: getattr(node, k) // n for k in _SPLIT})
        if node.ssd_path:
            out["ssd_path"] = os.path.join(node.ssd_path, f"shard-{index}")
        if node.shm_name:
            out["shm_name"] = f"{node.shm_name}.s{index}"
        role = ShardRole(node.node_id, index, n, peers if index == 0 else ())
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(c, key):  # one stream per shard, as vLLM's DP ranks
                out[key] = shard_endpoint(getattr(c, key), index)
        out.update(
            node_id=role.node_id,
            port=ports[0],
            data_port=ports[1],
            metrics_port=0 if c.metrics_port >= 0 else -1,
            shards="1",
            shard_role=role.to_json(),
        )
        return out

    def address(self, port: int) -> str:
        """The control address clients dial for a shard on ``port``."""
        return join_address(advertised_host(self.config), port)


class ShardSupervisor:
    """Starts, watches and stops the shards of one node (see the module docstring)."""

    def __init__(self, plan: ShardPlan, env: Mapping[str, str] | None = None) -> None:
        self.plan = plan
        self.env = dict(os.environ if env is None else env)
        self.children: list[Child | None] = [None] * plan.count
        self.ports: list[tuple[int, int]] = [(0, 0)] * plan.count
        self.deaths: list[list[float]] = [[] for _ in range(plan.count)]
        self.stopping = threading.Event()
        self.metrics: Any = None  # kvstore.observe.federate.FederatedMetrics when served

    def start(self) -> None:
        """Start every shard (the rest first, then shard 0 with the map); raise
        Unavailable (with the failing shard's last log line) if one does not come up."""
        c = self.plan.config
        self.ports[0] = (c.port, c.data_port)
        try:
            rest = [self._spawn(i) for i in range(1, self.plan.count)]
            wait_ready(rest, time.monotonic() + READY_TIMEOUT_S)
            for i, child in enumerate(rest, start=1):
                self.ports[i] = (int(child.facts["port"]), int(child.facts["data_port"]))
            first = self._spawn(0)
            wait_ready([first], time.monotonic() + READY_TIMEOUT_S)
            self.ports[0] = (int(first.facts["port"]), int(first.facts["data_port"]))
            self._start_metrics()
        except BaseException:
            self.stop()
            raise

    def peers(self) -> tuple[ShardPeer, ...]:
        """Every shard's address from the ports known now (shard 0, asked for port 0 at
        its first start, names its own bound address in Info: StoreServer._shard_info)."""
        name = self.plan.node.node_id
        return tuple(
            ShardPeer(i, self.plan.address(p[0]), shard_name(name, i))
            for i, p in enumerate(self.ports)
        )

    def _spawn(self, index: int) -> Child:
        flags = self.plan.flags(index, self.ports[index], self.peers())
        child = spawn(
            shard_name(self.plan.node.node_id, index), serve_argv(flags), log=None, env=self.env
        )
        self.children[index] = child
        return child

    def _start_metrics(self) -> None:
        c = self.plan.config
        if c.metrics_port < 0:
            return
        from kvstore.observe.federate import FederatedMetrics

        urls = [
            f"http://{_url_host(c.metrics_host)}:{ch.facts['metrics_port']}/metrics"
            for ch in self._live()
        ]
        self.metrics = FederatedMetrics(urls, host=c.metrics_host, port=c.metrics_port).start()

    def _live(self) -> list[Child]:
        return [ch for ch in self.children if ch is not None]

    def facts(self) -> dict[str, Any]:
        """The node's ready line: shard 0's where to dial, the supervisor's pid, and
        every shard."""
        first = self.children[0]
        assert first is not None
        shards = [
            {
                "index": i,
                **{k: ch.facts.get(k) for k in _SHARD_FACTS},
            }
            for i, ch in enumerate(self._live())
        ]
        return {
            **first.facts,
            "node_id": self.plan.node.node_id,
            "pid": os.getpid(),
            "metrics_port": self.metrics.port if self.metrics is not None else None,
            "shards": shards,
        }

    def watch(self, poll_s: float = 0.2) -> int:
        """Restart shards that die until asked to stop; the exit status."""
        while not self.stopping.wait(poll_s):
            for i, child in enumerate(self.children):
                dead = child is not None and child.proc.poll() is not None
                if dead and not self.stopping.is_set() and not self._restart(i, child):
                    self.stop()
                    return 1
        return 0

    def _restart(self, index: int, old: Child | None) -> bool:
        """Start shard ``index`` again on its ports; False when it died too often."""
        now = time.monotonic()
        deaths = [t for t in self.deaths[index] if now - t < RESTART_WINDOW_S] + [now]
        self.deaths[index] = deaths
        name = shard_name(self.plan.node.node_id, index)
        if len(deaths) > RESTARTS:
            log.error(
                "shard %s exited %d times in %.0f s; stopping the node",
                name,
                len(deaths),
                RESTART_WINDOW_S,
            )
            return False
        code = old.proc.returncode if old is not None else None
        log.warning(
            "shard %s exited (status %s); restarting it on ports %s", name, code, self.ports[index]
        )
        if old is not None and old.proc.stdout is not None:
            old.proc.stdout.close()
        time.sleep(min(0.2 * 2 ** (len(deaths) - 1), 5.0))
        try:
            child = self._spawn(index)
            wait_ready([child], time.monotonic() + READY_TIMEOUT_S)
        except KVStoreError as exc:
            log.error("shard %s did not come back: %s", name, exc)
            return len(deaths) < RESTARTS
        return True

    def stop(self) -> None:
        """Stop every shard (SIGTERM, SIGKILL after a grace) and the metrics endpoint."""
        self.stopping.set()
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        stop_group(self._live(), STOP_GRACE_S)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def run_sharded(plan: ShardPlan, as_json: bool) -> int:
    """Run the supervisor in this process until SIGTERM or SIGINT (``kvstore serve``)."""
    sup = ShardSupervisor(plan)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stopping.set())
    sup.start()
    facts = sup.facts()
    if as_json:
        print(json.dumps(facts), flush=True)
    else:
        print(
            f"kvstore serve: node {facts['node_id']} in {plan.count} shards on "
            f"{plan.config.host}:{facts['port']} (data port {facts['data_port']})",
            flush=True,
        )
    code = sup.watch()
    sup.stop()
    print("kvstore serve: stopped", file=sys.stderr, flush=True)
    return code

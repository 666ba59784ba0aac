"""A small cluster spread over namespace hosts (tests/support/netns.py), for partition tests.

Use from a test module with ``pytest_plugins = ["tests.support.netns_fixtures"]`` (and
import what the test needs, ``NetnsCluster`` and ``TTL``, from tests/support/netns.py):

- ``netns_cluster``: one per module. Hosts ``etcd`` (control network only), ``n1`` and
  ``n2`` (both networks; ``kvstore serve`` bound to the data address, node lease
  ``TTL`` s) and ``cl`` (both networks; two client agents, ``c1`` and ``c2``). Everything
  it started is ended by PID and every namespace deleted at the end.

Tests using it are skipped, with the reason, when namespaces cannot be made here (not
root, no iproute2, a sandbox without CAP_NET_ADMIN) or there is no etcd binary; never
failed for that.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.etcd_fixtures import require_etcd
from tests.support.netns import (
    TTL,
    Agent,
    Lab,
    NetnsCluster,
    NetnsEtcd,
    NetnsNode,
    start_nodes,
    unavailable,
)
from tests.support.server_process import ALPHA, write_tokens

__all__ = ["netns_cluster", "require_netns"]


def require_netns() -> None:
    """Skip the calling test, with the reason, unless namespace hosts can be made."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    """etcd, two store nodes and two client agents, each group on its own host."""
    require_netns()
    require_etcd()
    root = tmp_path_factory.mktemp("netns")
    lab = Lab(root).start()
    etcd: NetnsEtcd | None = None
    nodes: dict[str, NetnsNode] = {}
    agents: dict[str, Agent] = {}
    try:
        hosts = {name: lab.add_host(name) for name in ("n1", "n2", "cl")}
        etcd = NetnsEtcd(lab.add_host("etcd", nets=("ctl",)), root / "etcd")
        etcd.start()
        cluster = f"netns-{os.getpid()}"
        endpoint = f"{etcd.host}:{etcd.client_port}"
        flags = {
            "tokens_file": write_tokens(root / "tokens.toml"),
            "dram_bytes": "32MiB",
            "ssd_bytes": "64MiB",
            "node_lease_ttl_s": TTL,
        }
        for n in ("n1", "n2"):
            nodes[n] = NetnsNode(lab, hosts[n], n, endpoint, cluster, root / n, dict(flags))
        start_nodes(list(nodes.values()))
        for a in ("c1", "c2"):
            agents[a] = Agent(
                lab, hosts["cl"], a, etcd=endpoint, cluster=cluster, token=ALPHA.token
            )
        yield NetnsCluster(lab, etcd, nodes, agents, cluster)
    finally:
        for agent in agents.values():
            agent.close()
        for node in nodes.values():
            node.stop()
        if etcd is not None:
            etcd.stop()
        lab.close()

"""The operator commands' view of sharded nodes, without a server: which processes a
node argument names (kvstore/cli/targets.py), the ``kvstore nodes`` table's rows
(nodes_view.py) and a sharded node's summed stats (stats_view.py). The commands
against real processes: tests/cluster/test_cluster_shards.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvstore.cli.nodes_view import node_doc, table_rows
from kvstore.cli.stats_view import combine
from kvstore.cli.targets import Process, Target, every_node, from_directory, from_info
from kvstore.directory import NodeInfo
from kvstore.errors import ConfigError


def shard(i: int, count: int = 3, **kw: Any) -> NodeInfo:
    info = NodeInfo(f"g.s{i}", "h", f"h:{7400 + i}", group="g", shard=i, shards=count)
    return dataclasses.replace(info, **kw)


NODES = {n.node_id: n for n in (shard(0), shard(1), shard(2), NodeInfo("a", "h", "h:7500"))}


def test_an_address_of_shard_0_names_every_shard() -> None:
    info = {  # a server_info dict: shard 0's "index" and "shard" are left out at 0
        "node_id": "g.s0",
        "group": "g",
        "shard_count": 2,
        "shards": [
            {"index": 1, "address": "h:7401", "node_id": "g.s1"},
            {"address": "h:7400", "node_id": "g.s0"},
        ],
    }
    assert from_info("h:7400", info) == Target(
        "h:7400", "g", (Process("g.s0", "h:7400"), Process("g.s1", "h:7401"))
    )
    other = {"node_id": "g.s1", "group": "g", "shard": 1, "shard_count": 2}
    assert from_info("h:7401", other) == Target("h:7401", "", (Process("g.s1", "h:7401"),))
    assert from_info("h:1", {"node_id": "a"}) == Target("h:1", "", (Process("a", "h:1"),))


def test_a_name_is_a_node_a_shard_or_every_shard_of_a_node() -> None:
    assert from_directory("a", NODES).processes == (Process("a", "h:7500"),)
    assert from_directory("g.s1", NODES) == Target("g.s1", "", (Process("g.s1", "h:7401"),))
    g = from_directory("g", NODES)
    assert g.group == "g" and [p.node_id for p in g.processes] == ["g.s0", "g.s1", "g.s2"]
    partial = {k: v for k, v in NODES.items() if k != "g.s1"}
    assert from_directory("g", partial).missing == ("g.s1",)
    with pytest.raises(ConfigError, match="no node named 'nope'"):
        from_directory("nope", NODES)
    assert [(t.spec, t.group) for t in every_node(NODES)] == [("a", ""), ("g", "g")]


def test_the_nodes_table_puts_a_node_over_its_shards() -> None:
    docs = [node_doc(n, 10, 1000) for n in NODES.values() if n.node_id != "g.s2"]
    docs[1]["draining"] = True  # g.s1
    rows = table_rows(docs)
    assert [r[0] for r in rows] == ["a", "g (3 shards)", "  g.s0", "  g.s1", "  g.s2"]
    assert rows[1][4] == "[yellow]draining 1/3[/], [red]2/3 listed[/]"
    assert rows[1][5] == "20" and rows[1][1] == "h:7400"
    assert rows[4][4] == "[red]missing[/]"
    assert (docs[0]["group"], docs[0]["shard"], docs[0]["shards"]) == ("g", 0, 3)
    assert (docs[2]["group"], docs[2]["shard"], docs[2]["shards"]) == ("", 0, 1)


def _summary(node_id: str, used: int, hits: int, draining: bool = False) -> dict[str, Any]:
    return {
        "address": f"{node_id}:1",
        "node_id": node_id,
        "tenant": None,
        "draining": draining,
        "blocks": used // 10,
        "pinned": 0,
        "tiers": {"dram": {"capacity": 100, "used": used, "blocks": used // 10, "hits": hits}},
        "lookups": hits * 2,
        "hits": hits,
        "misses": hits,
        "hit_rate": 0.5,
        "puts": 1,
        "put_bytes": 10,
        "bytes_in": {"tcp": 5},
        "bytes_out": {"tcp": 7},
        "connections": 1,
        "leases": 0,
        "credits_lent": 0,
        "shards": 2,
    }


def test_a_sharded_node_sums_its_shards() -> None:
    total = combine("g", [_summary("g.s0", 30, 3), _summary("g.s1", 50, 1, draining=True)])
    assert total["node_id"] == "g" and total["shard_nodes"] == ["g.s0", "g.s1"]
    assert total["tiers"]["dram"] == {"capacity": 200, "used": 80, "blocks": 8, "hits": 4}
    assert total["hits"] == 4 and total["lookups"] == 8 and total["hit_rate"] == 0.5
    assert total["bytes_in"] == {"tcp": 10} and total["bytes_out"] == {"tcp": 14}
    assert total["draining"] and total["shards"] == 2 and total["address"] == "g.s0:1"

"""``kvstore up``, ``kvstore nodes`` and ``kvstore ls``: run and read a cluster.

``up`` runs a :class:`~kvstore.procs.local_cluster.LocalCluster` until Ctrl-C or SIGTERM.
``nodes`` and ``ls`` read the directory the way a client does (one full listing into
a mirror; no node is contacted), so they work while nodes are down and show exactly
what clients would route by (``nodes`` says which are draining: clients write
elsewhere). Block keys in ``ls`` are the keys nodes store: each tenant's keys are
scoped hashes (kvstore/server/auth.py), not the keys a client sent.

An etcd with auth or TLS is read with the ``etcd_*`` settings (kvstore/config.py
EtcdAccess): ``--etcd-user``, ``--etcd-ca``, ``--etcd-cert``, ``--etcd-key``, and the
password from ``KVSTORE_ETCD_PASSWORD`` only (flags show up in ps). ``up`` hands them
to every node and worker it starts, through their environment.

Directory entries carry no namespace, so ``ls --tenant``/``--namespace`` asks every
live node instead, through the admin Scan RPC (an admin token, as ``kvstore evict``
needs): each node resolves the tenant and model to the namespaces its requests used
(kept beside its SSD tier across restarts) and its imports were named with, exactly as
an eviction with the same filters would.

Tables fit 80 columns; ``--json`` prints one JSON document instead.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from kvstore.cli.directory import add_directory_flags, add_etcd_flags, cluster_config, read
from kvstore.cli.extensions import load_attr
from kvstore.cli.nodes_view import COLUMNS, node_doc, table_rows
from kvstore.config import EtcdAuth
from kvstore.directory.base import NodeInfo, Replica
from kvstore.directory.mirror import Mirror
from kvstore.errors import AuthError, ConfigError, KVStoreError, PermissionDenied
from kvstore.observe.fmt import fmt_bytes
from kvstore.wire.codec import MAX_SCAN

__all__ = ["add_parser"]


_NODES_EXAMPLE = """\
examples:
  kvstore nodes --etcd 127.0.0.1:2379 --cluster c1
  kvstore nodes --json | jq '.nodes[] | select(.draining) | .node_id'

A draining node ('kvstore drain') takes no new writes; clients still read from it.
"""
_LS_EXAMPLE = """\
examples:
  kvstore ls --node a --prefix 3f2a --limit 20        # from the directory only
  kvstore ls --namespace llama-3-8b --tenant acme     # asks each node (admin token)
  KVSTORE_TOKEN=... kvstore ls --model llama-3-8b --tier ssd --json

Keys are stored keys (tenant-scoped hashes). --tenant/--namespace select blocks
written with a model scope, as 'kvstore evict' does.
"""


def add_parser(sub: Any) -> None:
    """Register ``up``, ``nodes`` and ``ls``."""
    _add_up(sub)
    _add_readers(sub)


def _add_up(sub: Any) -> None:
    up = sub.add_parser(
        "up",
        help="run a local multi-process cluster (etcd + N nodes) until Ctrl-C",
        description="Start etcd (from its binary, on free loopback ports) and N "
        "'kvstore serve' nodes registered to it; print where they are; stop them all "
        "on Ctrl-C or SIGTERM. Auth: --tokens-file, --allow-anonymous, KVSTORE_AUTH_TOKEN, "
        "or a fresh token that is printed.",
        epilog="examples: kvstore up --nodes 3 --dram 512MiB --ssd 4GiB\n"
        "          kvstore up --nodes 2 --dram 4GiB --shards 4\n"
        "          kvstore up --nodes 1 --prefill 2 --decode 1 --router --model tiny",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument("--nodes", type=int, default=2, help="how many nodes (default 2)")
    up.add_argument("--dram", default="256MiB", help="DRAM tier per node (default 256MiB)")
    up.add_argument("--ssd", default="", help="SSD tier per node (default: none)")
    up.add_argument(
        "--shards", default="", help="processes per node, as 'kvstore serve --shards' (auto)"
    )
    up.add_argument("--base-port", type=int, default=0, help="node i uses P+2i, P+2i+1")
    up.add_argument("--etcd", help="use this etcd (HOST:PORT) instead of starting one")
    up.add_argument("--cluster", help="cluster name (default: KVSTORE_CLUSTER or 'default')")
    up.add_argument("--host", default="127.0.0.1", help="address nodes bind (default loopback)")
    up.add_argument("--tokens-file", default="", help="tokens file handed to every node")
    up.add_argument("--allow-anonymous", action="store_true", help="nodes accept no token")
    up.add_argument("--node-lease-ttl-s", type=float, help="directory lease TTL of each node")
    up.add_argument("--prefill", type=int, default=0, help="prefill workers to start (0)")
    up.add_argument("--decode", type=int, default=0, help="decode workers to start (0)")
    up.add_argument("--both", type=int, default=0, help="workers doing both phases (0)")
    up.add_argument("--router", action="store_true", help="start the OpenAI-compatible router")
    up.add_argument("--model", default="tiny", help="workers' model: tiny, smollm2 or a path")
    up.add_argument("--router-port", type=int, default=8000, help="router port (0 picks one)")
    up.add_argument("--policy", default="cache_aware", help="router placement policy")
    up.add_argument(
        "--save-decode",
        action="store_true",
        help="decode workers store each whole answer's blocks too (a chat's next turn hits them)",
    )
    up.add_argument("--json", action="store_true", help="print the ready document as JSON")
    add_etcd_flags(up)
    up.set_defaults(func=_cmd_up)


def _add_readers(sub: Any) -> None:
    """``nodes`` and ``ls``: they read the directory, so they share its flags."""
    for name, helptext, example, fn in (
        ("nodes", "list the nodes registered in a cluster's directory", _NODES_EXAMPLE, _cmd_nodes),
        ("ls", "list block entries of a cluster's directory", _LS_EXAMPLE, _cmd_ls),
    ):
        p = sub.add_parser(
            name,
            help=helptext,
            description=helptext + ".",
            epilog=example,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_directory_flags(p)
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(func=fn)
        if name == "ls":
            p.add_argument("--node", help="only this node's entries (node id)")
            p.add_argument("--prefix", default="", help="only keys starting with these hex digits")
            p.add_argument("--tier", choices=("hbm", "dram", "ssd"), help="only this tier")
            p.add_argument("--limit", type=int, default=100, help="at most K rows (0: all)")
            p.add_argument("--tenant", default="", help="only this tenant's blocks (asks nodes)")
            p.add_argument(
                "--namespace",
                "--model",
                dest="namespace",
                default="",
                metavar="MODEL",
                help="only this model's blocks (asks nodes)",
            )
            p.add_argument(
                "--token", help="admin token for --tenant/--namespace (default: KVSTORE_TOKEN)"
            )
            p.add_argument(
                "--timeout", type=float, default=10.0, help="seconds per node call (default 10)"
            )


# -- up ------------------------------------------------------------------------------------


def _cmd_up(args: argparse.Namespace) -> int:
    from kvstore.procs.local_cluster import LocalCluster

    cfg = cluster_config(args, cluster=args.cluster)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(
        args.nodes,
        dram=args.dram,
        ssd=args.ssd,
        base_port=args.base_port,
        etcd=args.etcd or "",
        cluster=cfg.cluster,
        host=args.host,
        tokens_file=args.tokens_file,
        allow_anonymous=args.allow_anonymous,
        node_lease_ttl_s=args.node_lease_ttl_s,
        etcd_auth=cfg.etcd_auth,
        shards=args.shards,
    )
    pool = None
    try:
        cluster.start()
        doc = {"event": "ready", **cluster.describe()}
        if args.prefill or args.decode or args.both or args.router:
            pool = _serving_pool(args, cluster, cfg.etcd_auth).start()
            doc["serving"] = pool.describe()
        if args.json:
            print(json.dumps(doc), flush=True)
        else:
            _print_up(doc)
        return _watch(cluster, stop)
    finally:
        if pool is not None:
            pool.stop()
        cluster.stop()
        if not args.json:
            print("kvstore up: stopped", flush=True)


def _serving_pool(args: argparse.Namespace, cluster: Any, etcd_auth: EtcdAuth) -> Any:
    """Workers and a router beside the nodes: the engine's launcher, loaded by module path
    (kvstore/cli/extensions.py) because the store never imports the engine."""
    build = load_attr(
        "engine.serving.launch:pool_for_cluster",
        what="kvstore up --prefill/--decode/--both/--router",
    )
    return build(args, cluster, etcd_auth)


def _watch(cluster: Any, stop: threading.Event) -> int:
    """Wait for a signal; report nodes that exit meanwhile (1 if all of them did)."""
    reported: set[str] = set()
    while not stop.wait(0.5):
        for n in cluster.exited():
            if n.node_id not in reported:
                reported.add(n.node_id)
                print(
                    f"kvstore up: node {n.node_id} (pid {n.pid}) exited with status "
                    f"{n.proc.returncode}; see {n.workdir / 'server.log'}",
                    flush=True,
                )
        if len(reported) == len(cluster.nodes):
            return 1
    return 0


def _print_up(doc: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("node", "pid", "gRPC address", "data port", "log"):
        t.add_column(col, overflow="fold")
    for n in doc["nodes"]:
        name = f"{n['node_id']} ({len(n['shards'])} shards)" if n.get("shards") else n["node_id"]
        t.add_row(name, str(n["pid"]), n["address"], str(n["data_port"]), n["log"])
    etcd_pid = f" (pid {doc['etcd_pid']})" if doc["etcd_pid"] else ""
    lines = [
        f"etcd {doc['etcd']}{etcd_pid}, cluster {doc['cluster']}",
        f"export KVSTORE_ETCD={doc['etcd']} KVSTORE_CLUSTER={doc['cluster']}",
    ]
    if "token" in doc:
        lines.append(f"export KVSTORE_TOKEN={doc['token']}  # generated")
    serving = doc.get("serving")
    if serving:
        for w in serving["workers"]:
            lines.append(
                f"worker {w['worker_id']} ({w.get('role')}, pid {w['pid']}) at "
                f"{w.get('address')} beside {w.get('store_node')}"
            )
        for r in serving["routers"]:
            lines.append(f"router ({r['policy']}): {r['url']}/v1  (OpenAI-compatible)")
    lines.append("Ctrl-C stops every process started here.")
    _print(t, *lines)


# -- nodes / ls ----------------------------------------------------------------------------


def _node_rows(m: Mirror) -> list[dict[str, Any]]:
    held: dict[str, list[int]] = {}
    for _, r in m.entries():
        c = held.setdefault(r.node_id, [0, 0])
        c[0] += 1
        c[1] += r.size
    return [node_doc(info, *held.get(nid, [0, 0])) for nid, info in sorted(m.nodes().items())]


def _cmd_nodes(args: argparse.Namespace) -> int:
    cfg, rows = read(args, _node_rows)
    if args.json:
        print(json.dumps({"etcd": cfg.etcd, "cluster": cfg.cluster, "nodes": rows}))
        return 0
    from rich import box
    from rich.table import Table

    units = len({r["group"] or r["node_id"] for r in rows})
    shards = f" ({len(rows)} with each shard)" if units != len(rows) else ""
    title = f"cluster {cfg.cluster} at {cfg.etcd}: {units} nodes{shards}"
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    t.collapse_padding = True  # light rules and single gaps: seven columns fit 80
    for col, just in COLUMNS:
        whole = col in ("node", "address")  # names and addresses on one line; the rest fold
        t.add_column(col, justify=just, overflow="fold", no_wrap=whole)  # type: ignore[arg-type]
    for row in table_rows(rows):
        t.add_row(*row)
    _print(t)
    return 0


def _hex_prefix(args: argparse.Namespace) -> str:
    prefix = str(args.prefix).lower()
    if prefix and any(c not in "0123456789abcdef" for c in prefix):
        raise ConfigError(f"prefix {args.prefix!r}: give hex digits")
    if args.limit < 0:
        raise ConfigError("limit: must be >= 0")
    return prefix


def _entries(
    args: argparse.Namespace,
) -> Callable[[Mirror], tuple[int, list[tuple[bytes, Replica]]]]:
    prefix = _hex_prefix(args)

    def pick(m: Mirror) -> tuple[int, list[tuple[bytes, Replica]]]:
        rows = [
            (k, r)
            for k, r in m.entries(args.node)
            if k.hex().startswith(prefix) and args.tier in (None, r.tier.value)
        ]
        rows.sort(key=lambda e: (e[0], e[1].node_id))
        return len(rows), rows[: args.limit] if args.limit else rows

    return pick


def _scan_nodes(
    args: argparse.Namespace, nodes: dict[str, NodeInfo]
) -> tuple[list[dict[str, Any]], list[str], list[dict[str, str]]]:
    """Ask each node (``--node``: that one) for its blocks matching the filters, via
    the admin Scan RPC. Returns the rows, the nodes that had more than one reply
    holds, and per-node errors (a down node is reported, the others still listed)."""
    from kvstore.cli.calls import connect
    from kvstore.client.admin import AdminClient

    prefix = _hex_prefix(args)
    wire_prefix = bytes.fromhex(prefix[: len(prefix) // 2 * 2])  # odd digit: checked here
    if args.node and args.node not in nodes:
        raise ConfigError(f"node {args.node!r} is not registered in this cluster")
    rows: list[dict[str, Any]] = []
    more: list[str] = []
    errors: list[dict[str, str]] = []
    for node_id, info in sorted(nodes.items()):
        if args.node and node_id != args.node:
            continue
        try:
            # Each shard of a sharded node is a node of the directory: list its own.
            with connect(info.address, args, admin="ls --tenant/--namespace") as c:
                blocks, truncated = AdminClient(c).scan_page(
                    MAX_SCAN,
                    args.tier or "",
                    tenant=args.tenant,
                    model=args.namespace,
                    key_prefix=wire_prefix,
                    timeout=args.timeout,
                )
        except (ConfigError, AuthError, PermissionDenied):
            raise  # the token's fault, not the node's: one error, not one per node
        except KVStoreError as exc:
            errors.append({"node": node_id, "code": exc.code, "error": str(exc)})
            continue
        if truncated:
            more.append(node_id)
        rows += [
            {
                "key": b.key.hex(),
                "node": node_id,
                "tier": b.tier,
                "size": b.size,
                "tenant": b.tenant,
                "namespace": b.model,
            }
            for b in blocks
            if b.key.hex().startswith(prefix)
        ]
    rows.sort(key=lambda d: (d["key"], d["node"]))
    return rows, more, errors


def _cmd_ls(args: argparse.Namespace) -> int:
    if args.tenant or args.namespace:
        return _ls_nodes(args)
    cfg, (total, rows) = read(args, _entries(args))
    docs: list[dict[str, Any]] = [
        {"key": k.hex(), "node": r.node_id, "tier": r.tier.value, "size": r.size} for k, r in rows
    ]
    if args.json:
        print(json.dumps({"cluster": cfg.cluster, "total": total, "entries": docs}))
        return 0
    _print_entries(f"cluster {cfg.cluster}: {len(docs)} of {total} entries", docs)
    return 0


def _ls_nodes(args: argparse.Namespace) -> int:
    """``ls --tenant/--namespace``: the nodes' own listings, filtered by namespace."""
    _hex_prefix(args)  # a bad --prefix or --limit fails before etcd is asked
    cfg, nodes = read(args, lambda m: m.nodes())
    rows, more, errors = _scan_nodes(args, nodes)
    total = len(rows)
    docs = rows[: args.limit] if args.limit else rows
    scope = " ".join(
        f"{k} {v}" for k, v in (("tenant", args.tenant), ("namespace", args.namespace)) if v
    )
    if args.json:
        doc = {"cluster": cfg.cluster, "tenant": args.tenant, "namespace": args.namespace}
        doc.update(total=total, entries=docs, more=more, errors=errors)
        print(json.dumps(doc))
        return 1 if errors else 0
    lines = [f"  more on {n} than one listing holds: narrow with --prefix/--tier" for n in more]
    _print_entries(f"cluster {cfg.cluster}, {scope}: {len(docs)} of {total} blocks", docs, *lines)
    for e in errors:
        print(f"kvstore ls: error ({e['node']}): {e['error']}", file=sys.stderr)
    return 1 if errors else 0


def _print_entries(title: str, docs: list[dict[str, Any]], *lines: str) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column("key", no_wrap=True)
    t.add_column("node", overflow="fold")
    t.add_column("tier")
    t.add_column("size", justify="right")
    for d in docs:
        t.add_row(d["key"], d["node"], d["tier"], fmt_bytes(d["size"]))
    _print(t, *lines)


def _print(*items: Any) -> None:
    """Print tables and lines at most 80 columns wide (narrower terminals: theirs)."""
    from rich.console import Console

    con = Console(highlight=False)
    con.width = min(con.width, 80)
    for item in items:
        con.print(item, soft_wrap=isinstance(item, str))

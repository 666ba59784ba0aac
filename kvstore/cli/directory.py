"""How a command reads a cluster's directory: its flags, and one listing into a mirror.

``kvstore nodes`` and ``ls`` read nothing else; ``drain``, ``stats`` and ``ls
--tenant`` read it to turn node names (and a sharded node's group name) into the
addresses they then call. An etcd with auth or TLS is read with the ``etcd_*``
settings (kvstore/config.py EtcdAccess): ``--etcd-user``, ``--etcd-ca``,
``--etcd-cert``, ``--etcd-key``, and the password from ``KVSTORE_ETCD_PASSWORD`` only
(flags show up in ps).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvstore.config import ClusterConfig, resolve_config
from kvstore.directory.mirror import Mirror
from kvstore.errors import ConfigError

__all__ = ["ETCD_FLAGS", "add_directory_flags", "add_etcd_flags", "cluster_config", "read"]

T = TypeVar("T")

ETCD_FLAGS = {
    "etcd_user": "etcd user (password: KVSTORE_ETCD_PASSWORD)",
    "etcd_ca": "PEM CA of etcd's certificate (TLS)",
    "etcd_cert": "PEM client certificate for etcd",
    "etcd_key": "PEM key of --etcd-cert",
}


def add_etcd_flags(p: argparse.ArgumentParser) -> None:
    """The etcd credential flags (``--etcd-user`` and the TLS files)."""
    for name, text in ETCD_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, help=text)


def add_directory_flags(p: argparse.ArgumentParser) -> None:
    """``--etcd``, ``--cluster`` and the credential flags of a command that reads the
    directory."""
    p.add_argument("--etcd", help="etcd HOST:PORT (default: KVSTORE_ETCD or 127.0.0.1:2379)")
    p.add_argument("--cluster", help="cluster name (default: KVSTORE_CLUSTER or 'default')")
    add_etcd_flags(p)


def cluster_config(args: argparse.Namespace, **flags: Any) -> ClusterConfig:
    """Flags, then ``KVSTORE_*``, then defaults: the directory and its credentials."""
    flags.update({name: getattr(args, name) for name in ETCD_FLAGS})
    cfg: ClusterConfig = resolve_config(ClusterConfig, flags=flags)
    return cfg


async def _with_mirror(cfg: ClusterConfig, fn: Callable[[Mirror], T]) -> T:
    try:
        from kvstore.directory.etcd import EtcdDirectory
    except ImportError as exc:
        raise ConfigError(
            f"reading etcd needs aetcd (pip install 'kvstore[service]'): {exc}"
        ) from None
    async with EtcdDirectory(cfg.etcd, cfg.cluster, auth=cfg.etcd_auth) as d:
        return fn(await d.mirror())


def read(args: argparse.Namespace, fn: Callable[[Mirror], T]) -> tuple[ClusterConfig, T]:
    """``fn`` of one full listing of the directory ``--etcd``/``--cluster`` name."""
    cfg = cluster_config(args, etcd=args.etcd, cluster=args.cluster)
    coro: Coroutine[Any, Any, T] = _with_mirror(cfg, fn)
    return cfg, asyncio.run(coro)

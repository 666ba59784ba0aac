"""``kvstore vllm-router --etcd``'s pools over a real etcd: records written by the real
registration (engine/registry.py, the writer the vLLM connector uses) come and go in the
pools; records of another model, or of ``kvstore worker``, stay out; the store node a
record names is found in the cluster's directory. Real ``vllm serve`` processes run the
same path in tests/vllm/test_vllm_pools.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from engine.registry import WorkerLoad, WorkerRecord, WorkerRegistration, vllm_servers_prefix
from engine.serving.vllm_pools import Pools, PoolsConfig
from kvstore.directory.base import NodeInfo
from kvstore.directory.etcd import EtcdDirectory
from tests.support.etcd_fixtures import EtcdProcess

pytest_plugins = ["tests.support.etcd_fixtures"]
pytestmark = pytest.mark.process

LAYOUT = "float32:L2:H2:D32:B32:R0"


def _record(wid: str, role: str, model: str = "m") -> WorkerRecord:
    return WorkerRecord(
        worker_id=wid, role=role, model=model, address=f"http://{wid}:8000",
        namespace={"model": model, "layout": LAYOUT, "tenant": "default"}, store_node="n0",
        block_tokens=32,
    )  # fmt: skip


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


def test_pools_follow_registered_servers_of_their_model(
    etcd_server: EtcdProcess, cluster_name: str
) -> None:
    etcd = etcd_server.endpoint

    def urls(servers: list[object]) -> list[str]:
        return [s.url for s in servers]  # type: ignore[attr-defined]

    async def scenario() -> None:
        directory = EtcdDirectory(etcd, cluster_name)
        await directory.open()
        await directory.register_node(NodeInfo("n0", "127.0.0.1", "127.0.0.1:7400"), ttl=5)
        pools = Pools(PoolsConfig([], [], model="m", etcd=etcd, cluster=cluster_name))
        assert pools.members is not None
        await pools.members.start()
        prefix = vllm_servers_prefix(cluster_name)
        regs = {wid: WorkerRegistration(etcd, cluster_name, ttl=5, prefix=prefix)
                for wid in ("p0", "d0", "other")}  # fmt: skip
        worker = WorkerRegistration(etcd, cluster_name, ttl=5)  # a `kvstore worker`
        try:
            await regs["p0"].start(_record("p0", "prefill"))
            await regs["d0"].start(_record("d0", "decode"))
            await regs["other"].start(_record("other", "both", model="another-model"))
            await worker.start(_record("w0", "both"))
            await _until(lambda: (urls(pools.prefill), urls(pools.decode)) ==
                         (["http://p0:8000"], ["http://d0:8000"]), "p0 and d0 pooled")  # fmt: skip
            await _until(lambda: pools.members.store_address("n0") == "127.0.0.1:7400",  # type: ignore[union-attr]
                         "n0's address read from the directory")  # fmt: skip
            assert pools.check_target(pools.decode[0])[2] == "127.0.0.1:7400"
            regs["d0"].update_load(WorkerLoad(running=3))
            await _until(lambda: pools.decode[0].busy == 3, "d0's reported load")
            await regs["d0"].stop()  # a clean stop: out at once
            await _until(lambda: not pools.decode, "d0 out of the pool", timeout_s=2.0)
            assert urls(pools.prefill) == ["http://p0:8000"]
        finally:
            for reg in (*regs.values(), worker):
                await reg.stop()
            await pools.members.stop()
            await directory.close()

    asyncio.run(scenario())

"""KV compression through the serving path, on real processes: a store node, workers
started with ``--kv-codec``, the router, and the `openai` client over loopback HTTP.

- int8 (bf16) and fp8 (fp32) workers hand a prompt's KV over through the store as the
  codec's bytes, reuse the prefix on the next turn, and the router's answers equal the
  same codec's in-process prefill -> decode (PrefillWorker / DecodeWorker over a
  StoreNode); fp8's differ from the uncompressed KV's on some of these prompts, so the
  answers are the codec's;
- the router never pairs a prefill and a decode worker of different codecs: with a
  mismatched decode worker beside a matching one it picks the matching one, and with
  only mismatched workers a long prompt is a 503 ``kv_codec_mismatch`` naming them
  (a short one is still served whole); ``/v1/models`` and ``/health`` say which codec
  each model's pool uses and which workers are unpaired, and the router logs them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from engine.hf.adapter import HFKVAdapter
from engine.hf.workers import DecodeWorker, PrefillWorker
from engine.serving.loading import load_model
from kvstore import StoreNode
from tests.serving.procs import ServingCluster
from tests.support.etcd_fixtures import EtcdProcess
from tests.support.server_process import ALPHA

pytest_plugins = ["tests.support.etcd_fixtures"]
pytestmark = [pytest.mark.process, pytest.mark.slow]
N = 10
INT8 = ["--kv-codec", "int8", "--dtype", "bf16"]


@pytest.fixture
def serving(
    etcd_server: EtcdProcess, tmp_path: Path, cluster_name: str
) -> Iterator[ServingCluster]:
    c = ServingCluster(tmp_path, etcd_server.endpoint, cluster_name)
    try:
        c.add_node("n0")
        yield c
    finally:
        c.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 500) for _ in range(n)]  # clear of the tiny model's specials


def _in_process(prompts: list[list[int]], dtype: str, codec: str | None) -> list[str]:
    """The answers of one process: each prompt prefilled and handed to a decode worker
    through a StoreNode, in order (so a later turn reuses an earlier one's prefix),
    decoded to text as the router does."""
    torch.set_num_threads(1)  # the workers' setting: one reduction order
    lm = load_model("tiny", dtype)
    ad = HFKVAdapter(lm.model, model_id="tiny", kv_codec=codec)
    out = []
    with StoreNode() as node:
        pw, dw = PrefillWorker(ad, node), DecodeWorker(ad, node)
        for i, p in enumerate(prompts):
            h = pw.prefill(f"r{i}", p)
            toks = list(dw.decode(h, N, lm.tokenizer.eos_token_id))
            out.append(lm.tokenizer.decode(toks, skip_special_tokens=True))
    return out


def _wait_workers(url: str, n: int, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    h: dict = {}
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health", timeout=5).json()
        if sum(h["workers"].values()) == n:
            return dict(h)
        time.sleep(0.1)
    raise AssertionError(f"the router does not see {n} workers: {h}")


@pytest.mark.parametrize("codec,dtype", [("int8", "bf16"), ("fp8", "fp32")])
def test_workers_round_trip_a_prefix_and_match_the_in_process_codec(
    serving: ServingCluster, codec: str, dtype: str
) -> None:
    flags = ["--kv-codec", codec, "--dtype", dtype]
    serving.add_workers([
        {"id": "p0", "role": "prefill", "node": "n0", "flags": flags},
        {"id": "d0", "role": "decode", "node": "n0", "flags": flags},
    ])  # fmt: skip
    url = serving.add_router()
    client = _client(url)
    model = client.models.list().data[0]
    assert model.id == "tiny" and model.model_extra is not None
    assert model.model_extra["kv_codec"] == codec
    assert model.model_extra["kv_codecs"] == {codec: ["d0", "p0"]}
    assert serving.worker_health("d0")["kv_codec"] == codec

    prompts = []
    for seed in range(3):  # three conversations of two turns: the second reuses the first
        first = _ids(300, seed)
        prompts += [first, first + _ids(40, 100 + seed)]
    answers, cached = [], []
    for p in prompts:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=N)
        assert r.usage is not None
        kv = r.usage.model_extra["kvstore"]
        assert (kv["prefill_worker"], kv["decode_worker"]) == ("p0", "d0")
        answers.append(r.choices[0].text)
        cached.append(kv["cached_tokens"])
    assert cached == [0, 300 // 16 * 16] * 3  # each second turn reused its prefix
    assert answers == _in_process(prompts, dtype, codec)
    if codec == "fp8":  # int8 keeps the tiny model's greedy tokens; fp8 moves some
        assert answers != _in_process(prompts, dtype, None)

    lm = load_model("tiny", dtype)
    ad = HFKVAdapter(lm.model, model_id="tiny", kv_codec=codec)
    health = serving.worker_health("d0")
    fetched, counters = health["last_decode"], health["counters"]
    assert fetched["blocks"] == -(-len(prompts[-1]) // 16)  # every prompt token's KV
    assert fetched["bytes"] == fetched["blocks"] * ad.stored_block_bytes
    assert counters["tail_recomputed"] == 0  # every handoff was read from the store
    assert counters["handoff_from_cluster"] + counters["handoff_from_source"] > 0
    first = prompts[0]
    with serving.nodes["n0"].client(ALPHA, namespace=ad.namespace, transport="tcp") as c:
        keys = ad.keys(first)
        assert c.match_prefix(keys) == len(keys)
        stored = c.get(keys[0])
        assert isinstance(stored, bytes) and len(stored) == ad.stored_block_bytes  # codec's
    raw = HFKVAdapter(lm.model, model_id="tiny")
    with serving.nodes["n0"].client(ALPHA, namespace=raw.namespace, transport="tcp") as c:
        assert c.match_prefix(raw.keys(first)) == 0  # nothing stored uncompressed


def test_the_router_never_pairs_workers_of_different_codecs(serving: ServingCluster) -> None:
    serving.add_workers([
        {"id": "p0", "role": "prefill", "node": "n0", "flags": INT8},
        {"id": "d0", "role": "decode", "node": "n0", "flags": INT8},
        {"id": "d-none", "role": "decode", "node": "n0", "flags": ["--dtype", "bf16"]},
    ])  # fmt: skip
    url = serving.add_router()
    client = _client(url)
    model = client.models.list().data[0]
    assert model.model_extra is not None and model.model_extra["kv_codec"] == "mixed"
    health = _wait_workers(url, 3)
    assert health["kv_codecs"]["tiny"]["unpaired"] == ["d-none"]
    # d-none sorts first and is as idle and as near as d0: only the codec keeps it out
    for seed in range(3):
        r = client.completions.create(model="tiny", prompt=_ids(300, 10 + seed), max_tokens=N)
        assert r.usage is not None and r.usage.model_extra["kvstore"]["decode_worker"] == "d0"

    serving.workers["d0"].stop()  # SIGTERM revokes its lease: only mismatched workers left
    health = _wait_workers(url, 2)
    assert sorted(health["kv_codecs"]["tiny"]["unpaired"]) == ["d-none", "p0"]
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="tiny", prompt=_ids(300, 20), max_tokens=N)
    assert err.value.status_code == 503
    body = err.value.response.json()["error"]
    assert body["code"] == "kv_codec_mismatch"
    assert "p0 (int8)" in body["message"] and "d-none (none)" in body["message"]
    short = client.completions.create(model="tiny", prompt=_ids(40, 21), max_tokens=N)
    assert short.usage is not None
    assert short.usage.model_extra["kvstore"]["decode_worker"] == "d-none"  # served whole
    log = serving.routers[0].log
    assert log is not None
    assert "worker d-none (decode, model tiny) stores KV codec none" in log.read_text()

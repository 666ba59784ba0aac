"""``kvstore up`` with workers and a router: one command gives a local cluster that
serves, and SIGTERM stops every process it started."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process, pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_with_workers_and_router_serves_and_stops(tmp_path: Path) -> None:
    from openai import OpenAI

    pytest.importorskip("aetcd")
    from tests.support.etcd_fixtures import require_etcd

    require_etcd()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    argv = [sys.executable, "-m", "kvstore.cli", "up", "--json", "--nodes", "1",
            "--dram", "64MiB", "--prefill", "1", "--decode", "1", "--router",
            "--model", "tiny", "--router-port", "0", "--save-decode"]  # fmt: skip
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    try:
        assert up.stdout is not None
        deadline, doc = time.monotonic() + 150, None
        while doc is None and time.monotonic() < deadline and up.poll() is None:
            if select.select([up.stdout], [], [], 0.5)[0]:
                line = up.stdout.readline()
                if line.startswith("{"):
                    doc = json.loads(line)
        assert doc is not None, (tmp_path / "up.log").read_text()[-3000:]
        serving = doc["serving"]
        assert sorted(w["role"] for w in serving["workers"]) == ["decode", "prefill"]
        (router,) = serving["routers"]
        client = OpenAI(base_url=router["url"] + "/v1", api_key="unused")
        msgs = [{"role": "user", "content": "Where do the blocks live? " * 30}]
        for _ in range(2):  # the second time its prefix is in the store
            reply = client.chat.completions.with_raw_response.create(
                model="tiny", messages=msgs, max_tokens=6
            )
        usage = reply.parse().usage
        assert usage is not None and usage.completion_tokens == 6
        kv = usage.model_extra["kvstore"] if usage.model_extra else {}
        assert kv["prefill_worker"] == "p0" and kv["decode_worker"] == "d0"
        assert kv["cached_tokens"] > 0 and kv["tier"] == "dram"
        assert reply.headers["x-kvstore-prefill-worker"] == "p0"
        pids = [doc["etcd_pid"], *(n["pid"] for n in doc["nodes"])]
        pids += [w["pid"] for w in serving["workers"]] + [router["pid"]]
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    assert up.returncode == 0
    assert not [p for p in pids if _alive(p)]

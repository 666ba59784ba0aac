"""``vllm serve`` pools behind ``kvstore vllm-router`` (issue 20): OpenAI API servers of vLLM
with kvstore's connector as the prefill (kv_producer) and decode (kv_consumer) pools,
a plain ``vllm serve`` beside them, and the ``openai`` client. The router's answers
must be token for token the plain server's; the decode server must have loaded the
prompt's blocks from the store; a prompt the store holds whole skips the prefill.
Runs in .venv-vllm (``make test-vllm``)."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.support.server_process import ALPHA, ServerProcess, base_flags  # noqa: E402
from tests.support.vllm_fixtures import BLOCK, engine_env, write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
START_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiServer:
    """One ``vllm serve`` (its OpenAI server module), stopped by PID."""

    def __init__(self, model: Path, root: Path, name: str, kv: dict[str, Any] | None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"vllm-{name}.log"
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
            "--max-model-len", "2048", "--max-num-seqs", "8", "--seed", "0",
            "--distributed-executor-backend", "uni", "--enable-prefix-caching",
        ]  # fmt: skip
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=engine_env(root), cwd=ROOT
            )

    def wait_ready(self) -> None:
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve died; its log:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not ready in {START_S} s: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-serve")
    model = write_tiny_llama(root / "tiny")
    (root / "store").mkdir()
    store = ServerProcess(root / "store", base_flags(root / "store")).start()
    extra = {"endpoint": store.address, "token": ALPHA.token}

    def kv(role: str) -> dict[str, Any]:
        return {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "engine.vllm_connector",
            "kv_role": role,
            "kv_connector_extra_config": extra,
        }

    servers = {
        "prefill": ApiServer(model, root, "prefill", kv("kv_producer")),
        "decode": ApiServer(model, root, "decode", kv("kv_consumer")),
        "plain": ApiServer(model, root, "plain", None),
    }
    router: subprocess.Popen[str] | None = None
    try:
        for s in servers.values():
            s.wait_ready()
        env = {**os.environ, "KVSTORE_TOKEN": ALPHA.token}
        argv = [
            sys.executable, "-m", "engine.serving.vllm_pools",
            "--prefill", servers["prefill"].url, "--decode", servers["decode"].url,
            "--model", str(model), "--dtype", "float32", "--block-size", str(BLOCK),
            "--store", store.address, "--port", "0",
        ]  # fmt: skip
        router = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=open(root / "router.log", "w"),  # noqa: SIM115 - the child owns it
            text=True,
            env=env,
            cwd=ROOT,
        )
        assert router.stdout is not None
        ready, _, _ = select.select([router.stdout], [], [], 60)
        assert ready, (root / "router.log").read_text()
        url = json.loads(router.stdout.readline())["url"]
        yield {"router": url, "model": str(model), "store": store, **servers}
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for s in servers.values():
            s.stop()
        store.stop()


def _hits(c: Any) -> int:
    """Blocks the store served (every tier, every tenant)."""
    return sum(v for k, v in c.stats()["server"].items() if k.startswith("hits_"))


def _prompt(seed: int, n: int) -> list[int]:
    """Token ids (a completion's prompt may be ids): the blocks are then exactly known."""
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(4, 500) for _ in range(n)]


def test_the_router_answers_as_a_plain_vllm_server(stack: dict[str, Any]) -> None:
    via = openai.OpenAI(base_url=stack["router"] + "/v1", api_key="unused")
    plain = openai.OpenAI(base_url=stack["plain"].url + "/v1", api_key="unused")
    prompt = _prompt(1, 3 * BLOCK + 5)  # three full blocks and a tail
    args = dict(model=stack["model"], prompt=prompt, max_tokens=12, temperature=0.0)
    want = plain.completions.create(**args).choices[0].text
    with stack["store"].client(ALPHA) as c:
        hits_before = _hits(c)
        raw = via.completions.with_raw_response.create(**args)
        got = raw.parse().choices[0].text
        assert got == want
        assert raw.headers["x-kvstore-prefill"] == stack["prefill"].url
        assert raw.headers["x-kvstore-cached-blocks"] == "0/3"
        assert raw.headers["x-kvstore-decode"] == stack["decode"].url
        # the decode server read the prompt's blocks from the store
        assert _hits(c) >= hits_before + 3

    # the same prompt again: the store holds every full block, no prefill
    again = via.completions.with_raw_response.create(**args)
    assert again.headers["x-kvstore-prefill"] == "skipped"
    assert again.headers["x-kvstore-cached-blocks"] == "3/3"
    assert again.parse().choices[0].text == want


def test_a_streamed_answer_through_the_router_is_the_plain_one(stack: dict[str, Any]) -> None:
    via = openai.OpenAI(base_url=stack["router"] + "/v1", api_key="unused")
    plain = openai.OpenAI(base_url=stack["plain"].url + "/v1", api_key="unused")
    prompt = _prompt(2, 2 * BLOCK + 9)
    args = dict(model=stack["model"], prompt=prompt, max_tokens=10, temperature=0.0)
    want = plain.completions.create(**args).choices[0].text
    got = "".join(
        ch.choices[0].text for ch in via.completions.create(stream=True, **args) if ch.choices
    )
    assert got == want

"""``vllm serve`` pools behind ``kvstore vllm-router`` (issue 20): OpenAI API servers of vLLM
with kvstore's connector as the prefill (kv_producer) and decode (kv_consumer) pools,
a plain ``vllm serve`` beside them, and the ``openai`` client. The router's answers
must be token for token the plain server's; the decode server must have loaded the
prompt's blocks from the store; a prompt the store holds whole skips the prefill.
Runs in .venv-vllm (``make test-vllm``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from tests.support.server_process import ALPHA  # noqa: E402
from tests.support.vllm_fixtures import BLOCK, write_tiny_llama  # noqa: E402
from tests.support.vllm_serve import serve_stack  # noqa: E402

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-serve")
    with serve_stack(root, write_tiny_llama(root / "tiny"), "float32") as s:
        yield s


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
